"""The kill sweep: a tiny training SIGKILLed at seeded points (after a training step, and inside a save, at the
moment before orbax commits it), resumed after each kill, ends with exactly the parameters of a run never
interrupted. Each kill lands at a hook (tests/helpers/pause_at.py) that the test reaches by polling, never by timing.

The chain (12 steps, a checkpoint every 3; the points drawn from a seed): run 1 is killed after step k1 (between
saves); run 2 resumes it and is killed inside the save of step s (a fully written, uncommitted
`s.orbax-checkpoint-tmp` is left); run 3 resumes (removing that folder and taking over the dead process's lock)
and is killed after step k3; run 4 resumes to the end. The uninterrupted run goes alongside, in its own process.
While run 2 is paused, a second training on the same directory is refused: the lock is held by a live process.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from tests.helpers.training import (
    completed_steps,
    kill_at_pause,
    run_main,
    start_train_process,
    tiny_train_args,
    write_corpus,
)
from tests.helpers.twins import flat

STEPS, SAVE_EVERY = 12, 3
SEED = 14  # the kill points below are drawn from it, the same on every run


def kill_points(seed: int = SEED) -> tuple[int, int, int]:
    """(k1, s, k3): a step between saves, a later save step, a still later step between saves, each leaving
    room for the next (every resume starts from the newest complete checkpoint before the kill)."""
    rng = np.random.default_rng(seed)
    k1 = int(rng.choice([4, 5]))  # between the saves of steps 3 and 6
    s = int(rng.choice([6, 9]))  # a save after the checkpoint run 2 resumes from (3)
    k3 = int(rng.choice([s + 1, s + 2]))  # run 3 resumes from s - 3 (the save of s never completed) and saves s
    assert SAVE_EVERY < k1 < 2 * SAVE_EVERY and k3 % SAVE_EVERY and k3 < STEPS
    return k1, s, k3


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.mark.slow
def test_killed_at_seeded_points_and_resumed_equals_uninterrupted(tmp_path):
    train = write_corpus(tmp_path)
    cache = tmp_path / "xla-cache"  # compiled programs shared by the child processes
    k1, s, k3 = kill_points()
    straight, run = tmp_path / "straight", tmp_path / "run"
    args = tiny_train_args(run, train, steps=STEPS, save_every=SAVE_EVERY)
    resume = ["train", "--resume", str(run), "--no-progress"]
    # The uninterrupted run, alongside the first killed one.
    reference = start_train_process(
        tiny_train_args(straight, train, steps=STEPS, save_every=SAVE_EVERY), tmp_path / "straight.log", cache
    )

    # 1. killed after step k1; its checkpoints are complete (the pause waits for nothing; the save of k1 - 1
    #    finishes in the background while the main thread is paused, and the poll waits for it too).
    marker, log = tmp_path / "pause1", tmp_path / "run1.log"
    process = start_train_process(args, log, cache, pause=(marker, "step", k1))
    kill_at_pause(process, marker, log, condition=lambda: completed_steps(run) == [SAVE_EVERY])
    assert completed_steps(run) == [SAVE_EVERY]

    # 2. resumed from step 3, killed inside the save of step s: everything written, the rename to "s" not done.
    marker, log = tmp_path / "pause2", tmp_path / "run2.log"
    process = start_train_process(resume, log, cache, pause=(marker, "save", s))
    pid = kill_at_pause(process, marker, log, before_kill=lambda: _second_training_refused(run, process.pid))
    assert pid.split()[0] == str(process.pid)
    assert f"resuming {run} from step {SAVE_EVERY}" in log.read_text()
    assert completed_steps(run) == list(range(SAVE_EVERY, s, SAVE_EVERY))
    assert [p.name for p in ckpt_lib.partial_saves(run / "checkpoints")] == [f"{s}.orbax-checkpoint-tmp"]

    # 3. resumed: the half-written save is removed, the dead process's lock taken over; killed after step k3.
    marker, log = tmp_path / "pause3", tmp_path / "run3.log"
    process = start_train_process(resume, log, cache, pause=(marker, "step", k3))
    kill_at_pause(process, marker, log, condition=lambda: completed_steps(run)[-1] == s)
    text = log.read_text()
    assert f"warning: removed {run / 'checkpoints' / f'{s}.orbax-checkpoint-tmp'}: a save interrupted" in text
    assert f"taking over the lock left by pid {pid.split()[0]} on " in text
    assert f"resuming {run} from step {s - SAVE_EVERY}" in text

    # 4. resumed to the end.
    log = tmp_path / "run4.log"
    process = start_train_process(resume, log, cache)
    assert process.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert reference.wait(timeout=600) == 0, (tmp_path / "straight.log").read_text()[-3000:]

    a, b = ckpt_lib.load(run, "latest"), ckpt_lib.load(straight, "latest")
    assert a.step == b.step == STEPS and a.verified and b.verified
    state_a, state_b = flat(a.state), flat(b.state)
    assert state_a.keys() == state_b.keys()
    for key in state_a:  # bit for bit: same programs, same batches, same dropout keys, in another process
        assert np.array_equal(state_a[key], state_b[key]), key
    assert _losses(run) == _losses(straight) and sorted(_losses(run)) == list(range(1, STEPS + 1))


def _second_training_refused(run, holder_pid: int) -> None:
    """While a training holds the run directory, another one on it refuses to start, naming the holder."""
    code, out, err = run_main(["train", "--resume", str(run), "--no-progress"])
    assert code == 1 and f"is in use by another training (pid {holder_pid} on " in err, out + err
