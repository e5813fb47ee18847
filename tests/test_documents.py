"""`train.py translate --document`: a document's sentences translated in place, every separator kept byte for byte
(`jax_transformer.decoding.documents`); sentences longer than the model takes cut into parts that fit, and named; a line
of any length streamed with a bounded carry; bad bytes named by line and byte offset; the flags it refuses."""

from __future__ import annotations

import importlib.util
import io
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding import documents
from jax_transformer.decoding.documents import LINE_BREAK, Segmenter, read_blocks, stream_pieces, translate_document
from jax_transformer.decoding.translation import translate
from jax_transformer.errors import DataError, UsageError
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.saved import load_saved_model
from tests.helpers.tooling import fuzz
from tests.helpers.training import run_main

GREEDY = DecodeConfig(beam_size=1)
GERMAN = ["Ein Hund läuft.", "Die Katze schläft!", "Wo ist der Ball?"]
ENGLISH = ["A dog runs.", "The cat sleeps!", "Where is the ball?"]
# Separators with odd whitespace: double spaces, tabs, CRLF, blank lines (one of them holding spaces), U+2028.
SEPARATORS = ["  ", "\t", " ", "\r\n", "\n\n", " \t ", "\n  \n\t", "\r\n\r\n", "\u2028", " "]


def numbers(n: int) -> list[str]:
    """The built-in task's first n validation sources as sentences: "Three thousand, six hundred and sixty-six."."""
    return [source.capitalize() + "." for source in default_pairs("valid", n=n).sources]


def document(sentences: list[str]) -> tuple[str, list[str]]:
    """The sentences laid out with leading whitespace, SEPARATORS in turn and trailing spaces on a last line without
    a line break: (the text, its separators, one more than sentences)."""
    separators = ["\n \t"] + [SEPARATORS[i % len(SEPARATORS)] for i in range(len(sentences) - 1)] + ["  "]
    return "".join(sep + sentence for sep, sentence in zip(separators, sentences)) + separators[-1], separators


@pytest.fixture(scope="module")
def model():
    """The saved tiny model of the built-in task (max_len 32): its translations of German are nonsense, but each
    is the model's for that sentence."""
    return load_saved_model("trained_tiny")


# --- sentences and separators -------------------------------------------------------------------------------------

TEXT = st.lists(
    st.one_of(
        st.text(st.characters(blacklist_categories=("Cs",)), max_size=6),
        st.sampled_from([". ", "? ", "Dr. ", "A", "J\u00a0.", "\r\n", "\r", "\n\n", "\u2028", "\t", "  ", "。", ", "]),
    ),
    max_size=40,
).map("".join)


@fuzz(60)
@given(text=TEXT, language=st.sampled_from(["en", "de", "ja"]), most=st.sampled_from([None, 1, 5, 12]))
def test_pieces_join_to_the_text_alternate_and_fit(text, language, most):
    """Any text: the pieces join to it exactly; separators and sentences alternate; a separator is whitespace, a
    sentence has none around it and no line break in it, and fits where `fits` is given."""
    fits = None if most is None else (lambda s: len(s) <= most)
    pieces = Segmenter(language, fits).pieces(text)
    assert "".join(piece for piece, _ in pieces) == text
    assert all(a[1] != b[1] for a, b in zip(pieces, pieces[1:]))
    for piece, sentence in pieces:
        if sentence:
            assert piece and piece == piece.strip() and not LINE_BREAK.search(piece)
            assert fits is None or fits(piece)
        else:
            assert piece.strip() == ""


@fuzz(40)
@given(text=TEXT, cuts=st.lists(st.integers(0, 400), max_size=8), limit=st.sampled_from([8, 64, 4096]))
def test_streamed_pieces_are_the_whole_texts_pieces(text, cuts, limit):
    """The text in chunks cut anywhere: the pieces join to it, at most `limit` characters are held between chunks,
    and where no line is longer than the limit, the sentences are those of the whole text."""
    segmenter = Segmenter("en")
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    held = [0]
    streamed = list(
        stream_pieces([text[a:b] for a, b in zip(bounds, bounds[1:])], segmenter, carry_limit=limit, held=held)
    )
    assert "".join(piece.text for piece in streamed) == text
    assert held[0] <= limit
    if all(len(line) <= limit for line in LINE_BREAK.split(text)):
        assert [p.text for p in streamed if p.sentence] == [p.text for p in segmenter.split(text) if p.sentence]


def test_languages_of_models_map_to_the_splitters():
    """NLLB's, M2M-100's and mBART-50's codes of one language give one splitter code; none gives English; a code
    sentencex has no rules for is passed on (it falls back to its English rules) and still splits."""
    for code in ("deu_Latn", "de", "de_DE", "deu", "DE"):
        assert Segmenter(code).language == "de"
    assert [Segmenter(code).language for code in (None, "", "eng_Latn", "en_XX")] == ["en"] * 4
    assert [Segmenter(code).language for code in ("zho_Hant", "arb_Arab", "als_Latn", "zsm_Latn")] == [
        "zh",
        "ar",
        "sq",
        "ms",
    ]
    assert Segmenter("xx").pieces("One. Two.") == [("One.", True), (" ", False), ("Two.", True)]
    german = Segmenter("de").pieces("Dr. Müller kam am 3. Mai an. Dann ging er.")  # an abbreviation, a date
    assert [p for p, sentence in german if sentence] == ["Dr. Müller kam am 3. Mai an.", "Dann ging er."]


def test_without_sentencex_the_module_imports_and_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencex", None)  # import sentencex: ImportError
    spec = importlib.util.spec_from_file_location("documents_without_sentencex", documents.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # where its dataclasses look themselves up
    spec.loader.exec_module(module)  # imports without it
    with pytest.raises(UsageError, match=r"needs sentencex: pip install -e '\.\[documents\]'"):
        module.Segmenter("de")


# --- translating a document ---------------------------------------------------------------------------------------


def test_the_layout_survives_and_each_sentence_gets_its_own_translation(model):
    """Sentences of the built-in task and German and English ones, laid out with odd whitespace, read in blocks of 7
    bytes (characters split between blocks): the output is the document with each sentence replaced by what
    `translate` gives it among the sentences one a line, and every separator as it was."""
    sentences = numbers(8) + GERMAN + ENGLISH  # 16 tokens or fewer each: one batch shape to compile
    text, separators = document(sentences)
    written = []
    report = translate_document(
        model.params,
        model.config,
        model.tokenizer,
        read_blocks(io.BytesIO(text.encode("utf-8")), block=7),
        written.append,
        GREEDY,
        segmenter=Segmenter("de", documents.model_fits(model.tokenizer, model.config)),
        progress=False,
    )
    one_per_line = sentences[::-1]  # another order, as lines of a file
    alone = dict(zip(one_per_line, translate(model.params, model.config, model.tokenizer, one_per_line, GREEDY)))
    expected = "".join(sep + alone[s] for sep, s in zip(separators, sentences)) + separators[-1]
    assert "".join(written) == expected
    assert all(alone.values())  # each sentence has a translation of its own to stand in its place
    assert [m.group() for m in LINE_BREAK.finditer("".join(written))] == [m.group() for m in LINE_BREAK.finditer(text)]
    assert (report.sentences, report.cuts) == (len(sentences), 0)
    assert report.lines == len(LINE_BREAK.findall(text)) + 1  # the last line has no line break
    assert report.paragraphs == 1 + sum(len(LINE_BREAK.findall(sep)) >= 2 for sep in separators[1:-1])


def test_a_sentence_longer_than_the_model_takes_is_cut_where_it_may_be_and_named(model):
    """A sentence of twelve numbers (far beyond max_len 32) is cut after commas into parts that each fit, each
    translated in its place; the report names where each cut falls (line and character)."""
    fits = documents.model_fits(model.tokenizer, model.config)
    long = ", ".join(default_pairs("valid", n=12).sources).capitalize() + "."
    assert not fits(long)
    text = f"One hundred and three.\n  {long} Nine hundred.\n"
    segmenter = Segmenter("en", fits)
    pieces = segmenter.split(text)
    parts = [p.text for p in pieces if p.sentence][1:-1]
    assert len(parts) > 1 and " ".join(parts) == long and all(fits(part) for part in parts)
    assert all(part.endswith(",") for part in parts[:-1])  # cut after clause marks, not inside a number
    written = []
    report = translate_document(
        model.params, model.config, model.tokenizer, [text], written.append, GREEDY, segmenter=segmenter, progress=False
    )
    found = translate(model.params, model.config, model.tokenizer, [p.text for p in pieces if p.sentence], GREEDY)
    texts = iter(found)
    assert "".join(written) == "".join(next(texts) if p.sentence else p.text for p in pieces)
    starts = [2 + long.index(part) + 1 for part in parts[1:]]  # 1-based characters of line 2, after its 2 spaces
    assert report.cuts == len(parts) - 1 and report.cut_at == [(2, start) for start in starts][:10]
    places = ", ".join(f"2:{start}" for start in starts)
    assert report.describe().endswith(f"; {len(parts) - 1} cuts in sentences longer than the model takes, at input "
                                      f"line:character {places}")  # fmt: skip


def test_a_2_mb_line_streams_with_a_bounded_carry(monkeypatch):
    """A 2 MB line without a line break (sentences, then 500 KB of words without a sentence end, then 600 KB of
    CJK without a space) streams: at most `carry_limit` characters are held between blocks (counted), the output
    is written a chunk at a time while the input is still being read, and every sentence and part is translated in
    place. The model is replaced by upper-casing (what is measured is the streaming, not the decoding)."""
    monkeypatch.setattr(
        documents.translation, "translate", lambda *args, **kwargs: [s.upper() for s in args[3]]
    )  # (params, config, tokenizer, sentences, ...)
    text = "This is sentence number one. " * 32_000 + "word " * 100_000 + "漢" * 200_000 + " The end."
    data = text.encode("utf-8")
    assert "\n" not in text and len(data) > 2_000_000
    blocks_read, written = [0], []

    def blocks():
        for block in read_blocks(io.BytesIO(data)):
            blocks_read[0] += 1
            yield block

    report = translate_document(
        None,
        None,
        None,
        blocks(),
        lambda out: written.append((blocks_read[0], out)),
        segmenter=Segmenter("en", lambda s: len(s) <= 200),
        carry_limit=4096,
        chunk_sentences=1000,
        progress=False,
    )
    assert "".join(out for _, out in written) == text.upper()  # CJK: no space between its parts (wide)
    assert report.largest_carry <= 4096 and report.lines == 1
    assert len(written) > 10 and written[0][0] < blocks_read[0] // 2  # written while reading
    assert report.cuts > 2000 and report.sentences > 32_000


def test_sentences_nothing_separates_get_a_space_only_between_spaced_scripts():
    """Chinese sentences (no space between them) translated into English get one, into Japanese none; whitespace
    and line breaks in the source stay as they are, and a translation's line break becomes a space."""
    pieces = Segmenter("zh").split("这是句子。这也是。\n好。")
    assert [p.text for p in pieces] == ["这是句子。", "", "这也是。", "\n", "好。"]
    joined = documents._Joined()
    assert joined(pieces[:2], iter(["This is one."])) + joined(pieces[2:], iter(["So is\nthis.", "Good."])) == (
        "This is one. So is this.\nGood."
    )  # the first two in two chunks, as translate_document may write them
    assert documents._Joined()(pieces, iter(["文です。", "これも。", "良い。"])) == "文です。これも。\n良い。"


# --- bad bytes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [1, 3, 1 << 16])
@pytest.mark.parametrize(
    "data, message",
    [
        (b"Gut.\nSchlecht \xff.", "input, line 2: not valid UTF-8: byte 0xff at byte offset 14: invalid start byte"),
        (b"Gut.\nGr\xc3\xbc\xc3e.", "input, line 2: not valid UTF-8: byte 0xc3 at byte offset 9: invalid continuation"),
        (b"a\nb\nc\x00d", "input, line 3: NUL byte at byte offset 5: not UTF-8 text"),
        (b"Gut.\n\xc3", "input, line 2: not valid UTF-8 at byte offset 5: the text ends inside a character"),
        ("Gut.\n".encode("utf-16"), "input, line 1: starts with a UTF-16 byte-order mark"),
        (b"\xef\xbb\xbfok\n\xff", "input, line 2: not valid UTF-8: byte 0xff at byte offset 6"),  # the BOM counted
    ],
)
def test_bad_bytes_are_named_by_line_and_byte_offset(data, message, block):
    stream = io.BytesIO(data)
    stream.name = "input"
    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        list(read_blocks(stream, block))


def test_blocks_decode_characters_split_between_them():
    data = "\ufeffGrüße, 漢字 ✓\r\n".encode()
    assert "".join(read_blocks(io.BytesIO(data), 1)) == "Grüße, 漢字 ✓\r\n"  # the byte-order mark dropped


# --- the command line ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # the tiny_run fixture trains
def test_translate_document_on_the_command_line(tiny_run, tmp_path, monkeypatch):
    """`train.py translate --document`, from --input and from stdin: the API's output on the same checkpoint, the
    report on stderr; bad bytes are an error naming the file, line and byte offset."""
    run, _ = tiny_run
    loaded = ckpt_lib.load(run, "latest")
    text, _ = document(numbers(5) + ["two hundred, three hundred, four hundred, five hundred and six, seven."])
    path = tmp_path / "doc.txt"
    path.write_bytes(text.encode("utf-8"))
    written = []
    report = translate_document(
        loaded.params,
        loaded.config,
        loaded.tokenizer,
        [text],
        written.append,
        GREEDY,
        segmenter=Segmenter("en", documents.model_fits(loaded.tokenizer, loaded.config)),
        origin=str(path),
        progress=False,
    )
    args = ["translate", "--checkpoint", str(run), "--step", "latest", "--beam-size", "1", "--document"]
    code, out, err = run_main([*args, "--input", str(path)])
    assert code == 0, out + err
    assert out == "".join(written) and report.describe() in err and report.sentences >= 6
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8"))))
    code, out, err = run_main([*args, "--document-language", "eng_Latn"])
    assert code == 0 and out == "".join(written), out + err
    path.write_bytes(b"One.\nTwo \xff.\n")
    code, out, err = run_main([*args, "--input", str(path)])
    assert code == 1 and f"error: {path}, line 2: not valid UTF-8: byte 0xff at byte offset 9" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--output-format", "jsonl"],
            "--document writes the document, translated, as text: it takes no --output-format jsonl",
        ),
        (["--output-format", "tsv"], "it takes no --output-format tsv"),
        (["--input-format", "tsv"], "it takes no --input-format tsv"),
        (
            ["--beam-size", "4", "--n-best", "2"],
            "--document writes one translation of each sentence: it takes no --n-best 2",
        ),
    ],
)
def test_flags_document_refuses(tmp_path, flags, message):
    """Refused before the model loads (the checkpoint here does not exist)."""
    code, out, err = run_main(["translate", "--checkpoint", str(tmp_path / "none"), "--document", *flags])
    assert code == 1 and message in err and out == "", err


def test_document_without_sentencex_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencex", None)
    code, out, err = run_main(["translate", "--checkpoint", str(tmp_path / "none"), "--document"])
    assert code == 1 and "needs sentencex: pip install -e '.[documents]'" in err and out == ""
