"""Scaling out through train.py: two real processes on 127.0.0.1, resumes on other device counts, one stop
decision for all processes, a dead peer, and the errors of the new flags.

One session-scoped fixture (`runs`) trains the tiny 1+1-layer model on the tiny numbers corpus, in child
processes that share a persistent compilation cache, in two stages of concurrent runs:

    stage 1   two-process  2 processes x 4 simulated CPU devices on the mesh data=2,fsdp=2,tensor=2 (the state
                           split over fsdp and tensor, each process writing its own shards of a checkpoint), 5 steps,
                           with validation (the final evaluation)
              eight        1 process, 8 devices, the same mesh, 5 steps
              one          1 process, 1 device, 8 steps, checkpoints at 5 and 8: the uninterrupted reference
    stage 2   two-process  resumed in 1 process on 1 device with --accumulate 4, to step 8
              eight        resumed on 8 devices as (8,1,1), the state replicated, to step 8
              one's step 5 (a copy without step 8) resumed on 4 devices, to step 8

and the tests compare what they wrote. Tolerances are those of tests/test_training.py's parallel-path test (float
summation order, amplified by Adam on noise-level gradients; see there), with every largest difference printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.training.distributed import EXIT_PEER_LOST
from tests.helpers.training import (
    completed_steps,
    finish,
    free_port,
    logged_steps,
    process_flags,
    run_main,
    start_train_process,
    tiny_train_args,
    wait_for,
    write_corpus,
)
from tests.helpers.twins import flat


def _valid_file(directory: Path) -> Path:
    """16 held-out pairs of the numbers task (beyond the training corpus's 0..299)."""
    from jax_transformer.data.default_task import number_pair

    path = directory / "valid.tsv"
    path.write_text("".join("\t".join(number_pair(n)) + "\n" for n in range(500, 516)), encoding="utf-8")
    return path


MESH = "data=2,fsdp=2,tensor=2"  # the mesh of the two-process run and of its one-process twin


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale")
    train, valid, cache = write_corpus(d), _valid_file(d), d / "xla-cache"
    dirs = {name: d / name for name in ("two-process", "eight", "one", "one-on-four")}

    def start(name, argv, devices, log_name=None):
        return start_train_process(
            argv, d / f"{log_name or name}.log", cache, devices=devices
        ), d / f"{log_name or name}.log"

    # --- stage 1 ---------------------------------------------------------------------------------------------
    port = free_port()
    two = [
        start(
            "two-process",
            tiny_train_args(
                dirs["two-process"],
                train,
                steps=5,
                valid=valid,
                extra=(
                    "--eval-sentences",
                    "16",
                    "--beam-size",
                    "1",
                    "--mesh",
                    MESH,
                    *process_flags(port, 2, i),
                ),
            ),
            4,
            f"two-process-{i}",
        )
        for i in range(2)
    ]
    eight = start("eight", tiny_train_args(dirs["eight"], train, steps=5, extra=("--mesh", MESH)), 8)
    one = start("one", tiny_train_args(dirs["one"], train, steps=8, save_every=5), 1)
    started = [*two, eight, one]
    codes = finish([p for p, _ in started], [log for _, log in started])
    for (_, log), code in zip(started, codes):
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-3000:]}"

    # --- stage 2: resumes on other device counts ------------------------------------------------------------
    shutil.copytree(dirs["one"], dirs["one-on-four"])
    shutil.rmtree(dirs["one-on-four"] / "checkpoints" / "8")  # as if the 1-device run had stopped at step 5
    # run -> devices of its resume, and its flags: the two-process run goes on in 4 micro-batches (unpacked
    # batches through --accumulate; tests/helpers/parallel_paths.py checks accumulation on packed ones)
    resumes = {"two-process": (1, ["--accumulate", "4"]), "eight": (8, []), "one-on-four": (4, [])}
    resumed = [
        start(
            name,
            ["train", "--resume", str(dirs[name]), "--steps", "8", "--no-progress", *flags],
            devices,
            f"{name}-resumed",
        )
        for name, (devices, flags) in resumes.items()
    ]
    codes = finish([p for p, _ in resumed], [log for _, log in resumed])
    for (_, log), code in zip(resumed, codes):
        assert code == 0, f"{log.name} exited {code}:\n{log.read_text()[-3000:]}"
    return {"dirs": dirs, "logs": d}


def _state(run_dir: Path, step: int) -> dict[str, np.ndarray]:
    return flat(ckpt_lib.load(run_dir, step).state)


def _train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _compare(name: str, got: dict, want: dict, start: dict) -> str:
    """Asserts the float arrays of two flat states agree within float summation order (per tensor, the distance
    is <= 1e-4 of how far the tensor moved since `start`; key biases left out, see the module docstring) and the
    others (step, the dropout key's words) are equal. Returns a line with the largest differences."""
    assert got.keys() == want.keys()
    relative, max_abs = {}, 0.0
    for key, value in want.items():
        if value.dtype.kind != "f":
            assert np.array_equal(got[key], value), f"{name}: {key}"
            continue
        if not key.startswith("['params']"):
            continue  # Adam's moments follow the gradients; the parameters are what the tolerance is about
        if "'key']['bias'" in key:
            continue
        diff = got[key].astype(np.float64) - value
        max_abs = max(max_abs, float(np.max(np.abs(diff))))
        relative[key] = float(np.linalg.norm(diff) / np.linalg.norm(value.astype(np.float64) - start[key]))
    worst = max(relative, key=relative.get)
    assert relative[worst] <= 1e-4, f"{name}: {worst} differs by {relative[worst]:.2e} of its movement"
    return f"{name}: worst tensor {worst} {relative[worst]:.1e} of its movement, max abs {max_abs:.1e}"


def _start(run: Path) -> dict[str, np.ndarray]:
    """The initial parameters of a run (its step-0 state is not saved): a fresh state from the same seed."""
    from jax_transformer.training import trainer

    loaded = ckpt_lib.load(run, "latest")
    state = trainer.create_train_state(loaded.config, trainer.OptimConfig.from_dict(loaded.optim), seed=0)
    return {f"['params']{k}": v for k, v in flat(state.params).items()}


@pytest.mark.slow
def test_two_processes_equal_one_process_on_eight_devices_and_on_one(runs):
    """5 steps, dropout on: 2 processes x 4 devices with the state split over the mesh (2,2,2) == 1 process x 8
    devices on the same mesh == 1 device (jit). Each process wrote its own shards of the step-5 checkpoint; it is
    read here onto the host."""
    dirs = runs["dirs"]
    two, eight, one = (_state(dirs[name], 5) for name in ("two-process", "eight", "one"))
    start = _start(dirs["one"])
    lines = [
        _compare("2 processes x 4 devices vs 1 process x 8, mesh (2,2,2)", two, eight, start),
        _compare("8 devices, mesh (2,2,2) vs 1 device (jit)", eight, one, start),
    ]
    # The losses each step reported, as process 0 logged them (once per step), agree as in the parallel-path test.
    losses = {name: _train_losses(dirs[name]) for name in ("two-process", "eight", "one")}
    assert sorted(losses["two-process"]) == list(range(1, 9))  # once per step (6-8 by its resume, below)
    for step in range(1, 6):
        assert losses["two-process"][step] == pytest.approx(losses["one"][step], rel=1e-6)
        assert losses["eight"][step] == pytest.approx(losses["one"][step], rel=1e-6)
    lines.append(
        "losses: two processes vs one device "
        f"{max(abs(losses['two-process'][s] / losses['one'][s] - 1) for s in range(1, 6)):.1e} relative"
    )
    print("\n  ".join(["multi-process and device counts, step 5:", *lines]))


@pytest.mark.slow
def test_process_zero_alone_writes_and_prints(runs):
    dirs, logs = runs["dirs"], runs["logs"]
    run = dirs["two-process"]
    assert {"tokenizer.model", "config.json", "metrics.jsonl", "loss_curve.png", "checkpoints"} <= {
        p.name for p in run.iterdir()
    }
    assert logged_steps(run) == 8  # one line per step (steps 6-8 by its resume): process 1 wrote none
    first, second = ((logs / f"two-process-{i}.log").read_text() for i in range(2))
    assert "model:" in first and "step 5: valid loss" in first
    assert "process 1 of 2" in second and "model:" not in second and "valid loss" not in second


@pytest.mark.slow
def test_validation_of_a_multi_process_run_is_what_one_process_reports(runs):
    """The final evaluation of the two-process run (every process evaluates its own copy of the parameters,
    gathered from their fsdp and tensor shards; process 0 logs) against `train.py evaluate` of the same checkpoint
    in this single process. Same parameters, same one-device programs, same batches (--max-tokens 512 as the
    run): the loss agrees to float32 rounding (1e-6 relative) and the greedy translations, hence BLEU and chrF,
    exactly."""
    run = runs["dirs"]["two-process"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["kind"] == "eval" and r["step"] == 5]
    assert len(final) == 1 and final[0]["final"] and final[0]["sentences"] == 16
    code, out, err = run_main(
        ["evaluate", "--checkpoint", str(run), "--step", "5", "--beam-size", "1", "--max-tokens", "512"]
    )
    assert code == 0, out + err
    single = json.loads(out.strip().splitlines()[-1])
    assert single["loss"] == pytest.approx(final[0]["valid_loss"], rel=1e-6)
    assert (single["bleu"], single["chrf"]) == (final[0]["bleu"], final[0]["chrf"])
    print(
        f"two-process validation: loss {final[0]['valid_loss']:.6f} (one process {single['loss']:.6f}), "
        f"BLEU {final[0]['bleu']:.2f} (one process {single['bleu']:.2f})"
    )


@pytest.mark.slow
def test_resumes_on_other_device_counts_continue_like_the_uninterrupted_run(runs):
    """Step 5 checkpoints resumed to step 8 on another device count or mesh: the two-process run (mesh (2,2,2)) on
    1 device (with --accumulate 4), the one-process (2,2,2) run on (8,1,1) (read straight onto that mesh), the
    1-device run on 4, against the 1-device run that went from 0 to 8 without stopping.
    The batch plan does not depend on the device count (--row-multiple), nor do the dropout masks, so each
    continues with the same batches and masks. Losses of steps 6-8: relative 1e-5 (the runs start from states
    that differ by the float-order noise bounded above, which moves a loss by ~1e-6 relative)."""
    dirs = runs["dirs"]
    reference = _state(dirs["one"], 8)
    start = _start(dirs["one"])
    reference_losses = _train_losses(dirs["one"])
    lines = []
    for name, label in (
        ("two-process", "2 processes x 4 devices, mesh (2,2,2) -> 1 device, 4 micro-batches"),
        ("eight", "8 devices, mesh (2,2,2) -> (8,1,1)"),
        ("one-on-four", "1 device -> 4 devices"),
    ):
        resumed = ckpt_lib.load(dirs[name], "latest")
        assert resumed.step == 8
        lines.append(_compare(label, flat(resumed.state), reference, start))
        losses = _train_losses(dirs[name])
        assert sorted(losses) == list(range(1, 9))  # the resume logged steps 6-8 once each
        worst = max(abs(losses[s] / reference_losses[s] - 1) for s in range(6, 9))
        assert worst <= 1e-5, f"{label}: losses of steps 6-8 differ by {worst:.1e}"
        lines[-1] += f"; losses of steps 6-8 {worst:.1e} relative"
    print("\n  ".join(["resumed at step 5 on another device count, step 8 against the uninterrupted run:", *lines]))


# --- one decision for all processes; a dead peer ----------------------------------------------------------------


def _stream_position_after(run, batches: int) -> dict:
    """The BatchStream position a run's settings reach after `batches` batches, computed afresh."""
    from jax_transformer.data.batching import BatchStream, encode_corpus
    from jax_transformer.data.reading import load_corpus
    from jax_transformer.settings.config import DataConfig

    loaded = ckpt_lib.load(run, "latest")
    data = DataConfig.from_dict(loaded.run["data"])
    encoded = encode_corpus(load_corpus(data, "train"), loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    stream = BatchStream(
        encoded,
        data.max_tokens,
        batching=data.batching,
        pack_length=data.pack_length,
        row_multiple=data.row_multiple,
        seed=loaded.run["seed"],
    )
    for _ in range(batches):
        next(stream)
    return stream.state()


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_and_a_dead_peer_stops_the_other(tmp_path):
    """1. Two processes train; SIGTERM goes to process 1 only. Both must leave the loop at the same step (the
    reason is agreed at each step boundary), save that step together and exit with 128 + 15.
    2. The run resumed in two processes (saving every 2 steps); process 1 is SIGKILLed mid-run. Process 0 must end
    with the project's own message (which process stopped answering, the newest complete checkpoint, the command
    that resumes) and exit status 5, before JAX's coordination service would abort it (--heartbeat-timeout 5:
    SIGABRT with a fatal C++ log line)."""
    train, run, cache = write_corpus(tmp_path), tmp_path / "run", tmp_path / "xla-cache"
    args = tiny_train_args(run, train, steps=100000, save_every=100000)
    port = free_port()
    logs = [tmp_path / f"first-{i}.log" for i in range(2)]
    processes = [start_train_process(args + process_flags(port, 2, i), logs[i], cache, devices=2) for i in range(2)]
    try:
        wait_for(lambda: logged_steps(run) >= 3, processes[0], logs[0])
        assert processes[1].poll() is None
        processes[1].send_signal(signal.SIGTERM)
    finally:
        codes = finish(processes, logs, timeout=120)
    texts = [log.read_text() for log in logs]
    assert codes == [128 + signal.SIGTERM] * 2, texts[0][-2000:] + texts[1][-2000:]
    stopped = logged_steps(run)
    assert f"stopped by SIGTERM at step {stopped}" in texts[0]
    assert completed_steps(run) == [stopped]  # saved once, together, at the step where both stopped
    # The data position saved is the one after exactly `stopped` batches (not where the prefetch thread got to).
    assert ckpt_lib.load(run, "latest").data_state == _stream_position_after(run, stopped)

    port = free_port()
    logs = [tmp_path / f"second-{i}.log" for i in range(2)]
    resume = ["train", "--resume", str(run), "--steps", "100000", "--save-every", "2", "--no-progress"]
    processes = [start_train_process(resume + process_flags(port, 2, i), logs[i], cache, devices=2) for i in range(2)]
    try:
        wait_for(lambda: logged_steps(run) >= stopped + 2, processes[0], logs[0])
        processes[1].send_signal(signal.SIGKILL)
        killed_at = time.time()
        code = finish([processes[0]], [logs[0]], timeout=60)[0]
        waited = time.time() - killed_at
    finally:
        finish(processes, logs, timeout=10)
    text = logs[0].read_text()
    assert code == EXIT_PEER_LOST, text[-2000:]
    said = re.search(
        rf"error: process 1 stopped answering \(its connection closed without the run ending: it was killed or "
        rf"crashed\); process 0 of 2 stops too\. In {re.escape(str(run))} the newest complete checkpoint is step "
        rf"(\d+); resume the run with `train\.py train --resume {re.escape(str(run))} --coordinator "
        rf"127\.0\.0\.1:{port} --num-processes 2 --process-id I` in each process I = 0 \.\. 1",
        text,
    )
    assert said, text[-2000:]
    # The step named is a complete checkpoint, the newest one then (a save can complete as the process ends).
    assert int(said.group(1)) in completed_steps(run) and int(said.group(1)) >= completed_steps(run)[-1] - 2
    assert "Terminating process" not in text and waited < 5, text[-2000:]  # ahead of JAX's heartbeat abort
    print(
        f"SIGTERM to process 1 stopped both at step {stopped}; after SIGKILL of process 1, process 0 exited with "
        f"{code} after {waited:.1f} s"
    )


def test_a_bad_line_that_process_zero_finds_stops_both_processes(tmp_path):
    """Process 0 alone reads the training file (for the tokenizer's sample, then to encode it; the others read what
    it wrote): a bad line it finds must end both processes with the line named, not leave process 1 waiting at a
    barrier (`distributed.primary_first`)."""
    train, run, cache = write_corpus(tmp_path), tmp_path / "run", tmp_path / "xla-cache"
    lines = train.read_text(encoding="utf-8").splitlines()
    lines[200] = lines[200].replace("\t", " ")  # line 201: no tab
    train.write_text("\n".join(lines) + "\n", encoding="utf-8")
    port = free_port()
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    argv = tiny_train_args(run, train, steps=2)
    processes = [start_train_process(argv + process_flags(port, 2, i), logs[i], cache, devices=2) for i in range(2)]
    codes = finish(processes, logs, timeout=120)
    texts = [log.read_text() for log in logs]
    assert codes == [1, 1], texts
    bad = f"{train}, line 201: expected exactly one tab between source and target, found 0"
    assert f"error: {bad}" in texts[0]
    assert f"error: process 0 stopped while training the tokenizer: DataError: {bad}" in texts[1], texts[1]


# --- bad values of the new flags: a clear error, quickly -----------------------------------------------------------


def test_bad_parallel_flags_are_clear_errors(tmp_path):
    train = write_corpus(tmp_path)
    base = tiny_train_args(tmp_path / "run", train, steps=1)
    cases = {
        "process id out of range": (
            ["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2 is out of range for --num-processes 2",
        ),
        "accumulate 0": (
            ["--accumulate", "0"],
            "argument --accumulate: parallel field 'accumulate' must be an int >= 1, got 0",
        ),
        "rows not divisible": (["--accumulate", "3"], "rows, which do not split evenly over 1 device(s) x 3"),
        "malformed coordinator": (
            ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "1"],
            "expected HOST:PORT",
        ),
        "coordinator without the rest": (["--coordinator", "127.0.0.1:9"], "needs --num-processes and --process-id"),
        "pmap across processes": (
            ["--parallel", "pmap", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1"],
            "--parallel pmap runs in one process",
        ),
        "row multiple 0": (["--row-multiple", "0"], "'row_multiple' must be an int >= 1, got 0"),
    }
    for name, (flags, message) in cases.items():
        code, out, err = run_main(base + flags)
        parse_error = name in ("accumulate 0", "row multiple 0")  # out of the flag's range: argparse's exit 2
        assert code == (2 if parse_error else 1) and message in err and "Traceback" not in err + out, f"{name}: {err}"

    # A coordinator nobody runs: process 1 probes the port until --init-timeout, then says so.
    port = free_port()
    began = time.time()
    code, out, err = run_main(base + process_flags(port, 2, 1, init=2))
    assert code == 1 and f"127.0.0.1:{port}: nothing answers there after 2 s" in err, err
    assert time.time() - began < 30
    # A coordinator port in use: process 0 cannot listen there.
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        code, out, err = run_main(base + process_flags(busy.getsockname()[1], 2, 0))
    assert code == 1 and "process 0 runs the coordinator there but cannot listen" in err, err


def test_a_checkpoint_from_before_row_multiple_keeps_its_batch_plan():
    """Checkpoints written before --row-multiple existed rounded rows to their device count: a resume reads that
    count as the row multiple, so it sees the batches the run saw; given explicitly, another value is refused."""
    from jax_transformer.errors import UsageError
    from jax_transformer.settings.config import DataConfig
    from jax_transformer.settings.resolve import resolve

    saved = {k: v for k, v in DataConfig(tsv="/data/train.tsv").to_dict().items() if k != "row_multiple"}

    def data(given, devices):  # what a resume with these data flags continues with
        return resolve({"data": given}, {"seed": 0, "optim": {}, "loop": {}, "data": saved, "devices": devices}).data

    assert data({}, 4).row_multiple == 4
    assert data({}, None).row_multiple == 1
    with pytest.raises(UsageError, match="row_multiple=4"):
        data({"row_multiple": 8}, 4)


@pytest.mark.skipif(
    any(name in os.environ for name in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES")),
    reason="inside a cluster jax.distributed would find one",
)
def test_distributed_without_a_cluster_is_a_clear_error(tmp_path):
    """--distributed lets jax detect the cluster; on a plain machine there is none to detect (a fresh process:
    jax.distributed must come before anything starts jax's backends)."""
    log = tmp_path / "log"
    process = start_train_process(
        tiny_train_args(tmp_path / "run", write_corpus(tmp_path), steps=1, extra=("--distributed",)), log
    )
    code = finish([process], [log], timeout=120)[0]
    text = log.read_text()
    assert code == 1 and "error: jax.distributed.initialize failed" in text and "--coordinator HOST:PORT" in text
    assert "Traceback" not in text
