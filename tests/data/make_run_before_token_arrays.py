"""Makes tests/data/run_before_token_arrays/: a run trained by the code before training files were encoded into
token arrays (commit b20584b), and the batches that code's stream gives after its checkpoint, as digests. The test
(tests/test_token_arrays.py) resumes it with today's code and compares.

    git worktree add /tmp/before b20584b
    python tests/data/make_run_before_token_arrays.py /tmp/before
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "run_before_token_arrays"
# A one-layer model of width 16 keeps the checkpoint small; the corpus has an empty and a too-long line.
MODEL = ["--d-model", "16", "--d-ff", "32", "--num-heads", "2"]
STEPS = 7  # 5 batches an epoch: the checkpoint is in the second epoch
# Where the run's corpus lies: a checkpoint stores its absolute path (and a checksum of that record), so the test
# writes the same corpus to the same place.
CORPUS_DIR = Path("/tmp/jax-transformer-run-before-token-arrays")


def batch_digest(batch) -> str:
    digest = hashlib.sha256()
    for key in sorted(batch):
        digest.update(key.encode() + batch[key].astype("<i4").tobytes() + str(batch[key].shape).encode())
    return digest.hexdigest()[:16]


def main(old_repo: Path) -> None:
    sys.path.insert(0, str(old_repo))
    sys.path.insert(1, str(HERE.parent.parent))
    from tests.helpers.training import tiny_train_args, write_corpus

    work = Path(tempfile.mkdtemp())
    corpus = write_corpus(CORPUS_DIR, empty_line=True, long_line=True)
    run = work / "run"
    args = tiny_train_args(run, corpus, steps=STEPS, save_every=STEPS) + MODEL
    subprocess.run([sys.executable, str(old_repo / "train.py"), *args], cwd=old_repo, check=True)

    from jax_transformer.checkpoint import manager as checkpoint
    from jax_transformer.data.batching import BatchStream, encode_corpus
    from jax_transformer.data.corpus import read_tsv
    from jax_transformer.settings.config import DataConfig

    assert checkpoint.__file__.startswith(str(old_repo)), checkpoint.__file__
    loaded = checkpoint.load(run, STEPS)
    data = DataConfig.from_dict(loaded.run["data"])
    encoded = encode_corpus(read_tsv(corpus), loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    stream = BatchStream(
        encoded,
        data.max_tokens,
        batching=data.batching,
        pack_length=data.pack_length,
        row_multiple=data.row_multiple,
        seed=loaded.run["seed"],
        state=loaded.data_state,
    )
    digests = [batch_digest(next(stream)) for _ in range(8)]
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    shutil.copytree(run / "checkpoints" / str(STEPS), OUT / "checkpoints" / str(STEPS))
    record = {"corpus_path": str(corpus), "data_state": loaded.data_state, "batches_after": digests, "step": STEPS}
    (OUT / "before.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(work)
    print(f"wrote {OUT}: {record}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
