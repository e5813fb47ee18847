"""TensorBoard event files beside metrics.jsonl: every numeric field of every record as the scalar "<kind>/<field>" at
its step, read back here from the files (TFRecord framing and tensorboardX's Event protobuf; TensorBoard's own
reader is a much larger install) and compared with metrics.jsonl. The records are written as the loop writes them,
through `RunOutput`, without a training run."""

from __future__ import annotations

import json
import math
import struct
import types
from pathlib import Path

import numpy as np
import pytest

from jax_transformer.errors import UsageError
from jax_transformer.settings.config import LoopConfig
from jax_transformer.training.loop import MetricsLog, RunOutput, tensorboard_writer
from tests.helpers.training import run_main

pytest.importorskip("tensorboardX")

# Records shaped as the loop's: numbers, and text, lists, dicts, bools and none, which have no scalar.
RECORDS = [
    {
        "kind": "compile",
        "step": 0,
        "programs": ["train step (32, 16)"],
        "seconds": 1.25,
        "cache_dir": None,
        "cache_hits": 0,
        "errors": {},
    },
    *(
        {
            "kind": "train",
            "step": s,
            "lr": 1e-4 * s,
            "loss": 5.0 / s,
            "tokens_per_s": 1234.5,
            "tokens": 512.0,
            "grad_norm": 0.5 + s,
        }
        for s in (1, 2, 3, 4)
    ),
    {
        "kind": "eval",
        "step": 2,
        "final": False,
        "valid_loss": 3.5,
        "valid_ppl": 33.1,
        "valid_accuracy": 0.41,
        "bleu": 12.5,
        "chrf": 40.25,
        "bleu_signature": "nrefs:1|case:mixed",
        "score": 12.5,
        "score_metric": "bleu",
        "best_step": 2,
        "bad_evals": 0,
    },
    {
        "kind": "eval",
        "step": 4,
        "final": True,
        "valid_loss": 3.25,
        "bleu": 13.0,
        "bleu/eng_Latn-deu_Latn": 14.5,  # a run of many language pairs: each pair's (evaluation.score_pairs)
        "chrf/eng_Latn-deu_Latn": 41.0,
        "sentences/eng_Latn-deu_Latn": 7,
    },
    {"kind": "train", "step": 5, "lr": 5e-4, "loss": math.nan, "error": "non-finite loss"},
    {"kind": "summary", "step": 5, "elapsed_s": 9.5, "steps_s": 4.25},
]


def scalars(folder: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of every scalar in the event files under `folder`, read in the order TensorBoard reads
    them (by file name: the creation second, then the from-step suffix): a session's START at step s drops what
    earlier files said of steps s and later."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    found = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])  # after the length and its CRC
            at += 12 + length + 4  # the record and its CRC
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                found = {key: v for key, v in found.items() if key[1] < event.step}
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.simple_value
    return found


def numeric(records) -> dict[tuple[str, int], float]:
    return {
        (f"{r['kind']}/{k}", r["step"]): float(v)
        for r in records
        for k, v in r.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def run_output(run_dir: Path, step: int = 0, tensorboard: bool | None = None) -> RunOutput:
    """The loop's output of a run at `step` (what `RunOutput` reads of a `Run`)."""
    state = types.SimpleNamespace(step=np.asarray(step, np.int32))
    run = types.SimpleNamespace(
        run_dir=run_dir, start_time=0.0, loop=LoopConfig(tensorboard=tensorboard), print=print, state=state
    )
    return RunOutput(run)


def test_every_numeric_field_of_every_record_is_a_scalar(tmp_path):
    out = run_output(tmp_path)
    for record in RECORDS:
        out.metrics.write(record)
    out.close()
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected = numeric(written)
    tags = {tag for tag, _ in expected}
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/bleu", "summary/steps_s"} <= tags
    assert "eval/chrf/eng_Latn-deu_Latn" in tags  # a language pair's
    found = scalars(tmp_path / "tensorboard")
    assert set(found) == set(expected)  # no text, list, dict, bool or none field among them
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-6, nan_ok=True)  # float32 in the events
    assert math.isnan(found[("train/loss", 5)])


def test_off_when_asked(tmp_path):
    out = run_output(tmp_path, tensorboard=False)
    out.metrics.write(RECORDS[1])
    out.close()
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "tensorboard").exists()


def test_a_resume_drops_the_events_it_trains_again(tmp_path):
    """purge_step: a run resumed from step 2 trains steps 3... again; TensorBoard drops their old events."""
    first = run_output(tmp_path, step=0)
    for step in (1, 2, 3, 4):
        first.metrics.write({"kind": "train", "step": step, "loss": 10.0 - step})
    first.close()
    again = run_output(tmp_path, step=2)
    again.metrics.write({"kind": "train", "step": 3, "loss": 0.5, "note": "text is left out"})
    again.close()
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2  # each command its own file, in one folder
    found = scalars(tmp_path / "tensorboard")
    assert found == {("train/loss", 1): 9.0, ("train/loss", 2): 8.0, ("train/loss", 3): 0.5}


def test_asked_for_but_not_installed_is_an_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_writer(tmp_path, None, 1))  # unsaid: off, quietly
    log.close()
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(UsageError, match="tensorboard extra"):
        tensorboard_writer(tmp_path, True, 1)
    # the command refuses before it reads any data, and leaves no run directory behind
    code, out, err = run_main(["train", "--steps", "2", "--tensorboard", "--run-dir", str(tmp_path / "run")])
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "error: --tensorboard: tensorboardX is not installed (pip install tensorboardX, or the project's tensorboard "
        "extra)"
    ]
    assert not (tmp_path / "run").exists()
