"""The demo model's corpus (tools/demo_corpus.py): documentation turned into plain text as Sphinx's
text builder would print it, the prose kept for the held-out set, chat turns made from it (the
rename tasks keep the function otherwise as it was), and nothing held out ever trained on."""

from __future__ import annotations

import ast
import base64
import gzip
import json

import pytest

from tests.models.test_demo_model import _train_demo


@pytest.fixture(scope="module")
def dc():
    _train_demo()  # puts tools/ on the path
    import demo_corpus

    return demo_corpus


RST = """\
.. _tut-if:

:keyword:`!if` Statements
=========================

.. index::
   statement: if

Perhaps the most well-known statement is :keyword:`if`; see :ref:`the tutorial <tut-for>` or
:func:`~os.path.join`, ``x = 1`` and `Python <https://python.org>`_.  For
example::

   >>> if x < 0:
   ...     x = 0

.. note::

   A note's body stays.

.. versionadded:: 3.10
"""


def test_rst_becomes_the_text_sphinx_would_print(dc):
    text = dc.rst_to_text(RST)
    assert text.splitlines()[0] == "if Statements"  # heading kept, its rule and target gone
    assert "index" not in text and "statement: if" not in text and "====" not in text
    assert "the most well-known statement is if; see the tutorial or" in text
    assert 'join, "x = 1" and Python.  For\nexample:' in text  # a link keeps its words
    assert "   >>> if x < 0:\n   ...     x = 0" in text  # the literal block as it was
    assert "Note:\n\n   A note's body stays." in text
    assert "New in version 3.10." in text


HTML = """<html><head><title>T</title><script>var x;</script></head><body>
<div class="sphinxsidebar"><p>Navigation links here.</p></div>
<div class="body"><h1>Making queries</h1>
<p>Once you have created   your models, Django gives you an API.</p>
<pre>class Blog(models.Model):
    name = models.CharField()</pre>
<ul><li>one</li><li>two</li></ul></div>
<div class="footer">Copyright.</div></body></html>"""


def test_html_keeps_the_content_and_drops_navigation(dc):
    text = dc.html_to_text(HTML)
    assert "Navigation" not in text and "Copyright" not in text and "var x" not in text
    assert "Making queries\n\nOnce you have created your models, Django gives you an API." in text
    assert "class Blog(models.Model):\n    name = models.CharField()" in text
    assert "one\n\ntwo" in text  # a list item a paragraph


def test_prose_paragraphs_are_running_sentences_only(dc):
    text = "\n\n".join(
        [
            "Making queries",  # a heading
            "Once you have created your data models, Django gives you an API to query them.",
            "    indented = code_or_quote()  # and a sentence that ends.",
            "* a list item that says quite a lot of words and ends with a full stop.",
            "x = {'a': [1, 2, 3], 'b': (4, 5)}; y = x['a'][0] + x['b'][1] * 2 // 3.",
            "A wrapped paragraph keeps its words\nbut not its line breaks, as it ends here.",
        ]
    )
    assert dc.prose_paragraphs(text).split("\n\n") == [
        "Once you have created your data models, Django gives you an API to query them.",
        "A wrapped paragraph keeps its words but not its line breaks, as it ends here.",
    ]


FUNCTION = '''def total(orders, rate):
    """Sum of the orders; value is each one."""
    value = 0
    for order in orders:
        value = value + order.value * rate
    return dict(value=value)
'''


def test_a_rename_changes_the_name_and_nothing_else(dc):
    renamed = dc.rename(FUNCTION, "rate", "factor")
    assert renamed == FUNCTION.replace("rate)", "factor)").replace("* rate", "* factor")
    ast.parse(renamed)


def test_only_names_no_other_scope_or_syntax_uses_are_renamed(dc):
    other = "def g(first, second):\n    global shared\n    shared = lambda inner: inner + first\n"
    total, g = ast.parse(FUNCTION + "\n" + other + "    return second\n").body
    # value is also an attribute and a keyword argument: renaming it would change both
    assert dc.local_names(total) == ["order", "orders", "rate"]
    # first is also used in a lambda, shared is a global, inner is the lambda's
    assert dc.local_names(g) == ["second"]


def test_an_edit_turn_answers_with_the_function_renamed(dc):
    """The answer is the question's function with one local name, named in the request, spelt
    as the other name the request gives: every other token as it was."""
    doc = dc.Document("source:shop.py", "import os\n\n\n" + FUNCTION)
    (turn,) = dc.edit_turns([doc])
    request, _, function = turn.question.partition("\n\n")
    assert function == FUNCTION
    answer = turn.answer[turn.answer.index("def total") :]
    before, after = _tokens(function), _tokens(answer)
    assert len(before) == len(after)
    changed = {(a, b) for a, b in zip(before, after, strict=True) if a != b}
    ((old, new),) = changed
    assert old in dc.local_names(ast.parse(function).body[0]) and old in request and new in request
    ast.parse(answer)


def _tokens(source: str) -> list[str]:
    import io
    import tokenize

    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)]


def test_dictd_entries_read_the_index_and_the_compressed_dictionary(dc, tmp_path):
    body = b"ABSCOND, v.i.  To move in a mysterious way.\n\n  Spring beckons!\n"
    other = b"bang on\n vt.\n\n    To stress-test a piece of hardware.\n"
    data = body + other

    def b64(n: int) -> str:
        digits = base64.b64encode(n.to_bytes(3, "big")).decode().lstrip("A")
        return digits or "A"

    (tmp_path / "d.index").write_text(
        f"00databaseinfo\tA\tB\nabscond\tA\t{b64(len(body))}\n"
        f"bang on\t{b64(len(body))}\t{b64(len(other))}\n"
    )
    (tmp_path / "d.dict.dz").write_bytes(gzip.compress(data))
    assert list(dc.dictd_entries(tmp_path / "d.index")) == [
        ("abscond", "ABSCOND, v.i.  To move in a mysterious way.\n\nSpring beckons!\n"),
        ("bang on", "bang on\n vt.\n\nTo stress-test a piece of hardware.\n"),
    ]


def test_held_out_sets_come_from_held_out_documents_only(dc):
    prose = "This sentence is about the {} document and it ends properly here."
    docs = [
        dc.Document(f"python-docs:page{i}.rst.txt", (prose.format(i) + "\n\n") * 8, "prose")
        for i in range(120)
    ]
    corpus = dc.Corpus()
    for doc in docs:
        corpus.add(doc)
    held = {d.name for d in docs if dc.is_heldout(d.name)}
    assert held and {d.name for d in corpus.heldout} == held
    text = dc.heldout_prose_text(corpus.heldout)
    for i, doc in enumerate(docs):
        assert (prose.format(i) in text) == (doc.name in held)


def test_faq_headings_become_questions_answered_by_the_prose_under_them(dc):
    text = (
        "Why is Python slow?\n\nIt is not always slow; it is interpreted, which costs time on "
        "tight loops but little elsewhere in most programs.\n\n    code = 1\n\nMore later."
    )
    (turn,) = dc.faq_turns([dc.Document("python-docs:faq/x.rst.txt", text, "prose")])
    assert turn.question == "Why is Python slow?"
    assert turn.answer.startswith("It is not always slow;") and "code = 1" not in turn.answer
    assert turn.text().startswith("[gMASK]<sop><|user|>\nWhy is Python slow?<|assistant|>\nIt is")


def test_held_out_chat_lines_are_json_with_a_question_and_an_answer(dc):
    turns = [dc.ChatTurn(f"devil:{w}", f"Define {w}.", f"{w.upper()}, n.  A thing.") for w in "ab"]
    rows = [json.loads(line) for line in dc.heldout_chat_lines(turns).splitlines()]
    assert sorted(r["question"] for r in rows) == ["Define a.", "Define b."]
    assert all(r["answer"].endswith("A thing.") for r in rows)
