"""Tests of the data pipeline (jax_transformer/data/corpus.py, tokenizer.py, batching.py) and the built-in task
(jax_transformer/data/default_task.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from jax_transformer.data import default_task
from jax_transformer.data.batching import (
    BatchStream,
    EncodedCorpus,
    bucket_lengths,
    encode_corpus,
    eval_batches,
    padding_efficiency,
    rows_per_batch,
)
from jax_transformer.data.corpus import Corpus, read_parallel, read_tsv
from jax_transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from jax_transformer.errors import DataError
from jax_transformer.settings.config import DataConfig, TransformerConfig
from tests.helpers.batches import packed_pairs

SENTENCES = [
    "the cat sat on the mat",
    "a dog barked at the postman",
    "she reads books every evening",
    "we walked along the river",
    "the weather is nice today",
    "he plays the piano quite well",
    "le chat est assis sur le tapis",
    "un chien a aboyé sur le facteur",
    "elle lit des livres chaque soir",
    "nous avons marché le long de la rivière",
    "il fait beau aujourd'hui",
    "il joue plutôt bien du piano",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(SENTENCES * 3, vocab_size=120, model_type="bpe")


def write(path, data: bytes | str):
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def synthetic(lengths: list[tuple[int, int]], max_len: int) -> EncodedCorpus:
    """An EncodedCorpus whose pair i has the given (source tokens, target tokens) lengths.

    The first token of both sides is 10 + i, so a batch row tells which pair it holds.
    """
    src, tgt = [], []
    for i, (ns, nt) in enumerate(lengths):
        src.append(np.array([10 + i] + [5] * (ns - 1) + [EOS_ID], dtype=np.int32))
        tgt.append(np.array([10 + i] + [6] * (nt - 1), dtype=np.int32))
    n = len(lengths)
    return EncodedCorpus(src, tgt, list(range(1, n + 1)), list(range(n)), "synthetic", max_len)


def realistic_lengths(n: int, max_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """Sentence lengths in tokens like a WMT corpus: log-normal around 25, target ~1.1x source, both < max_len."""
    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(np.log(22), 0.55, n)), 1, max_len - 1).astype(int)
    tgt = np.clip(np.round(src * rng.normal(1.1, 0.12, n)), 1, max_len - 1).astype(int)
    return list(zip(src.tolist(), tgt.tolist()))


def pair_ids(batch) -> list[int]:
    """The pair index of every non-padding row of a synthetic batch."""
    return [int(x) - 10 for x in batch["src"][:, 0] if x != PAD_ID]


# --- reading ----------------------------------------------------------------------------------------------------


def test_read_parallel_keeps_text_and_line_numbers(tmp_path):
    src = write(tmp_path / "a.en", b"\xef\xbb\xbfHello  world \r\nsecond\n\nlast")
    tgt = write(tmp_path / "a.fr", "Bonjour\tle monde\r\ndeuxième\nvide?\nfin\n")
    corpus = read_parallel(src, tgt)
    assert corpus.sources == ["Hello  world ", "second", "last"]  # BOM and line endings gone, spaces kept
    assert corpus.targets == ["Bonjour\tle monde", "deuxième", "fin"]
    assert corpus.line_numbers == [1, 2, 4]
    assert corpus.skipped_empty == 1 and corpus.skipped_empty_lines == [3]
    assert "skipped 1" in corpus.describe() and "lines 3" in corpus.describe()


def test_empty_lines_error_names_file_and_line(tmp_path):
    src = write(tmp_path / "a.en", "one\ntwo\nthree\n")
    tgt = write(tmp_path / "a.fr", "un\n   \ntrois\n")
    with pytest.raises(DataError, match=r"a\.fr, line 2: empty target"):
        read_parallel(src, tgt, on_empty="error")
    tsv = write(tmp_path / "t.tsv", "one\tun\n\tdeux\n")
    with pytest.raises(DataError, match=r"t\.tsv, line 2: empty source"):
        read_tsv(tsv, on_empty="error")
    corpus = read_tsv(tsv)
    assert (len(corpus), corpus.skipped_empty, corpus.skipped_empty_lines) == (1, 1, [2])


def test_line_count_mismatch(tmp_path):
    src = write(tmp_path / "a.en", "1\n2\n3\n4\n")
    tgt = write(tmp_path / "a.fr", "1\n2\n3\n")
    with pytest.raises(DataError) as e:
        read_parallel(src, tgt)
    message = str(e.value)
    assert "a.en has 4 lines but" in message and "a.fr has 3" in message and "line 4 of" in message


def test_malformed_tsv_reports_tab_count(tmp_path):
    write(tmp_path / "none.tsv", "a\tb\nno tab here\n")
    write(tmp_path / "two.tsv", "a\tb\tc\n")
    with pytest.raises(DataError, match=r"none\.tsv, line 2: .*found 0"):
        read_tsv(tmp_path / "none.tsv")
    with pytest.raises(DataError, match=r"two\.tsv, line 1: .*found 2"):
        read_tsv(tmp_path / "two.tsv")


def test_undecodable_bytes_report_line_and_offset(tmp_path):
    src = write(tmp_path / "a.en", b"fine\nbad \xff\xfe\n")
    tgt = write(tmp_path / "a.fr", b"bien\nmal\n")
    with pytest.raises(DataError, match=r"a\.en, line 2: not valid UTF-8: byte 0xff at byte offset 9 "):
        read_parallel(src, tgt)
    with pytest.raises(DataError, match=r"b\.tsv, line 1: .*0xff at byte offset 2 "):
        read_tsv(write(tmp_path / "b.tsv", b"a\t\xff\n"))


def test_missing_files_are_named(tmp_path):
    present = write(tmp_path / "a.fr", "x\n")
    with pytest.raises(DataError, match=r"nope\.en: file not found"):
        read_parallel(tmp_path / "nope.en", present)
    with pytest.raises(DataError, match=r"nope\.fr: file not found"):
        read_parallel(present, tmp_path / "nope.fr")
    with pytest.raises(DataError, match=r"nope\.tsv: file not found"):
        read_tsv(tmp_path / "nope.tsv")


# --- tokenizer -------------------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_ids(tokenizer):
    assert (PAD_ID, BOS_ID, EOS_ID) == (
        TransformerConfig().pad_id,
        TransformerConfig().bos_id,
        TransformerConfig().eos_id,
    )
    for text in SENTENCES:
        ids = tokenizer.encode(text)
        assert ids and min(ids) > UNK_ID  # no specials in plain text, and every character is known
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("the cat")
    assert tokenizer.decode([BOS_ID] + ids + [EOS_ID] + ids + [PAD_ID]) == "the cat"  # stops at EOS
    assert tokenizer.decode(np.array([BOS_ID] + ids + [PAD_ID, PAD_ID])) == "the cat"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.decode([tokenizer.vocab_size])


def test_tokenizer_serialisation(tokenizer, tmp_path):
    clone = Tokenizer.from_bytes(tokenizer.to_bytes())
    assert clone.vocab_size == tokenizer.vocab_size <= 120
    assert [clone.encode(s) for s in SENTENCES] == [tokenizer.encode(s) for s in SENTENCES]
    tokenizer.save(tmp_path / "spm.model")
    assert Tokenizer.load(tmp_path / "spm.model").encode(SENTENCES[0]) == tokenizer.encode(SENTENCES[0])
    with pytest.raises(DataError, match=r"missing\.model: tokenizer model file not found"):
        Tokenizer.load(tmp_path / "missing.model")
    with pytest.raises(DataError, match=r"bad\.model: not a SentencePiece model"):
        Tokenizer.load(write(tmp_path / "bad.model", b"not a model"))


def test_tokenizer_training_is_deterministic_and_quiet(tokenizer, capfd):
    again = Tokenizer.train(SENTENCES * 3, vocab_size=120, model_type="bpe")
    assert again.to_bytes() == tokenizer.to_bytes()
    assert capfd.readouterr() == ("", "")  # SentencePiece's logging is off
    unigram = Tokenizer.train(SENTENCES * 3, vocab_size=1000)  # too big for this corpus: shrinks, no error
    assert unigram.vocab_size < 1000 and unigram.decode(unigram.encode(SENTENCES[0])) == SENTENCES[0]


# --- encoding --------------------------------------------------------------------------------------------------


def test_encode_corpus_conventions_and_too_long(tokenizer, tmp_path):
    long_source = " ".join(SENTENCES[:6])
    tsv = write(tmp_path / "c.tsv", f"the cat\tle chat\n{long_source}\tle chat\nthe dog\t{long_source}\n")
    corpus = read_tsv(tsv)
    encoded = encode_corpus(corpus, tokenizer, max_len=16)
    assert len(encoded) == 1 and encoded.skipped_too_long == 2 and encoded.skipped_too_long_lines == [2, 3]
    assert encoded.src[0].tolist() == tokenizer.encode("the cat") + [EOS_ID]
    assert encoded.tgt[0].tolist() == tokenizer.encode("le chat")
    assert encoded.src[0].dtype == np.int32
    with pytest.raises(DataError, match=r"c\.tsv, line 2: pair too long for max_len=16: the source has \d+ tokens"):
        encode_corpus(corpus, tokenizer, max_len=16, on_too_long="error")
    # A target of n tokens fits exactly when n + 1 <= max_len.
    n = len(tokenizer.encode("le chat"))
    assert len(encode_corpus(corpus, tokenizer, max_len=n + 1)) == 1
    assert len(encode_corpus(corpus, tokenizer, max_len=n)) == 0

    ((batch, index),) = eval_batches(encoded, max_tokens=64)
    t = encoded.tgt[0].tolist()
    assert batch["tgt_in"][0, : n + 2].tolist() == [BOS_ID] + t + [PAD_ID]
    assert batch["tgt_out"][0, : n + 2].tolist() == t + [EOS_ID, PAD_ID]
    assert batch["src"][0, : len(encoded.src[0])].tolist() == encoded.src[0].tolist()
    assert index[0] == 0 and set(index[1:].tolist()) <= {-1}


# --- batching --------------------------------------------------------------------------------------------------


def test_bucket_ladder():
    assert bucket_lengths(256) == (8, 16, 24, 32, 40, 48, 56, 64, 80, 104, 136, 176, 224, 256)
    assert bucket_lengths(64)[-1] == 64 and bucket_lengths(100)[-1] == 100 and bucket_lengths(5) == (5,)
    assert rows_per_batch(64, 4096, 8) == 64 and rows_per_batch(80, 1000, 8) == 8 and rows_per_batch(200, 100) == 1


def test_batch_stream_shapes_and_coverage():
    encoded = synthetic(realistic_lengths(600, 128), max_len=128)
    stream = BatchStream(encoded, max_tokens=1000, row_multiple=4, seed=1)
    allowed = set(stream.shapes)
    assert all(rows % 4 == 0 and rows * length <= 1000 for rows, length in allowed)
    seen = []
    for _ in range(stream.batches_per_epoch):
        batch = next(stream)
        assert set(batch) == {"src", "tgt_in", "tgt_out"}
        assert batch["src"].shape in allowed and batch["src"].dtype == np.int32
        assert batch["src"].shape == batch["tgt_in"].shape == batch["tgt_out"].shape
        seen += pair_ids(batch)
    assert sorted(seen) == list(range(len(encoded)))  # each pair exactly once per epoch
    assert stream.epoch == 1


def test_batch_stream_seeds_and_epochs_differ():
    encoded = synthetic(realistic_lengths(300, 128), max_len=128)

    def first(seed, k=12):
        stream = BatchStream(encoded, max_tokens=800, seed=seed)
        return [pair_ids(next(stream)) for _ in range(k)]

    assert first(0) == first(0)
    assert first(0) != first(1)
    stream = BatchStream(encoded, max_tokens=800)
    epochs = [[pair_ids(next(stream)) for _ in range(stream.batches_per_epoch)] for _ in range(2)]
    assert epochs[0] != epochs[1]


def test_batch_stream_resume_is_exact():
    encoded = synthetic(realistic_lengths(200, 128), max_len=128)
    original = BatchStream(encoded, max_tokens=800, row_multiple=2, seed=7)
    k = original.batches_per_epoch - 3  # the continuation crosses into the next epoch
    for _ in range(k):
        next(original)
    saved = json.loads(json.dumps(original.state()))
    resumed = BatchStream(encoded, max_tokens=800, row_multiple=2, seed=7, state=saved)
    for _ in range(8):
        a, b = next(original), next(resumed)
        assert all(np.array_equal(a[key], b[key]) for key in a)
    other = BatchStream(encoded, max_tokens=400, row_multiple=2, seed=7)
    with pytest.raises(ValueError, match="does not fit this stream"):
        other.restore(saved)


def test_padding_efficiency_is_high_on_realistic_lengths():
    # 3,000 pairs of ~25 tokens in batches of 1,024 slots: ~100 batches an epoch. Real corpora give thousands;
    # with only a few dozen, the padding rows that complete each bucket's last batch would weigh more.
    encoded = synthetic(realistic_lengths(3000, 256), max_len=256)
    stream = BatchStream(encoded, max_tokens=1024, row_multiple=2)
    batches = [next(stream) for _ in range(stream.batches_per_epoch)]
    assert padding_efficiency(batches) == pytest.approx(stream.padding_efficiency)
    assert stream.padding_efficiency > 0.75
    # Without buckets (every batch padded to max_len) it would be far lower: the buckets are doing the work.
    one_bucket = synthetic(realistic_lengths(3000, 256), max_len=256)
    real = sum(len(s) + len(t) + 1 for s, t in zip(one_bucket.src, one_bucket.tgt))
    assert real / (2 * 256 * len(one_bucket)) < 0.2


def test_eval_batches_restore_corpus_order():
    encoded = synthetic(realistic_lengths(250, 128, seed=3), max_len=128)
    results = eval_batches(encoded, max_tokens=700, row_multiple=4)
    translations = [None] * len(encoded)
    for batch, index in results:
        assert batch["src"].shape[0] == len(index) and len(index) % 4 == 0
        for row, i in enumerate(index):
            if i < 0:
                assert not batch["src"][row].any() and not batch["tgt_out"][row].any()
            else:
                assert translations[i] is None
                translations[i] = int(batch["tgt_out"][row, 0])  # stands in for the model's output
    assert translations == [10 + i for i in range(len(encoded))]
    assert [index.tolist() for _, index in eval_batches(encoded, 700, row_multiple=4)] == [
        index.tolist() for _, index in results
    ]  # deterministic


# --- packed batches ---------------------------------------------------------------------------------------------


def unpack(batch) -> dict[int, tuple[np.ndarray, ...]]:
    """Every pair of a packed synthetic batch: {pair index: (src, tgt_in, tgt_out, src_positions, tgt_positions)},
    each the pair's own slice of its row."""
    pairs = {}
    for row, s, t in packed_pairs(batch):
        pieces = (batch["src"][row, s], batch["tgt_in"][row, t], batch["tgt_out"][row, t])
        pair = int(pieces[0][0]) - 10  # synthetic(): both sides start with 10 + the pair's index
        assert pair not in pairs, f"pair {pair} twice in one batch"
        pairs[pair] = (*pieces, batch["src_positions"][row, s], batch["tgt_positions"][row, t])
    return pairs


def test_packed_stream_has_one_shape_and_every_pair_once_per_epoch():
    from jax_transformer.training.trainer import PACKING_KEYS

    encoded = synthetic(realistic_lengths(1500, 128), max_len=128)
    longest = int(encoded.positions_needed().max())
    stream = BatchStream(encoded, max_tokens=2048, batching="packed", seed=3)
    length = -(-longest // 8) * 8  # the default: the longest pair rounded up to a multiple of 8
    assert stream.shapes == [(2048 // length, length)]
    for epoch in range(2):
        seen = {}
        while stream.epoch == epoch:  # the batches of one epoch (their number varies a little with the shuffle)
            batch = next(stream)
            assert set(batch) == {"src", "tgt_in", "tgt_out", *PACKING_KEYS}  # what the models take
            assert all(v.shape == stream.shapes[0] and v.dtype == np.int32 for v in batch.values())
            for pair, (src, tgt_in, tgt_out, src_pos, tgt_pos) in unpack(batch).items():
                assert pair not in seen
                seen[pair] = True
                # The whole pair, contiguous, nothing cut at the row's end; positions restart at 0.
                target = encoded.tgt[pair]
                assert np.array_equal(src, encoded.src[pair])
                assert np.array_equal(tgt_in, np.concatenate([[BOS_ID], target]))
                assert np.array_equal(tgt_out, np.concatenate([target, [EOS_ID]]))
                assert np.array_equal(src_pos, np.arange(len(src))) and np.array_equal(tgt_pos, np.arange(len(tgt_in)))
            # Padding is exactly where no segment is: no stray tokens, and segment ids without gaps.
            for side, segments in (("src", "src_segments"), ("tgt_out", "tgt_segments")):
                assert np.array_equal(batch[side] != PAD_ID, batch[segments] != 0)
        assert sorted(seen) == list(range(len(encoded))), f"epoch {epoch}: every pair exactly once"


def test_packed_epochs_are_reshuffled_by_seed_and_epoch():
    encoded = synthetic(realistic_lengths(600, 128), max_len=128)

    def epochs(seed, n=2):
        stream, out = BatchStream(encoded, max_tokens=1024, batching="packed", seed=seed), []
        for epoch in range(n):
            out.append([])
            while stream.epoch == epoch:
                out[-1].append(sorted(unpack(next(stream))))
        return out

    first = epochs(0)
    assert first == epochs(0)  # deterministic in (seed, epoch)
    assert first[0] != first[1]  # each epoch reshuffled
    assert first != epochs(1)


def test_packed_resume_mid_epoch_is_exact():
    encoded = synthetic(realistic_lengths(400, 64), max_len=64)
    original = BatchStream(encoded, max_tokens=1024, batching="packed", pack_length=64, seed=7)
    k = original.batches_per_epoch - 2  # the continuation crosses into the next epoch
    for _ in range(k):
        next(original)
    saved = json.loads(json.dumps(original.state()))
    resumed = BatchStream(encoded, max_tokens=1024, batching="packed", pack_length=64, seed=7, state=saved)
    for _ in range(6):
        a, b = next(original), next(resumed)
        assert a.keys() == b.keys() and all(np.array_equal(a[key], b[key]) for key in a)
    other = BatchStream(encoded, max_tokens=1024, batching="packed", pack_length=96, seed=7)
    with pytest.raises(ValueError, match="does not fit this stream"):
        other.restore(saved)
    with pytest.raises(ValueError, match="does not fit this stream"):  # past the end of that epoch
        original.restore({**saved, "position": len(encoded) + 5})
    before = {k: saved[k] for k in ("epoch", "index", "batches_per_epoch")}  # a state saved before positions
    with pytest.raises(ValueError, match="does not fit this stream"):
        original.restore({**before, "index": original.batches_per_epoch + 5})
    resumed.restore(before)  # cut again up to its batch: the same continuation
    again = BatchStream(encoded, max_tokens=1024, batching="packed", pack_length=64, seed=7)
    again.restore(json.loads(json.dumps(resumed.state())))  # saved again at once: now with its position
    assert again.state() == resumed.state() == saved
    original.restore(saved)
    for _ in range(6):
        a, b, c = next(original), next(resumed), next(again)
        assert all(np.array_equal(a[key], b[key]) and np.array_equal(a[key], c[key]) for key in a)


def test_packing_fills_more_slots_than_buckets():
    # Real Multi30k (docs/training.md): 94% of source and 89% of target slots real, against 77% and 74% with buckets.
    encoded = synthetic(realistic_lengths(3000, 256), max_len=256)
    packed = BatchStream(encoded, max_tokens=2048, batching="packed")
    buckets = BatchStream(encoded, max_tokens=2048, batching="buckets")
    batches = [next(packed) for _ in range(packed.batches_per_epoch)]
    assert padding_efficiency(batches) == pytest.approx(packed.padding_efficiency)
    assert packed.padding_efficiency > 0.9 > buckets.padding_efficiency
    assert packed.batches_per_epoch < buckets.batches_per_epoch


def test_packed_eval_batches_restore_corpus_order():
    encoded = synthetic(realistic_lengths(250, 128, seed=3), max_len=128)
    results = eval_batches(encoded, max_tokens=700, batching="packed")
    assert len({batch["src"].shape for batch, _ in results}) == 1  # one evaluation shape, one compilation
    found = {}
    for batch, index in results:
        pairs = unpack(batch)
        for r, members in enumerate(index):
            for k, i in enumerate(members[members >= 0]):
                src = batch["src"][r, batch["src_segments"][r] == k + 1]
                assert np.array_equal(src, encoded.src[i]) and i in pairs
                found[int(i)] = True
    assert sorted(found) == list(range(len(encoded)))


def test_packing_settings_are_checked():
    encoded = synthetic([(5, 4), (29, 20), (6, 7)], max_len=64)
    with pytest.raises(DataError, match=r"synthetic, line 2: pair needs 30 positions, more than pack_length=16"):
        BatchStream(encoded, max_tokens=256, batching="packed", pack_length=16)
    # rows = max_tokens // length (256 // 32 = 8), rounded down to a multiple of row_multiple, at least one multiple
    assert BatchStream(encoded, max_tokens=256, batching="packed", row_multiple=3).shapes == [(6, 32)]
    assert BatchStream(encoded, max_tokens=256, batching="packed", row_multiple=16).shapes == [(16, 32)]
    with pytest.raises(ValueError, match="batching must be one of"):
        BatchStream(encoded, max_tokens=256, batching="rows")
    assert BatchStream(encoded, max_tokens=256, batching="packed").shapes == [(8, 32)]  # 30 rounded up to 32
    for values, message in (
        ({"batching": "rows"}, "'batching' must be one of"),
        ({"pack_length": 1}, "'pack_length' must be an int >= 2"),
        ({"pack_length": "64"}, "'pack_length' must be an int >= 2"),
        ({"batching": "buckets", "pack_length": 64}, "'pack_length' \\(64\\) needs batching='packed'"),
    ):
        with pytest.raises(DataError, match=message):
            DataConfig(src="a", tgt="b", **values)


def test_modules_do_not_import_jax_or_torch():
    code = (
        "import sys, jax_transformer.settings.config, jax_transformer.data.corpus, jax_transformer.data.tokenizer, "
        "jax_transformer.data.batching, jax_transformer.data.default_task; "
        "print(sorted(m for m in ('jax', 'torch', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the built-in task -----------------------------------------------------------------------------------------


def test_num2words_french_is_correct():
    # Written from French grammar, not from num2words: "et" only in 21..71, "quatre-vingts" and "cents" take
    # an s only at the end of a number, "mille" never does, one thousand is "mille" not "un mille".
    expected = {
        0: "zéro",
        21: "vingt et un",
        71: "soixante et onze",
        80: "quatre-vingts",
        81: "quatre-vingt-un",
        99: "quatre-vingt-dix-neuf",
        200: "deux cents",
        201: "deux cent un",
        1000: "mille",
        2000: "deux mille",
        80_000: "quatre-vingt mille",
        200_000: "deux cent mille",
        999_999: "neuf cent quatre-vingt-dix-neuf mille neuf cent quatre-vingt-dix-neuf",
    }
    for n, french in expected.items():
        assert default_task.number_pair(n)[1] == french, n
    assert default_task.number_pair(99)[0] == "ninety-nine"
    assert default_task.number_pair(71)[0] == "seventy-one"


def test_default_task_splits_are_disjoint_and_deterministic():
    train = default_task.default_numbers("train")
    valid = default_task.default_numbers("valid")
    assert len(train) == default_task.DEFAULT_TRAIN_SIZE and len(valid) == default_task.DEFAULT_VALID_SIZE
    assert len(np.unique(train)) == len(train) and not set(train.tolist()) & set(valid.tolist())
    assert set(range(100)) <= set(train.tolist())  # every irregular word is seen in training
    assert train.max() < default_task.NUMBER_RANGE
    biggest_valid = default_task.default_numbers("valid", n=default_task.VALID_RESERVE)
    assert not set(default_task.default_numbers("train", n=50_000).tolist()) & set(biggest_valid.tolist())
    assert np.array_equal(default_task.default_numbers("train", seed=0), train)
    assert not np.array_equal(default_task.default_numbers("valid", seed=1), valid)
    digits = np.bincount([len(str(x)) for x in train])
    assert min(digits[4:7]) > 0.2 * len(train)  # long numbers are not all six-digit ones


def test_default_pairs_and_tsv(tmp_path):
    corpus = default_task.default_pairs("valid", n=20)
    assert isinstance(corpus, Corpus) and len(corpus) == 20 and corpus.origin == default_task.ORIGIN
    assert all(s == s.lower() and t == t.lower() for s, t in zip(corpus.sources, corpus.targets))
    train_path, valid_path = default_task.write_default_task(tmp_path / "task", n_train=150, n_valid=20)
    read = read_tsv(valid_path)
    assert (read.sources, read.targets) == (corpus.sources, corpus.targets)
    assert len(read_tsv(train_path)) == 150
    with pytest.raises(ValueError, match="train size"):
        default_task.default_pairs("train", n=10)
