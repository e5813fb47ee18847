"""`translate`'s batches by a token budget (`--max-tokens`, `max_tokens=`) and over the 'data' axis of a mesh
(`--mesh data=D`): the plan (every sentence once, the budget, rows a multiple of D, the rule for a sentence wider
than the budget) and the proof that neither changes a token: greedy and beam search of the trained tiny model
(tests/data), float32 at the highest matmul precision, by budget on one device and over 8 simulated CPU devices
(`data=8`; `data=2,fsdp=4` with a budget), against 64-sentence batches on one device. The mesh runs in a child
process, this module run as a program (XLA's device count is fixed before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python -m tests.test_translate_batches RUN_DIR SOURCE_FILE
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_transformer.decoding import schedule
from jax_transformer.decoding.translation import (
    batch_buckets,
    decode_widths,
    translate_lines,
    translation_batches,
    translations,
)
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.saved import load_saved_model, saved_run
from tests.helpers.training import REPO, run_main

SEARCHES = {"greedy": DecodeConfig(beam_size=1), "beam 4": DecodeConfig(beam_size=4)}
BUDGET = 512  # token slots: 32 rows of width 16, 16 of width 32 (the 64 sentences' one batch: 64 x 32)
MESHES = {"data=8": None, "data=2,fsdp=4": BUDGET}  # each mesh, and the budget it batches by (None: 64 sentences)


def sentences(saved) -> list[str]:
    """64 sources of two widths: 43 of the model's validation sources (5-15 tokens with EOS: width 16) and 21 pairs
    of them joined by "and" (15-25 tokens: mostly width 32), mixed, so that sorting and restoring the order count."""
    texts = list(saved.source_texts)
    pairs = [f"{texts[i]} and {texts[-1 - i]}" for i in range(22)]
    return [s for three in zip(texts[:22], pairs, texts[22:44]) for s in three][:64]


def tokens(found) -> list[list[list[int]]]:
    """Each sentence's hypotheses' token ids, as JSON carries them."""
    return [[h.tokens for h in t.hypotheses] for t in found]


# =============================================================================================================
# The plan
# =============================================================================================================


def check_plan(lengths, batches, max_len: int, max_tokens: int | None, multiple: int, batch_size: int = 64) -> None:
    """Every sentence once; rows a bucket (a multiple of `multiple`) holding the batch's sentences; the width the
    first that holds its longest; within the budget, but for a batch of the smallest rows where one sentence alone
    is wider than the budget."""
    widths = decode_widths(max_len)
    assert sorted(np.concatenate([chunk for chunk, _, _ in batches] or [[]]).tolist()) == list(range(len(lengths)))
    for chunk, rows, width in batches:
        assert rows % multiple == 0 and len(chunk) <= rows, (len(chunk), rows, multiple)
        assert width == next(w for w in widths if w >= max(lengths[i] for i in chunk))
        if max_tokens is not None and rows * width > max_tokens:
            assert rows == multiple and multiple * width > max_tokens, (rows, width, max_tokens)
            assert any(multiple * next(w for w in widths if w >= lengths[i]) > max_tokens for i in chunk)
    if max_tokens is None:  # full batches of batch_size rows but the last one or two
        assert all(rows == batch_buckets(batch_size, multiple)[-1] for _, rows, _ in batches[:-2])


def test_a_budget_fills_batches_by_padded_shape_and_keeps_the_buckets():
    # 150 sources of every length 2..51 (EOS included), 1024 slots: rows x width fills the budget at each width;
    # a batch that would leave filler rows mid-corpus is cut back to a bucket (45 of width 16: 32, the other 13 go
    # with 19 of width 32); the last 6 sentences in 8 rows.
    lengths = [2 + i % 50 for i in range(150)]
    batches = translation_batches(lengths, None, 128, max_tokens=1024)
    assert [(len(chunk), rows, width) for chunk, rows, width in batches] == [
        (32, 32, 16),
        (32, 32, 32),
        (16, 16, 32),
        *[(16, 16, 64)] * 4,
        (6, 8, 64),
    ]
    check_plan(lengths, batches, 128, 1024, 1)
    # Over 8 devices on 'data': every batch a multiple of 8 rows, 8 at least.
    batches = translation_batches(lengths, None, 128, max_tokens=2048, row_multiple=8)
    assert [(len(chunk), rows, width) for chunk, rows, width in batches] == [
        (64, 64, 32),
        (32, 32, 64),
        (32, 32, 64),
        (16, 16, 64),
        (6, 8, 64),
    ]
    check_plan(lengths, batches, 128, 2048, 8)
    # Without a budget, the 64-sentence plan, its buckets multiples of the devices (64 = 8 x 8; 3 devices: 66).
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64) and batch_buckets(64, 8) == (8, 16, 32, 64)
    assert batch_buckets(64, 3) == (3, 6, 12, 24, 48, 66)
    batches = translation_batches(lengths, None, 128, row_multiple=8)
    assert [rows for _, rows, _ in batches] == [64, 64, 16, 8]  # the last 22: 16 + 8, not 32
    check_plan(lengths, batches, 128, None, 8)


def test_random_plans_take_every_sentence_once_within_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(300):
        max_len = int(rng.choice([16, 24, 64, 128, 512]))
        lengths = rng.integers(1, max_len + 1, size=int(rng.integers(0, 300))).tolist()
        multiple = int(rng.choice([1, 2, 3, 8]))
        max_tokens = int(rng.choice([1, 16, 100, 512, 4096, 40000]))
        batches = translation_batches(lengths, None, max_len, max_tokens=max_tokens, row_multiple=multiple)
        check_plan(lengths, batches, max_len, max_tokens, multiple)
        batch_size = int(rng.integers(1, 100))
        batches = translation_batches(lengths, batch_size, max_len, row_multiple=multiple)
        check_plan(lengths, batches, max_len, None, multiple, batch_size)


def test_a_sentence_wider_than_the_budget_is_decoded_in_the_smallest_batch():
    """The rule: never refused (fairseq refuses it; CTranslate2 gives it a batch of its own). It goes in a batch of
    the smallest rows, 1, or D over D devices, with the sentences beside it that fill those rows; only such a batch
    exceeds the budget."""
    lengths = [40, 5, 40, 5, 5, 40]  # width 64 and width 16; 32 slots hold 2 rows of 16, 1/2 row of 64
    plan = [
        (sorted(chunk.tolist()), rows, width)
        for chunk, rows, width in translation_batches(lengths, None, 128, max_tokens=32)
    ]
    assert plan == [([1, 3], 2, 16), ([4], 1, 16), ([0], 1, 64), ([2], 1, 64), ([5], 1, 64)]
    plan = translation_batches(lengths, None, 128, max_tokens=32, row_multiple=2)
    assert [(len(chunk), rows, width) for chunk, rows, width in plan] == [(2, 2, 16), (2, 2, 64), (2, 2, 64)]


def test_bad_batching_arguments_and_flags_name_the_value():
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1, got 0"):
        translation_batches([3], None, 128, max_tokens=0)
    with pytest.raises(ValueError, match=r"give batch_size \(64\) or max_tokens \(512\), not both"):
        translation_batches([3], 64, 128, max_tokens=512)
    with pytest.raises(ValueError, match=r"row_multiple must be an int >= 1, got 0"):
        translation_batches([3], None, 128, row_multiple=0)
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1, got 2.5"):  # before a line is read
        translate_lines(None, None, None, iter(()), print, max_tokens=2.5)
    code, out, err = run_main(["translate", "--checkpoint", "nowhere", "--max-tokens", "0"])
    assert code == 2 and "argument --max-tokens: must be an int >= 1, got 0" in err, out + err


# =============================================================================================================
# The tokens: by budget on one device, over the data axis on 8 devices, against 64-sentence batches
# =============================================================================================================


@pytest.mark.slow
def test_neither_a_token_budget_nor_the_data_axis_changes_a_token(tmp_path, monkeypatch, request):
    """Greedy and beam 4 of the trained tiny model on 64 sources, float32 at the highest matmul precision:

    - in a 64-sentence batch on one device (the reference);
    - by a budget of 512 slots on one device (three batches), through `translations` and `translate_lines` (chunks
      of 16 lines);
    - on 8 simulated CPU devices (a child process, started first: it runs beside this process's decoding), the
      weights read onto `data=8` (replicated) in 64-sentence batches and onto `data=2,fsdp=4` (split 4 ways) by the
      budget, each batch's sources placed by rows over 'data' (rows a multiple of 8 and 2);
    - `translate --mesh data=2,fsdp=4 --max-tokens 512` (`--mesh data=3` on 8 devices: an error naming the flag, the
      sizes and the device count);

    every sentence gets the reference's tokens, in order. One device decodes with `schedule.Whole` (a batch as one
    program, as on a GPU and over a mesh): the CPU's default `Scheduled` compiles several programs a shape where it
    compiles two (2.5 times the time) and gives `Whole`'s tokens (tests/test_decoding.py); what changes here is
    which sentences share a batch and where it runs."""
    monkeypatch.setattr(schedule, "default", schedule.Whole)
    saved = load_saved_model("trained_tiny")
    texts = sentences(saved)
    run, source = saved_run(tmp_path / "run"), tmp_path / "source.txt"
    source.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    child = start_on_cpu_devices(8, run, source, tmp_path)
    request.addfinalizer(child.kill)  # where the test ends before it does (nothing, once it has ended)

    lengths = [len(ids) + 1 for ids in saved.tokenizer.encode_batch(texts)]
    by_count = {(rows, width) for _, rows, width in translation_batches(lengths, None, saved.config.max_len)}
    by_budget = {
        (rows, width) for _, rows, width in translation_batches(lengths, None, saved.config.max_len, max_tokens=BUDGET)
    }
    assert by_count == {(64, 32)} and by_budget == {(32, 16), (16, 32)}  # other batches, other shapes
    with jax.default_matmul_precision("highest"):
        reference = {
            name: translations(saved.params, saved.config, saved.tokenizer, texts, decode, progress=False)
            for name, decode in SEARCHES.items()
        }
        for name, decode in SEARCHES.items():
            found = translations(saved.params, saved.config, saved.tokenizer, texts, decode, max_tokens=BUDGET,
                                 progress=False)  # fmt: skip
            assert tokens(found) == tokens(reference[name]), name
        lines = []
        translate_lines(saved.params, saved.config, saved.tokenizer, texts, lines.append, SEARCHES["greedy"],
                        chunk_size=16, max_tokens=BUDGET, progress=False)  # fmt: skip
    assert lines == [t.text for t in reference["greedy"]]

    report = finished(child, tmp_path)
    assert report["devices"] == 8
    for mesh, found in report["meshes"].items():
        assert found["split_arrays"] > 0 if "fsdp" in mesh else found["split_arrays"] == 0, (mesh, found)
        devices = int(mesh.split(",")[0].split("=")[1])  # the size of 'data'
        for rows, (spec, rows_per_device) in found["batches"]:
            assert rows % devices == 0 and spec == ["data"] and rows_per_device == rows // devices, (mesh, found)
        for name in SEARCHES:
            assert found[name] == tokens(reference[name]), (mesh, name)
    assert report["cli"]["lines"] == [t.text for t in reference["greedy"]]
    bad = report["cli"]["data=3"]
    assert bad["code"] != 0 and "--mesh data=3,fsdp=1,tensor=1" in bad["err"] and "8 devices" in bad["err"], bad


def start_on_cpu_devices(devices: int, run: Path, source: Path, folder: Path) -> subprocess.Popen:
    """This module as a program (`main`) in a child process with `devices` simulated CPU devices, its output in
    `folder`; the parent's XLA flags pass on, all but the device count."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    command = [sys.executable, "-m", "tests.test_translate_batches", str(run), str(source)]
    with open(folder / "child.out", "w") as out, open(folder / "child.err", "w") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=str(REPO))


def finished(child: subprocess.Popen, folder: Path) -> dict:
    """The "REPORT {json}" line of `start_on_cpu_devices`' child, once it has ended; its output where it failed."""
    code = child.wait(timeout=600)
    out, err = (folder / "child.out").read_text(), (folder / "child.err").read_text()
    assert code == 0, out[-2000:] + err[-3000:]
    return json.loads(out.split("REPORT ", 1)[1].splitlines()[0])


def main(run: str, source: str) -> dict:
    """In the child: each mesh's translations of the sources (`MESHES`), what each batch's sources were placed as,
    and the command line's `--mesh data=2,fsdp=4 --max-tokens` and `--mesh data=3`."""
    from jax_transformer.decoding import loading

    jax.config.update("jax_default_matmul_precision", "highest")
    placed = []  # (rows, (the sources' spec, rows per device)) of each batch `Whole.decode` got
    whole_decode = schedule.Whole.decode

    def recording(self, params, config, rules, src, rows, length):
        shard_rows = {shard.data.shape[0] for shard in src.addressable_shards}
        placed.append((src.shape[0], (list(src.sharding.spec), *shard_rows)))
        return whole_decode(self, params, config, rules, src, rows, length)

    schedule.Whole.decode = recording
    texts = Path(source).read_text(encoding="utf-8").splitlines()
    report = {"devices": jax.device_count(), "meshes": {}}
    for mesh, max_tokens in MESHES.items():
        loaded = loading.load(run, "latest", mesh=mesh)
        found = {"split_arrays": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(loaded.params))}
        placed.clear()
        for name, decode in SEARCHES.items():
            found[name] = tokens(translations(loaded.params, loaded.config, loaded.tokenizer, texts, decode,
                                              max_tokens=max_tokens, progress=False))  # fmt: skip
        found["batches"] = list(placed)
        report["meshes"][mesh] = found
    common = ["translate", "--checkpoint", run, "--input", source, "--beam-size", "1", "--no-progress"]
    code, out, err = run_main([*common, "--mesh", "data=2,fsdp=4", "--max-tokens", str(BUDGET)])  # compiled above
    assert code == 0, err
    report["cli"] = {"lines": out.splitlines()}
    code, out, err = run_main([*common, "--mesh", "data=3"])
    report["cli"]["data=3"] = {"code": code, "err": err}
    return report


if __name__ == "__main__":
    # run_main's programs go to the test session's compilation cache (inherited), or a new one: never the user's.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jax-transformer-tests-xla-"))
    print("REPORT " + json.dumps(main(*sys.argv[1:3])))
