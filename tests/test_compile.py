"""Compilation out of the way: a run compiles every program it needs before its first step and nothing
in the loop, the persistent compilation cache is written by one run and used by the next, and --profile writes a
trace. Compilations are counted (jax.monitoring events, the cache's files), never timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jax_transformer import compilation
from tests.helpers.tooling import compiled_functions, cpu_schedule
from tests.helpers.training import REPO, run_main, tiny_train_args, write_corpus

# The names jax gives the run's programs: train and eval steps are jitted lambdas, the decoders named functions.
RUN_PROGRAMS = {"jit(<lambda>)", "jit(start)", "jit(resume)", "jit(encoder)"}


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """A tiny in-process run with validation: BLEU every 3 steps (greedy, 20 sentences), a final beam-2 evaluation
    of all 300, a profile of steps 2-3. Returns (run directory, exit code and output, every compilation as
    (function, thread))."""
    root = tmp_path_factory.mktemp("compile")
    train = write_corpus(root)
    extra = ("--eval-every", "3", "--eval-sentences", "20", "--beam-size", "2", "--profile", "2:3")
    with compiled_functions() as compiled, pytest.MonkeyPatch.context() as patch:
        cpu_schedule(patch)  # the CPU's programs listed below, on any backend
        result = run_main(tiny_train_args(root / "run", train, steps=6, valid=train, extra=extra))
    return root / "run", result, compiled


@pytest.mark.slow
def test_every_program_is_compiled_ahead_and_nothing_in_the_loop(evaluated_run):
    run_dir, (code, out, err), compiled = evaluated_run
    assert code == 0, out + err
    (record,) = _records(run_dir, "compile")
    # One train step and one eval step (packed batches: one shape each), greedy decoders for the evaluations
    # during training (20 short sentences: batches of 16 and 4 rows), beam-2 decoders for the final one (300:
    # 4 x 64 rows, then 32 and 16), each with the programs its batch goes on in as it shrinks (schedule.shrink_levels:
    # beam 64 -> 16 -> 4, 32 -> 8 -> 4, 16 -> 4 sentences; greedy 16 -> 4 -> 1, 4 -> 1 rows); one cache length
    # (16: the output limit). Both evaluations have two batches or more: each batch decodes whole, on any machine
    # (on a CPU of two cores or more, two batches at once: schedule.Scheduled.for_batches). The encoder runs on a
    # batch's rows, at most 16 at a time, cut to 8 or 16 positions (schedule.encode_batch), in the groups the
    # sentences make (translation.TranslationPlan.encoder_shapes): the 20 sentences of the evaluations during training
    # have at most 8 tokens (16 x 8 and 4 x 8), the 300 of the final one up to 16 (16 x 8, 16 x 16); no group of 4 is
    # 16 wide.
    expected = [
        *[f"encoder {rows}x{width} of width 16" for rows, width in ((16, 16), (16, 8), (4, 8))],
        "gnmt beam 2 16x16 cache 16",
        "gnmt beam 2 16x16 cache 16 resumed",
        "gnmt beam 2 32x16 cache 16",
        "gnmt beam 2 4x16 cache 16 resumed",
        "gnmt beam 2 64x16 cache 16",
        "gnmt beam 2 8x16 cache 16 resumed",
        "eval step (32, 16)",
        "gnmt greedy 16x16 cache 16",
        "gnmt greedy 1x16 cache 16 resumed",
        "gnmt greedy 4x16 cache 16",
        "gnmt greedy 4x16 cache 16 resumed",
        "train step (32, 16)",
    ]
    assert record["programs"] == sorted(expected)
    assert record["errors"] == {}
    # Every program of the run was compiled by a compile-ahead thread (or was already in this process's memory),
    # none by the loop, and none twice.
    ours = [(name, thread) for name, thread in compiled if name in RUN_PROGRAMS]
    assert all(thread.startswith("compile") for _, thread in ours), ours
    names = [name for name, _ in ours]
    assert names.count("jit(start)") <= 5 and names.count("jit(resume)") <= 5
    assert names.count("jit(<lambda>)") <= 2  # the train step and the eval step
    evaluations = [(r["step"], r["final"], r["beam_size"]) for r in _records(run_dir, "eval")]
    # every decoder compiled ahead was used; step 6 is an evaluation step (eval_every 3), evaluated as during
    # training (its score competes for the best checkpoint) and then reported with the final decoding
    assert evaluations == [(3, False, 1), (6, False, 1), (6, True, 2)]
    (summary,) = _records(run_dir, "summary")
    assert set(summary) >= {"setup_s", "compile_s", "steps_s", "eval_s", "checkpoint_s"}
    assert record["seconds"] > 0 and summary["compile_s"] >= record["waited_s"] >= 0  # booked apart from the steps
    train = _records(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, 7)) and all("compile_s" in r for r in train)
    n = len(expected)
    assert f"compiling {n} programs ahead" in out and f"compiled {n} programs ahead" in out


@pytest.mark.slow
def test_profile_writes_a_trace_of_the_asked_steps(evaluated_run):
    run_dir, (code, out, _), _ = evaluated_run
    assert code == 0
    traces = sorted(p.name for p in (run_dir / "profile").rglob("*") if p.is_file())
    assert any(name.endswith(".xplane.pb") for name in traces), traces  # TensorBoard's profile plugin
    assert "perfetto_trace.json.gz" in traces  # ui.perfetto.dev
    assert "profile of steps 2:3 written to" in out


@pytest.mark.slow
def test_the_compilation_cache_is_written_by_one_run_and_used_by_the_next_and_by_a_translate(tmp_path):
    """Two train.py processes with one cache folder, each ending with a beam-2 evaluation: the first compiles and
    stores its programs (the decoders also as traced, compilation.ProgramStore), the second loads every one of
    them and stores nothing new; then `train.py translate` of the same sentences, with the same settings, compiles
    nothing and traces no decoder: it adds no cache entry (with the threshold 0 every compile would write one) and
    no stored program, and warns of nothing. (jax caches only programs that took over 1 s to compile unless told
    otherwise; the tiny model's compile faster, hence the threshold 0.)"""
    train, cache = write_corpus(tmp_path), tmp_path / "xla-cache"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    programs = cache / compilation.PROGRAMS
    extra = ("--eval-sentences", "10", "--beam-size", "2")
    records = []
    for run in ("first", "second"):
        args = tiny_train_args(tmp_path / run, train, steps=2, valid=train, compile_cache=cache, extra=extra)
        done = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args], env=env, cwd=REPO, capture_output=True, text=True
        )
        assert done.returncode == 0 and "warning:" not in done.stdout + done.stderr, done.stdout + done.stderr
        (record,) = _records(tmp_path / run, "compile")
        stored = {p.name: p.stat().st_mtime_ns for p in programs.iterdir()}
        records.append((record, compilation.cache_entries(cache), stored))
    (first, entries_first, stored_first), (second, entries_second, stored_second) = records
    assert first["cache_dir"] == second["cache_dir"] == str(cache)
    assert first["programs"] == second["programs"] and first["errors"] == {}
    assert {"eval step (32, 16)", "train step (32, 16)"} < set(first["programs"])
    assert any(name.startswith("gnmt beam 2") for name in first["programs"])  # the final evaluation's
    assert first["cache_misses"] >= 2 and first["cache_hits"] == 0  # compiled, and written to the cache
    assert first["waited_s"] > 0  # a fresh process waits for its train step, and says how long
    assert entries_first >= 2
    # Each decoder compiled ahead was stored once, and the loop's calls found it: none stored again.
    decoders = [name for name in first["programs"] if not name.startswith(("train step", "eval step"))]
    assert len([name for name in stored_first if name.endswith(".jax_exported")]) == len(decoders) > 0
    assert second["cache_hits"] >= 2 and second["cache_misses"] == 0  # every program loaded from the cache
    assert entries_second == entries_first and stored_second == stored_first  # nothing new written

    sources = tmp_path / "sources.txt"
    sources.write_text("".join(line.split("\t")[0] + "\n" for line in train.read_text().splitlines()))
    argv = ["translate", "--checkpoint", str(tmp_path / "second"), "--input", str(sources)]
    done = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *argv, "--compilation-cache", str(cache)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "warning:" not in done.stderr, done.stderr
    assert len(done.stdout.splitlines()) == len(train.read_text().splitlines())
    assert compilation.cache_entries(cache) == entries_first  # nothing compiled
    assert {p.name: p.stat().st_mtime_ns for p in programs.iterdir()} == stored_first  # every decoder found


def test_cache_setting_off_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "from-env"))
    assert compilation.default_cache_dir() == tmp_path / "from-env"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation.default_cache_dir() == tmp_path / "xdg" / "jax_transformer" / "xla"
    assert compilation.use_cache(str(tmp_path / "mine")) == tmp_path / "mine" and (tmp_path / "mine").is_dir()
    assert compilation.use_cache("off") is None
    import jax

    assert jax.config.values["jax_compilation_cache_dir"] is None
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    warnings = []
    assert compilation.use_cache(str(blocked / "cache"), warn=warnings.append) is None  # a warning, not a failure
    assert "cannot be created" in warnings[0]
