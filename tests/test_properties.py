"""Property-based tests (hypothesis, derandomized, a few dozen examples each; settings in tests/helpers/tooling.fuzz):
the corpus readers on fuzzed files, the tokenizer round trip, batching on fuzzed corpora, and translation's
one-line-out-per-line-in rule on fuzzed input. Each test's example count is its `fuzz(n)`."""

from __future__ import annotations

import codecs

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_transformer import checks
from jax_transformer.data.batching import BatchStream, EncodedCorpus
from jax_transformer.data.corpus import read_lines, read_parallel, read_tsv
from jax_transformer.data.tokenizer import EOS_ID, PAD_ID, Tokenizer
from jax_transformer.errors import DataError
from jax_transformer.settings.config import DecodeConfig, preset
from tests.helpers.tooling import fuzz

# --- the readers --------------------------------------------------------------------------------------------------

# Line text: any characters but the line end, NUL and lone surrogates (which UTF-8 cannot encode). "\r" may appear
# inside a line, not at its end: a CR right before the "\n" is part of a CRLF line end (the reader's rule).
LINE = st.text(st.characters(blacklist_characters="\n\x00", blacklist_categories=("Cs",)), max_size=12).filter(
    lambda text: not text.endswith("\r")
)
LINE_NO_TAB = LINE.filter(lambda text: "\t" not in text)


def _file_bytes(lines: list[str], crlf: list[bool], bom: bool, final_newline: bool) -> bytes:
    ends = [b"\r\n" if c else b"\n" for c in crlf]
    if not final_newline:
        ends[-1] = b""
    return (codecs.BOM_UTF8 if bom else b"") + b"".join(line.encode("utf-8") + end for line, end in zip(lines, ends))


@st.composite
def text_file(draw, n: int, line=LINE):
    """(lines, the file's bytes, whether it starts with a BOM, how many of its line ends are CRLF)."""
    lines = draw(st.lists(line, min_size=n, max_size=n))
    crlf = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    bom = draw(st.booleans())
    final_newline = draw(st.booleans()) or lines[-1] == ""  # an empty last line exists only with its "\n"
    counted = sum(crlf[:-1]) + (crlf[-1] and final_newline)
    return lines, _file_bytes(lines, crlf, bom, final_newline), bom, counted


@st.composite
def parallel_files(draw):
    n = draw(st.integers(1, 8))
    return draw(text_file(n)), draw(text_file(n))


@fuzz(40)
@given(files=parallel_files())
def test_read_parallel_on_fuzzed_files(tmp_path_factory, files):
    (src_lines, src_bytes, src_bom, src_crlf), (tgt_lines, tgt_bytes, tgt_bom, tgt_crlf) = files
    d = tmp_path_factory.mktemp("parallel")
    (d / "a.src").write_bytes(src_bytes)
    (d / "a.tgt").write_bytes(tgt_bytes)
    kept = [(i + 1, s, t) for i, (s, t) in enumerate(zip(src_lines, tgt_lines)) if s.strip() and t.strip()]
    if not kept:
        with pytest.raises(DataError, match=r"no sentence pairs: all \d+ lines have an empty side"):
            read_parallel(d / "a.src", d / "a.tgt")
        return
    corpus = read_parallel(d / "a.src", d / "a.tgt")
    assert list(zip(corpus.line_numbers, corpus.sources, corpus.targets)) == kept
    assert corpus.skipped_empty == len(src_lines) - len(kept)
    assert corpus.stripped_boms == src_bom + tgt_bom and corpus.crlf_lines == src_crlf + tgt_crlf


@fuzz(30)
@given(data=st.data())
def test_read_tsv_on_fuzzed_files(tmp_path_factory, data):
    n = data.draw(st.integers(1, 8))
    sources, targets = (data.draw(st.lists(LINE_NO_TAB, min_size=n, max_size=n)) for _ in range(2))
    crlf = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    path = tmp_path_factory.mktemp("tsv") / "a.tsv"
    path.write_bytes(_file_bytes([f"{s}\t{t}" for s, t in zip(sources, targets)], crlf, data.draw(st.booleans()), True))
    kept = [(i + 1, s, t) for i, (s, t) in enumerate(zip(sources, targets)) if s.strip() and t.strip()]
    if not kept:
        with pytest.raises(DataError, match="no sentence pairs"):
            read_tsv(path)
        return
    corpus = read_tsv(path)
    assert list(zip(corpus.line_numbers, corpus.sources, corpus.targets)) == kept
    assert corpus.crlf_lines == sum(crlf)


BAD_BYTES = {
    "invalid UTF-8": (b"\xff", r"not valid UTF-8: byte 0xff"),
    "truncated UTF-8 sequence": (b"\xc3", r"not valid UTF-8: byte 0xc3"),
    "NUL byte": (b"\x00", r"NUL byte at byte offset \d+"),
}


@fuzz(30)
@given(
    lines=st.lists(LINE, min_size=1, max_size=8),
    where=st.integers(0, 7),
    position=st.integers(0, 12),
    kind=st.sampled_from(sorted(BAD_BYTES)),
)
def test_bad_bytes_are_refused_with_file_and_line(tmp_path_factory, lines, where, position, kind):
    where = where % len(lines)
    bad, message = BAD_BYTES[kind]
    encoded = [line.encode("utf-8") for line in lines]
    line, cut = encoded[where], min(position, len(encoded[where]))
    while 0 < cut < len(line) and (line[cut] & 0xC0) == 0x80:
        cut -= 1  # between two characters, not inside one
    encoded[where] = line[:cut] + bad + line[cut:]
    path = tmp_path_factory.mktemp("bad") / "a.txt"
    path.write_bytes(b"\n".join(encoded) + b"\n")
    with pytest.raises(DataError, match=rf"a\.txt, line {where + 1}: {message}"):
        list(read_lines(path))


def test_readers_refuse_directories_empty_files_and_utf16(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "utf16.txt").write_bytes("eins\nzwei\n".encode("utf-16"))
    (tmp_path / "ok.txt").write_text("one\ntwo\n")
    with pytest.raises(DataError, match=r"dir: is a directory, not a text file"):
        read_tsv(tmp_path / "dir")
    with pytest.raises(DataError, match=r"empty\.txt: the file is empty"):
        read_parallel(tmp_path / "empty.txt", tmp_path / "ok.txt")
    with pytest.raises(DataError, match=r"utf16\.txt, line 1: starts with a UTF-16 byte-order mark"):
        read_parallel(tmp_path / "utf16.txt", tmp_path / "ok.txt")
    assert list(read_lines(tmp_path / "empty.txt")) == []  # translate: an empty input is zero lines


def test_a_line_of_megabytes_is_read_and_then_skipped_as_too_long(tmp_path):
    from jax_transformer.data.batching import encode_corpus

    big = "wort " * 400_000  # 2 MB on one line
    (tmp_path / "a.de").write_text(f"eins zwei\n{big}\ndrei\n")
    (tmp_path / "a.en").write_text("one two\ntwo\nthree\n")
    corpus = read_parallel(tmp_path / "a.de", tmp_path / "a.en")
    assert len(corpus.sources[1]) == len(big)
    tokenizer = Tokenizer.train(corpus.sources + corpus.targets, 40, model_type="bpe")  # SentencePiece skips it
    encoded = encode_corpus(corpus, tokenizer, max_len=16)
    assert len(encoded) == 2 and encoded.skipped_too_long == 1 and encoded.skipped_too_long_lines == [2]


# --- the tokenizer --------------------------------------------------------------------------------------------------

ALPHABET = "abcdefghijklmnopqrstuvwxyzäöüéèàç0123456789,.!?'-"
WORD = st.text(st.sampled_from(ALPHABET), min_size=1, max_size=9)


@pytest.fixture(scope="module")
def tokenizer():
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list(ALPHABET), rng.integers(1, 8))) for _ in range(3000)]
    texts = [" ".join(words[i : i + 7]) for i in range(0, 3000, 7)] + [ALPHABET]  # every character seen
    return Tokenizer.train(texts, 300, model_type="bpe")


@fuzz(50)
@given(words=st.lists(WORD, max_size=12), gaps=st.lists(st.sampled_from([" ", "  ", "   "]), min_size=13, max_size=13))
def test_tokenizer_round_trip(tokenizer, words, gaps):
    """Text over characters the tokenizer has seen comes back exactly, up to SentencePiece's whitespace
    normalisation (runs of spaces become one, none at the ends); its ids are ordinary pieces (no PAD, BOS, EOS,
    UNK) inside the vocabulary, and survive an EOS and padding as a model's output row has them."""
    text = gaps[0] + "".join(w + g for w, g in zip(words, gaps[1:]))
    ids = tokenizer.encode(text)
    assert all(3 < i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == " ".join(text.split())
    assert tokenizer.decode(ids + [EOS_ID] + ids + [PAD_ID] * 3) == " ".join(text.split())


def test_a_tokenizer_that_cannot_be_trained_is_a_data_error():
    """SentencePiece's own failures (here: fewer pieces than characters) reach the command line as a DataError,
    not a traceback."""
    with pytest.raises(DataError, match="Vocabulary size is smaller than required_chars"):
        Tokenizer.train(["ab cd ef gh"], 4)


# --- batching -----------------------------------------------------------------------------------------------------

# The batch plans BatchStream offers, as extra keyword arguments: length buckets (the default). A packed plan
# joins here with its own arguments; the properties below read rows through the batch's own segment ids when a
# batch has them, so they hold for packed rows as well.
BATCH_PLANS = {"buckets": {}}


@st.composite
def corpora(draw):
    max_len = draw(st.sampled_from([8, 16, 40]))
    n = draw(st.integers(1, 60))
    lengths = draw(
        st.lists(st.tuples(st.integers(1, max_len - 1), st.integers(1, max_len - 1)), min_size=n, max_size=n)
    )
    # Pair i: ns source tokens, the first one 5 + i (so a batch row tells which pair it holds), then EOS.
    src = [np.array([5 + i] + [4] * (ns - 1) + [EOS_ID], np.int32) for i, (ns, _) in enumerate(lengths)]
    tgt = [np.full(nt, 4, np.int32) for _, nt in lengths]
    encoded = EncodedCorpus(src, tgt, list(range(1, n + 1)), list(range(n)), "fuzzed", max_len)
    return encoded, draw(st.integers(1, 400)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(0, 1000))


def _pairs_of(batch) -> list[int]:
    """The pair numbers in a batch: one per row, or one per segment of a packed row."""
    src = batch["src"]
    if "src_segments" not in batch:
        return [int(x) - 5 for x in src[:, 0] if x != PAD_ID]
    seg = batch["src_segments"]
    starts = (seg > 0) & (seg != np.pad(seg[:, :-1], ((0, 0), (1, 0))))
    return [int(x) - 5 for x in src[starts]]


@pytest.mark.parametrize("plan", list(BATCH_PLANS))
@fuzz(40)
@given(case=corpora())
def test_batching_takes_every_pair_once_per_epoch_within_budget_and_shapes(plan, case):
    encoded, max_tokens, row_multiple, seed = case
    stream = BatchStream(encoded, max_tokens, row_multiple=row_multiple, seed=seed, **BATCH_PLANS[plan])
    config = preset("tiny", src_vocab_size=5 + len(encoded), tgt_vocab_size=5, max_len=encoded.max_len)
    shapes = set(stream.shapes)
    for epoch in range(2):
        seen = []
        for _ in range(stream.batches_per_epoch):
            batch = next(stream)
            rows, length = batch["src"].shape
            assert (rows, length) in shapes  # shapes from the batch plan: the compiled step's shapes
            assert rows % row_multiple == 0
            # The token budget: rows x length slots, unless one row per device is already more than that.
            assert rows * length <= max(max_tokens, row_multiple * length)
            checks.check_batch(batch, config)  # and every batch passes the batch-boundary checks
            seen += _pairs_of(batch)
        assert sorted(seen) == list(range(len(encoded)))  # every pair exactly once per epoch
        assert stream.epoch == epoch + 1


def first_fit(src_len: np.ndarray, tgt_len: np.ndarray, order: np.ndarray, rows: int, length: int) -> list:
    """The packing as first written: one pair at a time into the first row of the open batch where both its sides
    fit, a pair that fits nowhere opening the next batch. What `batching._Packing.batches` must give."""
    batches, open_rows = [], [[] for _ in range(rows)]
    src_free, tgt_free = np.full(rows, length), np.full(rows, length)
    for i in order.tolist():
        fits = np.flatnonzero((src_free >= src_len[i]) & (tgt_free >= tgt_len[i]))
        if fits.size == 0:
            batches.append(open_rows)
            open_rows = [[] for _ in range(rows)]
            src_free[:], tgt_free[:] = length, length
            row = 0
        else:
            row = int(fits[0])
        open_rows[row].append(i)
        src_free[row] -= src_len[i]
        tgt_free[row] -= tgt_len[i]
    return batches + [open_rows]


@fuzz(40)
@given(case=corpora(), block=st.sampled_from([1, 3, 64]))
def test_packing_is_first_fit_pair_for_pair_and_resumes_at_any_batch(case, block):
    """The block-wise first fit against the one-pair-at-a-time one; a batch's start position resumes it."""
    from jax_transformer.data.batching import _Packing

    encoded, max_tokens, row_multiple, seed = case
    packing = _Packing(encoded, max_tokens, None, row_multiple, seed)
    packing._BLOCK = block
    order = np.random.default_rng((seed, 0)).permutation(len(encoded))
    expected = first_fit(packing.src_len, packing.tgt_len, order, packing.rows, packing.length)
    got = list(packing.batches(np.random.default_rng((seed, 0))))
    assert [rows for rows, _ in got] == expected
    for k, (_, position) in enumerate(got[:-1]):  # from where batch k + 1 begins: the same batches on
        again = [rows for rows, _ in packing.batches(np.random.default_rng((seed, 0)), position)]
        assert again == expected[k + 1 :]


# --- translation: one line out per line in ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def translator(tokenizer):
    from jax_transformer.model.transformer import init_params

    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=16)
    config = config.replace(num_encoder_layers=1, num_decoder_layers=1)
    return config, init_params(config, 3), tokenizer


INPUT_LINE = st.one_of(
    st.just(""),
    st.sampled_from([" ", "\t", "  \t "]),
    st.lists(WORD, min_size=1, max_size=30).map(" ".join),  # up to ~30 words: some beyond max_len
    st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=10),  # \r, U+2028 ...
)


@pytest.mark.slow
@fuzz(25)
@given(lines=st.lists(INPUT_LINE, max_size=12), chunk=st.integers(1, 5))
def test_translate_writes_one_line_per_input_line(translator, lines, chunk):
    from jax_transformer.decoding.translation import translate_lines

    config, params, tokenizer = translator
    out = []
    report = translate_lines(
        params,
        config,
        tokenizer,
        lines,
        out.append,
        on_too_long="truncate",
        chunk_size=chunk,
        progress=False,
        decode=DecodeConfig(beam_size=1),
        batch_size=4,
    )
    assert len(out) == len(lines) == report.lines
    for line, translation in zip(lines, out):
        assert "\n" not in translation and "\r" not in translation
        if not line.strip():
            assert translation == ""  # an empty (or blank) line stays empty
    too_long = [i + 1 for i, line in enumerate(lines) if line.strip() and len(tokenizer.encode(line)) > 15]
    assert report.truncated == len(too_long) and report.truncated_lines == too_long[:10]
