"""Training files encoded once into memory-mapped token arrays (jax_transformer/data/token_arrays.py): they hold what
the in-memory pipeline computes, batches read from them are the same batches, a changed file or a damaged entry is
never read, and a run trained before them resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jax_transformer.data import token_arrays
from jax_transformer.data.batching import BatchStream, SpecialIds, encode_corpus
from jax_transformer.data.corpus import corpus_fingerprint, read_parallel, read_tsv
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.errors import WriteError
from tests.data.make_run_before_token_arrays import batch_digest  # the digest the old code recorded with
from tests.helpers.training import run_main, tiny_train_args, write_corpus

DATA = Path(__file__).parent / "data"
WORDS = "the a cat dog sat ran on under mat house big small red blue old new and then there here".split()


def sentence(rng: np.random.Generator, low: int = 2, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS, rng.integers(low, high)))


def write_files(folder: Path, n: int = 300) -> dict[str, Path]:
    """The same pairs as a TSV file and as two line-aligned files, with what the reader removes or skips: a
    byte-order mark, CRLF line ends, an empty side, and a pair too long for max_len 48 (the only one)."""
    rng = np.random.default_rng(0)
    pairs = [(sentence(rng), sentence(rng)) for _ in range(n)]
    pairs[4] = (pairs[4][0], " ")
    pairs[9] = (sentence(rng, 30, 31), pairs[9][1])
    folder.mkdir(parents=True, exist_ok=True)
    ends = ["\r\n" if i % 7 == 0 else "\n" for i in range(n)]
    tsv = "\ufeff" + "".join(f"{s}\t{t}{e}" for (s, t), e in zip(pairs, ends))
    (folder / "train.tsv").write_text(tsv, encoding="utf-8", newline="")
    (folder / "train.src").write_text(
        "".join(f"{s}{e}" for (s, _), e in zip(pairs, ends)), encoding="utf-8", newline=""
    )
    (folder / "train.tgt").write_text("".join(f"{t}\n" for _, t in pairs), encoding="utf-8", newline="")
    return {"tsv": folder / "train.tsv", "src": folder / "train.src", "tgt": folder / "train.tgt"}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return write_files(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer(files) -> Tokenizer:
    corpus = read_tsv(files["tsv"])
    return Tokenizer.train(corpus.sources + corpus.targets, 60, model_type="bpe")


def both_forms(files):
    """(paths, the corpus read into memory) for the TSV file and for the two line-aligned files."""
    yield [files["tsv"]], read_tsv(files["tsv"])
    yield [files["src"], files["tgt"]], read_parallel(files["src"], files["tgt"])


def test_the_arrays_hold_what_the_corpus_encodes_to_in_memory(files, tokenizer, tmp_path):
    for paths, corpus in both_forms(files):
        arrays = token_arrays.open_encoded(paths, tokenizer, cache_dir=tmp_path, print_fn=lambda _: None)
        assert arrays.describe() == corpus.describe()  # pairs kept, empty sides skipped (and where), BOM, CRLF
        assert "skipped 1 with an empty side (lines 5)" in arrays.describe() and "CRLF" in arrays.describe()
        assert arrays.fingerprint == corpus_fingerprint(corpus)  # what a resume compares
        on_disk = arrays.encoded(48, "skip", SpecialIds.of(tokenizer))
        in_memory = encode_corpus(corpus, tokenizer, 48)
        assert isinstance(arrays.src.tokens, np.memmap)
        assert on_disk.describe() == in_memory.describe() and "skipped 1 too long (lines 10)" in on_disk.describe()
        assert list(on_disk.line_numbers) == list(in_memory.line_numbers)
        assert list(on_disk.corpus_index) == list(in_memory.corpus_index)
        for i in range(len(in_memory)):
            assert (
                on_disk.src[i].tolist()
                == in_memory.src[i].tolist()
                == tokenizer.encode(corpus.sources[in_memory.corpus_index[i]]) + [tokenizer.eos_id]
            )
            assert on_disk.tgt[i].tolist() == in_memory.tgt[i].tolist()


@pytest.mark.parametrize("batching", ["packed", "buckets"])
def test_batches_read_from_disk_are_the_batches_from_memory_across_epochs_resumes_and_processes(
    files, tokenizer, tmp_path, batching
):
    arrays = token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=tmp_path, print_fn=lambda _: None)
    on_disk = arrays.encoded(24, "skip", SpecialIds.of(tokenizer))
    in_memory = encode_corpus(read_tsv(files["tsv"]), tokenizer, 24)
    settings = dict(batching=batching, row_multiple=4, seed=3)
    disk, memory = BatchStream(on_disk, 512, **settings), BatchStream(in_memory, 512, **settings)
    assert disk.batches_per_epoch == memory.batches_per_epoch >= 3 and disk.plan_key == memory.plan_key
    halves = lambda rows: np.arange(rows)[rows // 2 :]  # noqa: E731 (the rows process 1 of 2 holds)
    shared = BatchStream(on_disk, 512, **settings, process_rows=halves)
    for step in range(2 * disk.batches_per_epoch + 2):  # two epochs and into the third
        if step == disk.batches_per_epoch + 1:
            saved = json.loads(json.dumps(disk.state()))
            resumed = BatchStream(on_disk, 512, **settings, state=saved)
        a, b, share = next(disk), next(memory), next(shared)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        assert all(np.array_equal(share[k], a[k][len(a[k]) // 2 :]) for k in a)  # its rows, only those read
        assert shared.global_rows(share) == len(a["src"])
        if step >= disk.batches_per_epoch + 1:  # the resumed stream from the batch after its state on
            c = next(resumed)
            assert all(np.array_equal(a[k], c[k]) for k in a)


def test_a_second_start_maps_the_entry_without_encoding(files, tokenizer, tmp_path):
    said: list[str] = []
    first = token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=tmp_path, print_fn=said.append)
    assert len(said) == 1 and said[0].startswith("encoding ")
    second = token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=tmp_path, print_fn=said.append)
    assert len(said) == 1 and second.directory == first.directory  # nothing encoded again
    assert [p.name for p in token_arrays.entries(tmp_path)] == [first.directory.name]
    other = Tokenizer.train(read_tsv(files["tsv"]).sources, 40, model_type="bpe")  # another tokenizer: its own
    third = token_arrays.open_encoded([files["tsv"]], other, cache_dir=tmp_path, print_fn=said.append)
    assert len(said) == 2 and third.directory != first.directory


def test_an_edited_file_is_encoded_again_never_read_stale(tmp_path, tokenizer):
    path = tmp_path / "train.tsv"
    path.write_text("the cat\tthe dog\nthe mat\tthe house\n", encoding="utf-8")
    first = token_arrays.open_encoded([path], tokenizer, cache_dir=tmp_path / "cache", print_fn=lambda _: None)
    mtime = path.stat().st_mtime_ns
    path.write_text("the cat\tthe dog\nthe mat\tthe mouse\n", encoding="utf-8")  # the same size and mtime
    os.utime(path, ns=(mtime, mtime))
    second = token_arrays.open_encoded([path], tokenizer, cache_dir=tmp_path / "cache", print_fn=lambda _: None)
    assert second.directory != first.directory
    assert second.tgt[1].tolist() == tokenizer.encode("the mouse") != first.tgt[1].tolist()
    change = token_arrays.describe_change(first.meta["identity"], second.meta["identity"])
    assert change.startswith(f"{path} was 34 bytes, is now 34 bytes with other content")
    assert token_arrays.describe_change(first.meta["identity"], first.meta["identity"]) is None


def _truncate(entry: Path) -> str:
    path = entry / "src.bin"
    path.write_bytes(path.read_bytes()[:-4])
    return "src.bin holds"


def _flip(entry: Path) -> str:
    data = bytearray((entry / "tgt.bin").read_bytes())
    data[len(data) // 2] ^= 1
    (entry / "tgt.bin").write_bytes(bytes(data))
    return "tgt.bin's content does not match its SHA-256"


def _remove(entry: Path) -> str:
    (entry / "lines.bin").unlink()
    return "lines.bin is missing"


def _meta(entry: Path) -> str:
    (entry / "meta.json").write_text('{"format": 1, "arr', encoding="utf-8")
    return "meta.json is missing or unreadable"


@pytest.mark.parametrize("damage", [_truncate, _flip, _remove, _meta], ids=lambda f: f.__name__.strip("_"))
def test_a_truncated_or_damaged_entry_is_rebuilt_never_read(files, tokenizer, tmp_path, damage):
    good = token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=tmp_path, print_fn=lambda _: None)
    expected = [good.src[i].tolist() for i in range(len(good.src))]
    reason = damage(good.directory)
    said: list[str] = []
    again = token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=tmp_path, print_fn=said.append)
    assert said[0].startswith(f"warning: {good.directory}: {reason}") and said[0].endswith("encoding the corpus again")
    assert [again.src[i].tolist() for i in range(len(again.src))] == expected


def test_a_cache_folder_that_cannot_be_written_is_an_error_naming_it(files, tokenizer, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with pytest.raises(WriteError, match=f"cannot create the corpus cache folder {blocked / 'cache'}: .*--data-cache"):
        token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=blocked / "cache", print_fn=lambda _: None)
    if os.geteuid() != 0:  # root writes into any folder
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(WriteError, match=f"the corpus cache folder {locked} is not writable"):
            token_arrays.open_encoded([files["tsv"]], tokenizer, cache_dir=locked, print_fn=lambda _: None)


def test_the_tokenizer_sample_is_bounded_reproducible_and_in_corpus_order(files):
    corpus = read_tsv(files["tsv"])
    everything = token_arrays.tokenizer_sample([files["tsv"]], 10_000, seed=0)
    assert everything == corpus.sources + corpus.targets  # a corpus within the bound: all of it, as before
    sample = token_arrays.tokenizer_sample([files["tsv"]], 50, seed=0)
    assert sample == token_arrays.tokenizer_sample([files["src"], files["tgt"]], 50, seed=0)  # the same lines
    assert sample == token_arrays.tokenizer_sample([files["tsv"]], 50, seed=0)
    assert sample != token_arrays.tokenizer_sample([files["tsv"]], 50, seed=1)
    sources, targets = sample[: len(sample) // 2], sample[len(sample) // 2 :]
    assert 48 <= len(sources) <= 50  # 50 lines drawn; an empty side among them is skipped
    picked = [corpus.sources.index(s) for s in sources]
    assert picked == sorted(picked) and [corpus.targets[i] for i in picked] == targets


def test_a_run_trained_before_token_arrays_resumes_exactly(tmp_path):
    """The run in tests/data/run_before_token_arrays was trained and saved by the code before this module; its
    stream, rebuilt by today's code from its checkpoint, gives the batches that code recorded after it."""
    from jax_transformer.training import run as run_lib

    record = json.loads((DATA / "run_before_token_arrays" / "before.json").read_text())
    run_dir = tmp_path / "run"
    shutil.copytree(DATA / "run_before_token_arrays", run_dir)
    # The corpus it was trained on, where its checkpoint says it lies.
    assert write_corpus(Path(record["corpus_path"]).parent, empty_line=True, long_line=True) == Path(
        record["corpus_path"]
    )
    run = run_lib.prepare(resume=run_dir, print_fn=lambda _: None)
    try:
        assert run.stream.state()["epoch"] == record["data_state"]["epoch"]
        assert [batch_digest(next(run.stream)) for _ in record["batches_after"]] == record["batches_after"]
    finally:
        run_lib.close(run)
    code, out, err = run_main(["train", "--resume", str(run_dir), "--steps", str(record["step"] + 2)])
    assert code == 0, err
    assert f"done: step {record['step'] + 2}" in out


def test_a_resume_names_a_training_file_edited_since_its_checkpoint(tmp_path):
    corpus = write_corpus(tmp_path / "data")
    run_dir = tmp_path / "run"
    code, out, err = run_main(tiny_train_args(run_dir, corpus, steps=2, save_every=2))
    assert code == 0, err
    code, out, err = run_main(["train", "--resume", str(run_dir), "--steps", "3"])
    assert code == 0 and "encoding " not in out  # mapped from disk, not encoded again
    size = corpus.stat().st_size
    corpus.write_text(corpus.read_text().replace("one", "une", 1), encoding="utf-8")
    code, out, err = run_main(["train", "--resume", str(run_dir), "--steps", "4"])
    assert code == 1 and "Traceback" not in err
    assert err.splitlines()[-1].startswith(
        f"error: --resume: the training data changed since the checkpoint was written: {corpus} was {size:,} bytes, "
        f"is now {size:,} bytes with other content (modified "
    )
