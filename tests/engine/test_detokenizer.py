"""Incremental detokenization against full decodes of a small byte-level BPE built here."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.sampling_params import SamplingParams

CORPUS = [
    "héllo wörld 你好 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, stop here please",
]
# Characters the BPE never saw come out as one token per UTF-8 byte.
TEXT = "héllo wörld 日本 🙂 the quick brown fox stop here 你好 ok"


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    return ids


def stream(tokenizer, text, prompt="hello", **params):
    """Feed ``text``'s tokens one by one; return (detokenizer, deltas, stop reason)."""
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams(**params))
    deltas = []
    for token_id in encode(tokenizer, text):
        delta, stop = detok.add_token(token_id)
        deltas.append(delta)
        if stop is not None:
            return detok, deltas, stop
    return detok, deltas, None


def test_deltas_rebuild_the_full_decode(bpe_tokenizer):
    detok, deltas, stop = stream(bpe_tokenizer, TEXT)
    assert stop is None
    assert "".join(deltas) + detok.flush() == TEXT
    assert detok.output_text == TEXT


def test_no_delta_holds_a_broken_utf8_character(bpe_tokenizer):
    ids = encode(bpe_tokenizer, TEXT)
    assert any("\ufffd" in bpe_tokenizer.decode([i]) for i in ids), "test text needs partial tokens"
    _, deltas, _ = stream(bpe_tokenizer, TEXT)
    assert all("\ufffd" not in d for d in deltas)


def test_partial_character_is_held_back_then_released(bpe_tokenizer):
    ids = encode(bpe_tokenizer, "日")
    assert len(ids) == 3
    detok = IncrementalDetokenizer(bpe_tokenizer, [], SamplingParams())
    assert [detok.add_token(i) for i in ids] == [("", None), ("", None), ("日", None)]


def test_stop_string_across_token_boundaries(bpe_tokenizer):
    stop = "brown fox"
    assert not any(stop in bpe_tokenizer.decode([i]) for i in encode(bpe_tokenizer, TEXT))
    detok, deltas, reason = stream(bpe_tokenizer, TEXT, stop=[stop])
    assert reason == stop
    assert detok.output_text == TEXT[: TEXT.index(stop)]
    assert "".join(deltas) == detok.output_text


def test_include_stop_str_in_output_keeps_the_stop_string(bpe_tokenizer):
    detok, deltas, reason = stream(
        bpe_tokenizer, TEXT, stop=["brown fox"], include_stop_str_in_output=True
    )
    assert reason == "brown fox"
    expected = TEXT[: TEXT.index("brown fox") + len("brown fox")]
    assert detok.output_text == expected
    assert "".join(deltas) == expected


def test_multi_byte_stop_string_spanning_byte_tokens(bpe_tokenizer):
    assert len(encode(bpe_tokenizer, "本")) == 3
    detok, deltas, reason = stream(bpe_tokenizer, TEXT, stop=["本"])
    assert reason == "本"
    assert detok.output_text == "héllo wörld 日"
    assert "".join(deltas) == detok.output_text


def test_earliest_stop_string_wins(bpe_tokenizer):
    detok, _, reason = stream(bpe_tokenizer, TEXT, stop=["brown", "quick brown"])
    assert reason == "quick brown"
    assert detok.output_text == TEXT[: TEXT.index("quick brown")]


def test_possible_stop_prefix_is_held_back_then_released(bpe_tokenizer):
    stop = "wörld!"  # "wörld" looks like its start until the space shows it is not
    detok = IncrementalDetokenizer(bpe_tokenizer, [], SamplingParams(stop=[stop]))
    emitted = ""
    for token_id in encode(bpe_tokenizer, "héllo wörld 你好"):
        delta, reason = detok.add_token(token_id)
        assert reason is None
        emitted += delta
        pending = detok.output_text[len(emitted) :]
        assert stop.startswith(pending), f"held back {pending!r}, not a start of {stop!r}"
        assert not any(stop.startswith(emitted[i:]) for i in range(len(emitted)))
        if detok.output_text.endswith("wörld"):
            assert emitted == "héllo "
    assert emitted == "héllo wörld 你好"


def test_flush_releases_held_back_text(bpe_tokenizer):
    detok, deltas, reason = stream(bpe_tokenizer, "the quick bro", stop=["brown"])
    assert reason is None
    assert "".join(deltas) == "the quick "
    assert detok.flush() == "bro"
    assert detok.output_text == "the quick bro"


def test_flush_releases_a_trailing_partial_character(bpe_tokenizer):
    ids = encode(bpe_tokenizer, "ok 日")[:-1]
    detok = IncrementalDetokenizer(bpe_tokenizer, [], SamplingParams())
    deltas = [detok.add_token(i)[0] for i in ids]
    assert "".join(deltas) == "ok "
    assert detok.flush() == bpe_tokenizer.decode(ids)[len("ok ") :]


class CountingTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window(bpe_tokenizer):
    counting = CountingTokenizer(bpe_tokenizer)
    ids = encode(bpe_tokenizer, TEXT * 20)
    detok = IncrementalDetokenizer(counting, encode(bpe_tokenizer, TEXT * 5), SamplingParams())
    text = "".join(detok.add_token(i)[0] for i in ids) + detok.flush()
    assert text == TEXT * 20
    assert counting.longest <= 10


class WordTokenizer:
    """Each id decodes to one fixed piece of text."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(self.pieces[i] for i in ids)


LINA = [" is", " Lin", "a", "."]  # vLLM's tests/detokenizer/test_min_tokens.py: " is Lina."


@pytest.mark.parametrize(
    "min_tokens,stop,truth",
    [
        (0, None, " is Lina."),
        (0, "s", " i"),
        (1, "is", " is Lina."),
        (2, "is", " is Lina."),
        (3, "s", " is Lina."),
        (4, "s", " is Lina."),
        (1, "sL", " is Lina."),  # never in the text: nothing held back stays held
        (1, "s L", " i"),  # starts in the first token's text, ends in the second's
        (2, "a", " is Lin"),  # the first "a" after min_tokens
    ],
)
def test_min_tokens_holds_stop_strings_back_as_vllm_does(min_tokens, stop, truth):
    params = SamplingParams(max_tokens=20, min_tokens=min_tokens, stop=stop)
    detok = IncrementalDetokenizer(WordTokenizer(LINA), [], params)
    text, reason = "", None
    for token_id in range(len(LINA)):
        delta, reason = detok.add_token(token_id)
        text += delta
        if reason is not None:
            break
    text += detok.flush()
    assert text == truth == detok.output_text
    assert reason == (stop if truth != " is Lina." else None)


def feed(pieces: list[str], **params) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Each piece one token: (the deltas up to the stop, the stop, the detokenizer)."""
    detok = IncrementalDetokenizer(WordTokenizer(pieces), [], SamplingParams(**params))
    deltas = []
    for token_id in range(len(pieces)):
        delta, stop = detok.add_token(token_id)
        deltas.append(delta)
        if stop is not None:
            return deltas, stop, detok
    return deltas, None, detok


def test_a_stop_string_at_the_very_start_leaves_no_text():
    deltas, stop, detok = feed([" is", " Lina"], stop=[" i"])
    assert (deltas, stop, detok.output_text) == ([""], " i", "")


def test_the_first_of_two_occurrences_in_one_token_ends_the_text():
    deltas, stop, _ = feed([" one. two. three"], stop=["."])
    assert (deltas, stop) == ([" one"], ".")


@pytest.mark.parametrize("include", [False, True])
def test_of_two_stop_strings_at_one_place_the_longer_is_the_stop_reason(include):
    deltas, stop, _ = feed(
        [" a", " STOPPED"], stop=["ST", "STOP"], include_stop_str_in_output=include
    )
    assert stop == "STOP" and "".join(deltas) == (" a STOP" if include else " a ")


def test_text_kept_before_a_stop_string_is_all_sent_without_a_flush():
    # " x" could start the stop "xq", but once "zz" matched nothing more comes: all of it goes
    deltas, stop, detok = feed([" x", "zz"], stop=["zz", "xq"])
    assert stop == "zz" and "".join(deltas) == detok.output_text == " x"


def test_text_of_the_first_min_tokens_is_sent_when_it_can_no_longer_stop():
    # min_tokens 1: the first token's "is" never ends the sequence, so it is not held back
    deltas, stop, _ = feed([" is", " Lin"], stop=["is"], min_tokens=1)
    assert (deltas, stop) == ([" is", " Lin"], None)


def test_a_token_after_the_stop_string_is_refused_naming_it():
    _, stop, detok = feed([" a", " STOP"], stop=["STOP"])
    with pytest.raises(RuntimeError, match="add_token after the stop string 'STOP' matched; the"):
        detok.add_token(0)
    assert "takes no more tokens" in str(pytest.raises(RuntimeError, detok.add_token, 0).value)


class MetaspaceTokenizer(WordTokenizer):
    """As SentencePiece decodes: the text's first space is dropped, special tokens skipped."""

    SPECIAL = {"<sp>"}

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        pieces = [self.pieces[i] for i in ids]
        if skip_special_tokens:
            pieces = [p for p in pieces if p not in self.SPECIAL]
        return "".join(pieces).removeprefix(" ")


def test_the_previous_tokens_stay_as_context_so_no_word_loses_its_space():
    pieces = [" one", "<sp>", " two", " three"]
    detok = IncrementalDetokenizer(MetaspaceTokenizer(pieces), [], SamplingParams())
    deltas = [detok.add_token(i)[0] for i in range(len(pieces))]
    assert deltas == ["one", "", " two", " three"]  # decoded alone, " two" would lose its space
