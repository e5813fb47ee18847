"""train.py with a pause at a chosen point, for tests that SIGKILL a training exactly there (the kill sweep).

    python -m tests.helpers.pause_at MARKER step K   train.py-args...   # pauses after training step K is done
    python -m tests.helpers.pause_at MARKER save S   train.py-args...   # pauses inside the save of step S

At the pause the process writes MARKER (its pid and where it is) and then blocks forever; the test polls for the
marker and kills the process, so the kill lands at that exact point instead of wherever a timer happens to fall.
"inside the save" is orbax's commit: every file of step S is written into `S.orbax-checkpoint-tmp` and only the
rename to `S` is left, the last moment a kill can interrupt a save. Nothing here changes what training computes.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


def _block(marker: Path, where: str) -> None:
    marker.write_text(f"{os.getpid()} {where}\n")
    threading.Event().wait()  # until the test's SIGKILL


def pause_after_step(marker: Path, step: int) -> None:
    import dataclasses

    from jax_transformer.training import run

    original = run.prepare

    def pause(done: int, drain) -> None:
        if done == step:
            drain()  # the step has finished and is logged (the loop dispatches ahead otherwise)
            _block(marker, f"after step {step}")

    run.prepare = lambda **arguments: dataclasses.replace(original(**arguments), on_step=pause)


def pause_in_save(marker: Path, step: int) -> None:
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self.get_final().name == str(step):  # the step folder itself, after its items are complete
            _block(marker, f"in the save of step {step}, before {self.get()} is renamed")
        return await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def main(argv: list[str]) -> int:
    marker, kind, point, *train_args = argv
    {"step": pause_after_step, "save": pause_in_save}[kind](Path(marker), int(point))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from jax_transformer.cli import main as cli

    return cli.main(train_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
