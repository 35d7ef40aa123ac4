"""The demo model's corpus: CPython's own text and the English documentation of Debian packages,
cut into documents that are trained on or held out by a hash of their name; chat turns in GLM-4's
format made from them; and the held-out texts that pagedserve/data ships for measuring the model.

The documentation comes from these packages (SOURCES and DICTIONARIES give each one's licence;
`tools/train_demo.py --corpus docs` refuses to start without them, naming the missing ones):

    apt-get install python3.11-doc python-django-doc docutils-doc sphinx-doc \\
        python-requests-doc postgresql-doc-15 sqlite3-doc dict-devil dict-jargon

Held-out sets, none of them trained on (tools/train_demo.py writes them, benchmarks.demo_heldout
measures them through the server):
- cpython: the start of every held-out CPython document (help topics and standard-library
  sources): the model's own domain;
- prose: the English prose paragraphs (no code, headings, lists or tables) of every held-out
  documentation page: pages the model never saw, of manuals it read others of;
- dictionaries: the same of every held-out entry of the Devil's Dictionary and the Jargon File:
  literary and slang English, a few percent of what the model read;
- chat: held-out chat turns answered in words (help topics, FAQ answers, glossary and dictionary
  definitions), scored on the answer.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import html
import io
import itertools
import json
import keyword
import os
import random
import re
import sysconfig
import textwrap
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from pagedserve.models.tokenizer import SPECIAL_TOKENS

PROMPT_PREFIX = "[gMASK]<sop>"  # how every GLM-4 prompt opens
CHAT_PROMPT = PROMPT_PREFIX + "<|user|>\n{question}<|assistant|>\n"  # the chat template's turn
DATA_DIR = Path(__file__).resolve().parents[1] / "pagedserve" / "data"
HELDOUT_FILES = {
    "cpython": DATA_DIR / "demo_heldout.txt",
    "prose": DATA_DIR / "demo_heldout_prose.txt",
    "dictionaries": DATA_DIR / "demo_heldout_dictionaries.txt",
    "chat": DATA_DIR / "demo_heldout_chat.jsonl",
    "edits": DATA_DIR / "demo_heldout_edits.jsonl",  # rename turns: how well the model copies
}
HELDOUT_SHIPPED_CHARS = 100_000
# encodings/ is mostly generated codec tables: a megabyte of hex that teaches nothing useful.
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "__pycache__",
    "encodings",
}


@dataclass(slots=True)
class Document:
    name: str
    text: str
    # "code": CPython's help topics and sources; "prose": a documentation page; "dictionary": an
    # entry of a dictionary
    kind: str = "code"


@dataclass(frozen=True, slots=True)
class ChatTurn:
    name: str  # held out with the document it came from
    question: str
    answer: str

    def text(self) -> str:
        return CHAT_PROMPT.format(question=self.question) + self.answer + "<|endoftext|>"


@dataclass(slots=True)
class Corpus:
    train: list[Document] = field(default_factory=list)
    heldout: list[Document] = field(default_factory=list)

    def add(self, doc: Document) -> None:
        (self.heldout if is_heldout(doc.name) else self.train).append(doc)


def clean(text: str) -> str:
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    return text


def _digest(text: str) -> bytes:
    """The order documents and turns are shuffled into, and what seeds their random choices."""
    return hashlib.sha256(text.encode()).digest()


def is_heldout(name: str) -> bool:
    return int.from_bytes(_digest(name), "big") % 20 == 0


def _hash_key(doc: Document) -> bytes:
    return _digest(doc.name)


# ---------------------------------------------------------------- CPython (the code domain)


def topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(f"topic:{key}", clean(topics[key])) for key in sorted(topics)]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("test"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    files = [f for f in files if not f.name.startswith("test_") and f.name != "topics.py"]
    return sorted(files, key=lambda f: _digest(str(f.relative_to(root))))


def source_documents(max_bytes: int, max_file_bytes: int) -> list[Document]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in _stdlib_files():
        text = clean(path.read_text(encoding="utf-8", errors="replace"))[:max_file_bytes]
        if total + len(text) > max_bytes:
            break
        if not text.strip():
            continue
        docs.append(Document(f"source:{path.relative_to(root).as_posix()}", text))
        total += len(text)
    return docs


# ---------------------------------------------------------------- reStructuredText to text

# directives whose lines and indented body carry no prose
_DROPPED_DIRECTIVES = {
    "index", "highlight", "module", "currentmodule", "sectionauthor", "moduleauthor", "toctree",
    "contents", "tabularcolumns", "testsetup", "testcleanup", "include", "literalinclude",
    "image", "figure", "raw", "audit-event", "autosummary", "automodule", "autoclass",
    "autofunction", "rst-class", "only", "csv-table", "list-table", "table", "default-role",
    "role", "opcode", "c:macro", "c:type", "c:member", "c:var", "cmdoption", "option",
    "envvar", "program", "productionlist", "grammar-snippet", "pdbcommand", "2to3fixer",
}  # fmt: skip
_ADMONITIONS = {"note", "warning", "seealso", "tip", "important", "caution", "hint", "attention"}
_VERSION_NOTES = {"versionadded": "New in version", "versionchanged": "Changed in version",
                  "deprecated": "Deprecated since version"}  # fmt: skip
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_COMMENT = re.compile(r"^(\s*)\.\.(\s|$)")
_UNDERLINE = re.compile(r"^\s*([=\-~*^#\"'`+.:_])\1{2,}\s*$")
_ROLE = re.compile(r":[\w:+-]+:`([^`]+)`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>`]+>`__?")
_REF = re.compile(r"`([^`]+)`_{1,2}")


def _role_text(match: re.Match) -> str:
    text = match.group(1)
    if "<" in text and text.endswith(">"):  # :ref:`shown text <target>`
        return text[: text.rindex("<")].strip()
    text = text.lstrip("!")
    return text.rsplit(".", 1)[-1] if text.startswith("~") else text


def rst_inline(line: str) -> str:
    line = _ROLE.sub(_role_text, line)
    line = _LINK.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = re.sub(r"``([^`]+)``", r'"\1"', line)
    line = re.sub(r"\*\*([^*]+)\*\*", r"\1", line)
    line = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", line)
    line = re.sub(r"\|(\w[\w -]*)\|", r"\1", line)
    return line.replace("\\ ", "")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_text(source: str) -> str:
    """Plain text of a reST document, close to what Sphinx's text builder (and so pydoc's help
    topics) would print: directives dropped or reduced to their text, roles and links to their
    words, heading underlines gone, literal blocks kept as they are."""
    lines = source.splitlines()
    out: list[str] = []
    skip_below: int | None = None  # drop lines indented deeper than this
    literal_below: int | None = None  # keep lines indented deeper than this as they are
    for line in lines:
        indent = _indent(line)
        if skip_below is not None:
            if not line.strip() or indent > skip_below:
                continue
            skip_below = None
        if literal_below is not None:
            if not line.strip() or indent > literal_below:
                out.append(line.rstrip())
                continue
            literal_below = None
        directive = _DIRECTIVE.match(line)
        if directive:
            lead, name, argument = directive.groups()
            name = name.lower()
            if name in _ADMONITIONS:
                out.append(f"{lead}{name.capitalize()}: {rst_inline(argument)}".rstrip())
            elif name in _VERSION_NOTES:
                out.append(f"{lead}{_VERSION_NOTES[name]} {argument}.")
            elif name in ("code-block", "sourcecode", "code", "doctest", "parsed-literal"):
                literal_below = len(lead)
            elif name in _DROPPED_DIRECTIVES or not argument:
                skip_below = len(lead) if name in _DROPPED_DIRECTIVES else None
            else:  # function, class, method, describe, ...: the signature, then the body
                out.append(f"{lead}{rst_inline(argument)}")
            continue
        if _COMMENT.match(line):  # a comment or a link target: drop it and its indented lines
            skip_below = indent
            continue
        if _UNDERLINE.match(line) or re.match(r"^\s*:[\w-]+:( .*)?$", line):
            continue  # heading rules; field lists of directive options
        if line.rstrip().endswith("::"):
            literal_below = indent
            line = line.rstrip()[:-2].rstrip()
            line = line + ":" if line.strip() else ""
            if not line:
                continue
        out.append(rst_inline(line.rstrip()))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


# ---------------------------------------------------------------- HTML to text

_BLOCKS = {"p", "div", "li", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "tr",
           "table", "ul", "ol", "dl", "blockquote", "section", "br", "hr", "title"}  # fmt: skip
_SKIPPED_TAGS = {"script", "style", "nav", "header", "footer", "head", "button", "form"}
_SKIPPED_CLASSES = re.compile(
    r"\b(nav\w*|menu\w*|search\w*|sidebar\w*|sphinxsidebar|related|breadcrumbs?|footer|"
    r"header|headerlink|toc\w*|fancy[-_]?toc\w*|titlepage|hd|ft|global-nav|tagline\w*)\b"
)


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, skipped)
        self.pre = 0

    def _skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        names = f"{attrs.get('class') or ''} {attrs.get('id') or ''}"
        skipped = tag in _SKIPPED_TAGS or bool(_SKIPPED_CLASSES.search(names))
        if tag not in ("br", "hr", "img", "meta", "link", "input", "col", "wbr"):
            self.stack.append((tag, skipped))
        if tag in _BLOCKS:
            self.parts.append("\n\n" if tag not in ("br", "li", "dt", "dd", "tr") else "\n")
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag):
        while self.stack:
            top, _ = self.stack.pop()
            if top == tag:
                break
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self._skipping():
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.parts or self.parts[-1].endswith("\n"):
                data = data.lstrip()
        self.parts.append(data)


def html_to_text(source: str) -> str:
    parser = _TextExtractor()
    parser.feed(source)
    text = html.unescape("".join(parser.parts)).replace("\xa0", " ").replace("¶", "")
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


# ---------------------------------------------------------------- dictd dictionaries


def dictd_entries(index: Path) -> Iterator[tuple[str, str]]:
    """(headword, definition) of a dictd database: its .index and its dictzip'd .dict.dz."""
    data = gzip.open(index.with_suffix(".dict.dz")).read()
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def number(b64: str) -> int:
        value = 0
        for ch in b64:
            value = value * 64 + alphabet.index(ch)
        return value

    for line in index.read_text(encoding="utf-8").splitlines():
        word, offset, length = line.split("\t")[:3]
        if word.startswith("00database"):
            continue
        body = data[number(offset) : number(offset) + number(length)].decode("utf-8", "replace")
        paragraphs = [textwrap.dedent(p).strip() for p in re.split(r"\n\s*\n", body)]
        entry = "\n\n".join(p for p in paragraphs if p)
        if "\n" in entry or len(entry) > 2 * len(word) + 10:  # more than a bare headword
            yield word, entry + "\n"


# ---------------------------------------------------------------- documentation sources


@dataclass(frozen=True, slots=True)
class Source:
    name: str
    package: str  # the Debian package that ships it
    licence: str
    root: str
    pattern: str
    convert: Callable[[str], str]
    skip: str = r"$^"  # a regex of relative paths to leave out


SOURCES = [
    Source("python-docs", "python3.11-doc", "PSF License 2.0",
           "/usr/share/doc/python3.11/html/_sources", "**/*.rst.txt", rst_to_text,
           r"^(c-api|whatsnew/changelog|includes|distutils|license)"),
    Source("sphinx-docs", "sphinx-doc", "BSD-2-Clause",
           "/usr/share/doc/sphinx-doc/html/_sources", "**/*.rst.txt", rst_to_text,
           r"^(changes|man/)"),
    Source("requests-docs", "python-requests-doc", "Apache-2.0",
           "/usr/share/doc/python-requests-doc/html/_sources", "**/*.rst.txt", rst_to_text,
           r"^community/updates"),
    Source("docutils-docs", "docutils-doc", "public domain (docs), BSD-2-Clause",
           "/usr/share/doc/docutils-doc", "**/*.txt", rst_to_text, r"HISTORY|THANKS|mwe-test"),
    Source("django-docs", "python-django-doc", "BSD-3-Clause",
           "/usr/share/doc/python-django-doc/html", "**/*.html", html_to_text,
           r"^(_modules|releases|genindex|search|py-modindex)"),
    Source("postgresql-docs", "postgresql-doc-15", "PostgreSQL License",
           "/usr/share/doc/postgresql-doc-15/html", "*.html", html_to_text,
           r"^(release-|bookindex|biblio|docguide)"),
    Source("sqlite-docs", "sqlite3-doc", "public domain",
           "/usr/share/doc/sqlite3", "*.html", html_to_text, r"^(releaselog|changes|chronology)"),
]  # fmt: skip
DICTIONARIES = [
    ("devil", "dict-devil", "public domain", "The Devil's Dictionary (Ambrose Bierce, 1911)"),
    ("jargon", "dict-jargon", "public domain", "The Jargon File 4.4.7"),
]


def _package_version(package: str) -> str | None:
    status = Path("/var/lib/dpkg/status")
    if not status.exists():
        return None
    match = re.search(
        rf"^Package: {re.escape(package)}\n(?:[^\n]+\n)*?Version: (\S+)", status.read_text(), re.M
    )
    return match.group(1) if match else None


def corpus_sources() -> list[dict]:
    """What --corpus docs trains on: CPython's own text, then each documentation source with its
    Debian package, that package's version here and its licence."""
    rows = [{"name": "cpython", "package": "python (its standard library and pydoc topics)",
             "version": sysconfig.get_python_version(), "licence": "PSF License 2.0"}]  # fmt: skip
    rows += [
        {
            "name": s.name,
            "package": s.package,
            "version": _package_version(s.package),
            "licence": s.licence,
        }
        for s in SOURCES
    ]
    rows += [
        {
            "name": f"{name} ({title})",
            "package": package,
            "version": _package_version(package),
            "licence": licence,
        }
        for name, package, licence, title in DICTIONARIES
    ]
    return rows


def missing_packages() -> list[str]:
    missing = [s.package for s in SOURCES if not Path(s.root).is_dir()]
    return missing + [
        p for n, p, *_ in DICTIONARIES if not Path(f"/usr/share/dictd/{n}.index").exists()
    ]


def prose_documents(max_chars: int) -> list[Document]:
    docs = []
    for source in SOURCES:
        root = Path(source.root)
        for path in sorted(root.glob(source.pattern)):
            relative = path.relative_to(root).as_posix()
            if re.search(source.skip, relative):
                continue
            text = clean(source.convert(path.read_text(encoding="utf-8", errors="replace")))
            if len(text) >= 500:
                docs.append(Document(f"{source.name}:{relative}", text[:max_chars], "prose"))
    for name, *_ in DICTIONARIES:
        index = Path(f"/usr/share/dictd/{name}.index")
        if index.exists():
            for word, entry in dictd_entries(index):
                docs.append(Document(f"{name}:{word}", clean(entry), "dictionary"))
    return docs


def prose_paragraphs(text: str) -> str:
    """The paragraphs of running English in a document: flush left, mostly words, ending as a
    sentence ends; no headings, code, tables, lists or signatures."""
    kept = []
    for paragraph in re.split(r"\n\s*\n", text):
        if not paragraph.strip() or paragraph[0].isspace():
            continue
        flat = " ".join(paragraph.split())
        words = flat.split()
        letters = sum(c.isalpha() or c == " " for c in flat)
        if (
            len(words) >= 8
            and flat[-1] in ".!?\"')"
            and letters >= 0.85 * len(flat)
            and not re.match(r"^([-*+•]|\d+[.)]|>>>)\s", flat)
        ):
            kept.append(flat)
    return "\n\n".join(kept)


# ---------------------------------------------------------------- the corpus


def build_corpus(
    max_source_bytes: int = 4_000_000, max_file_bytes: int = 8_000, prose: bool = True
) -> Corpus:
    corpus = Corpus()
    docs = topic_documents() + source_documents(max_source_bytes, max_file_bytes)
    for doc in docs + (prose_documents(4 * max_file_bytes) if prose else []):
        corpus.add(doc)
    return corpus


def heldout_eval_text(docs: list[Document], chars_per_doc: int = 3000) -> str:
    """The start of every held-out CPython document, help topics and sources interleaved by
    hash: the model's own domain."""
    docs = sorted((d for d in docs if d.kind == "code"), key=_hash_key)
    return "\n\n".join(d.text[:chars_per_doc].strip() for d in docs)[:HELDOUT_SHIPPED_CHARS]


def heldout_prose_text(docs: list[Document], kind: str = "prose", chars_per_doc: int = 1500) -> str:
    """The prose paragraphs of every held-out document of ``kind`` (documentation pages, or
    dictionary entries), interleaved by hash: up to ``chars_per_doc`` of each, in whole
    paragraphs (a page's first, if that is longer)."""
    docs = sorted((d for d in docs if d.kind == kind), key=_hash_key)
    min_chars = 200 if kind == "prose" else 40  # an entry is short: a definition or two
    pieces = [prose_paragraphs(d.text)[:chars_per_doc].rsplit("\n\n", 1)[0] for d in docs]
    pieces = [p for p in pieces if len(p) >= min_chars]
    return "\n\n".join(pieces)[:HELDOUT_SHIPPED_CHARS]


# ---------------------------------------------------------------- chat turns


def _rng(name: str) -> random.Random:
    return random.Random(_digest(name))


def first_paragraph(text: str, max_chars: int = 500) -> str:
    """The first prose paragraphs of a help text: no heading, no indented grammar or code."""
    prose = []
    for paragraph in text.strip().split("\n\n"):
        lines = paragraph.split("\n")
        if len(lines) >= 2 and set(lines[1]) <= set("*=-~^") and lines[1]:
            lines = lines[2:]
        paragraph = "\n".join(lines).strip()
        if not paragraph or lines[0].startswith(" "):
            if prose:
                break
            continue
        if prose and len("\n\n".join(prose + [paragraph])) > max_chars:
            break
        prose.append(paragraph)
    if len(prose) > 1 and prose[-1].endswith(":"):
        prose.pop()
    return "\n\n".join(prose)[:max_chars]


def _topic_questions(key: str) -> list[str]:
    if keyword.iskeyword(key):
        return [f"What does the {key} statement do?", f"Explain the {key} keyword."]
    name = key.replace("-", " ")
    return [f"What is {name} in Python?", f"Explain {name}."]


def _module_name(doc_name: str) -> str:
    path = doc_name.removeprefix("source:").removesuffix(".py").removesuffix("/__init__")
    return path.replace("/", ".")


def help_turns(docs: list[Document]) -> list[ChatTurn]:
    """Questions about Python answered by the first paragraph of a help topic or docstring."""
    from pydoc_data.topics import topics

    turns = []
    for doc in docs:
        if doc.name.startswith("topic:"):
            key = doc.name.removeprefix("topic:")
            answer = first_paragraph(topics[key])
            turns += [ChatTurn(doc.name, q, answer) for q in _topic_questions(key)]
        elif doc.name.startswith("source:"):
            try:
                docstring = ast.get_docstring(ast.parse(doc.text))
            except (SyntaxError, ValueError):
                continue
            if docstring and len(docstring) > 40:
                module, answer = _module_name(doc.name), first_paragraph(docstring)
                turns.append(ChatTurn(doc.name, f"Explain the {module} module.", answer))
                turns.append(ChatTurn(doc.name, f"What is {module} for?", answer))
    return turns


def _prose_answer(paragraphs: list[str], max_chars: int = 600) -> str:
    answer = []
    for paragraph in paragraphs:
        if not prose_paragraphs(paragraph):
            break
        if answer and len("\n\n".join(answer + [paragraph])) > max_chars:
            break
        answer.append(paragraph.strip())
    return "\n\n".join(answer)


def faq_turns(docs: list[Document]) -> list[ChatTurn]:
    """A question that a documentation page asks as a heading, answered by the prose under it."""
    turns = []
    for doc in docs:
        if doc.kind != "prose":
            continue
        paragraphs = re.split(r"\n\s*\n", doc.text)
        for i, heading in enumerate(paragraphs[:-1]):
            heading = heading.strip()
            if "\n" in heading or not heading.endswith("?") or not 3 <= len(heading.split()) <= 20:
                continue
            answer = _prose_answer(paragraphs[i + 1 :])
            if len(answer) >= 80:  # a numbered section ("32.2. When to JIT?") asks without it
                turns.append(ChatTurn(doc.name, re.sub(r"^\d+(\.\d+)*\.\s+", "", heading), answer))
    return turns


_GLOSSARY_QUESTIONS = ["What is {a} {term}?", "What does \"{term}\" mean?", "Define {term}.",
                       "What is meant by {term} in Python?"]  # fmt: skip


def glossary_turns(docs: list[Document]) -> list[ChatTurn]:
    """Glossary entries (Python's and Sphinx's): "What is a <term>?" -> its definition."""
    turns = []
    for doc in docs:
        if not doc.name.endswith("glossary.rst.txt"):
            continue
        entries = re.findall(r"^ {3}(\S[^\n]*)\n((?: {6}[^\n]*\n|\n)+)", doc.text, re.M)
        for term, body in entries:
            definition = _prose_answer(re.split(r"\n\s*\n", textwrap.dedent(body).strip()))
            if len(definition) < 40:
                continue
            term = term.strip().strip('"')
            name = f"{doc.name}#{term}"
            a = "an" if term[:1].lower() in "aeiou" else "a"
            question = _rng(name).choice(_GLOSSARY_QUESTIONS).format(a=a, term=term)
            turns.append(ChatTurn(doc.name, question, definition))
    return turns


def dictionary_turns(docs: list[Document]) -> list[ChatTurn]:
    """The Devil's Dictionary ("Define abscond.") and the Jargon File ("What does ... mean?")."""
    turns = []
    for doc in docs:
        source, _, word = doc.name.partition(":")
        if source == "devil":
            answer = _prose_answer(doc.text.split("\n\n"), 800)
            question = _rng(doc.name).choice(["Define {w}.", "What is {w}?", "What does {w} mean?"])
            if len(answer) >= 40:
                turns.append(ChatTurn(doc.name, question.format(w=word.lower()), answer))
        elif source == "jargon":
            answer = _prose_answer(doc.text.split("\n\n")[1:])
            question = _rng(doc.name).choice(
                [
                    'What does "{w}" mean in hacker jargon?',
                    'What is "{w}"?',
                    "Explain the term {w}.",
                ]
            )
            if len(answer) >= 40:
                turns.append(ChatTurn(doc.name, question.format(w=word), answer))
    return turns


# ---------------------------------------------------------------- edit tasks (copying code)

_NEW_NAMES = ["amount", "item", "result", "total", "count", "entry", "data", "node", "key",
              "text", "buf", "index", "size", "parts", "record", "target", "source", "value",
              "items", "name", "line", "current", "found", "output", "state", "element", "chunk",
              "pending", "limit", "offset"]  # fmt: skip
_EDIT_REQUESTS = [
    "Rename the variable `{old}` to `{new}` in this function and return the whole function.",
    "Rename `{old}` to `{new}` in the following function.",
    "In this function, change the name `{old}` to `{new}` everywhere it is used.",
    "Please rename {old} to {new}:",
    "Refactor this function: call `{old}` `{new}` instead.",
]
_EDIT_INTROS = ["", "Here is the function with `{old}` renamed to `{new}`:\n\n",
                "Sure. `{old}` is now `{new}`:\n\n"]  # fmt: skip


def local_names(function: ast.FunctionDef) -> list[str]:
    """Arguments and assigned names of a function that are never an attribute, a keyword
    argument or a name in a nested scope: renaming them changes nothing else."""
    owned = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    owned |= {
        n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    clashes = {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute)}
    clashes |= {
        g for n in ast.walk(function) if isinstance(n, (ast.Global, ast.Nonlocal)) for g in n.names
    }
    clashes |= {k.arg for k in ast.walk(function) if isinstance(k, ast.keyword) and k.arg}
    for inner in ast.walk(function):
        if inner is not function and isinstance(inner, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            clashes |= {n.id for n in ast.walk(inner) if isinstance(n, ast.Name)}
    return sorted(n for n in owned - clashes - {"self", "cls"} if len(n) >= 2)


def rename(source: str, old: str, new: str) -> str:
    """`source` with every name token `old` (not an attribute after a dot) spelt `new`."""
    lines = source.splitlines(keepends=True)
    spots, previous = [], None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string == old and previous != ".":
            spots.append(token.start)
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.string
    for row, col in reversed(spots):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old) :]
    return "".join(lines)


def edit_turns(docs: list[Document], per_file: int = 3) -> list[ChatTurn]:
    """Rename a local variable in a standard-library function: the answer copies the function
    with the one change, which teaches the model to copy from its prompt."""
    turns = []
    for doc in docs:
        if not doc.name.startswith("source:"):
            continue
        try:
            tree = ast.parse(doc.text)
        except (SyntaxError, ValueError):
            continue
        functions = [f for f in tree.body if isinstance(f, ast.FunctionDef)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                functions += [f for f in node.body if isinstance(f, ast.FunctionDef)]
        rng = _rng(doc.name)
        rng.shuffle(functions)
        lines, made = doc.text.splitlines(keepends=True), 0
        for function in functions:
            if made >= per_file or not 4 <= function.end_lineno - function.lineno + 1 <= 20:
                continue
            source = textwrap.dedent("".join(lines[function.lineno - 1 : function.end_lineno]))
            names = [n for n in local_names(function) if source.count(n) >= 2]
            if not names:
                continue
            old = rng.choice(names)
            new = rng.choice([n for n in _NEW_NAMES if n not in source] or ["renamed"])
            try:
                renamed = rename(source, old, new)
                ast.parse(renamed)
            except (SyntaxError, tokenize.TokenError, IndentationError):
                continue
            request = rng.choice(_EDIT_REQUESTS).format(old=old, new=new)
            intro = rng.choice(_EDIT_INTROS).format(old=old, new=new)
            turns.append(ChatTurn(doc.name, f"{request}\n\n{source}", f"{intro}{renamed}"))
            made += 1
    return turns


def answer_turns(docs: list[Document]) -> list[ChatTurn]:
    """The chat turns answered in words (the held-out chat set is made of these)."""
    return [*help_turns(docs), *faq_turns(docs), *glossary_turns(docs), *dictionary_turns(docs)]


def chat_turns(docs: list[Document], edits_per_file: int = 3) -> list[ChatTurn]:
    return [*answer_turns(docs), *edit_turns(docs, edits_per_file)]


def heldout_chat_lines(turns: list[ChatTurn], max_turns: int = 300) -> str:
    """Held-out chat turns as JSON lines ({"question", "answer"}), the sources taking turns."""
    kinds: dict[str, list[ChatTurn]] = {}
    for turn in sorted(turns, key=lambda t: _digest(t.question)):
        kinds.setdefault(turn.name.split(":")[0], []).append(turn)
    rounds = itertools.zip_longest(*kinds.values())
    mixed = [turn for group in rounds for turn in group if turn is not None]
    rows = [{"question": t.question, "answer": t.answer} for t in mixed[:max_turns]]
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
