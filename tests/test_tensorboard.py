"""TensorBoard event files beside metrics.jsonl: every numeric field of every record as the scalar "<kind>/<field>" at
its step, read back here from the files (TFRecord framing and tensorboardX's Event protobuf; TensorBoard's own
reader is a much larger install) and compared with metrics.jsonl."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from jax_transformer.loop import MetricsLog, tensorboard_writer
from jax_transformer.run import UsageError

pytest.importorskip("tensorboardX")


def scalars(folder: Path) -> dict[tuple[str, int], float]:
    """{(tag, step): value} of every scalar in the event files under `folder`, oldest file first, as TensorBoard
    reads them: a session's START at step s drops what earlier files said of steps s and later."""
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    found = {}
    for path in sorted(folder.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns):
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


def test_a_run_writes_every_metric_as_tensorboard_scalars(tiny_run):
    run, _ = tiny_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = numeric(records)
    tags = {tag for tag, _ in expected}
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/valid_loss", "eval/valid_ppl"} <= tags
    found = scalars(run / "tensorboard")
    assert set(found) == set(expected)
    for key, value in expected.items():
        assert found[key] == pytest.approx(value, rel=1e-6)  # float32 in the events


def test_a_resume_drops_the_events_it_trains_again(tmp_path):
    """purge_step: a resumed run (first step 3) trains steps 3... again; TensorBoard drops their old events."""
    first = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_writer(tmp_path, None, 1))
    for step in (1, 2, 3, 4):
        first.write({"kind": "train", "step": step, "loss": 10.0 - step})
    first.close()
    again = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_writer(tmp_path, None, 3))
    again.write({"kind": "train", "step": 3, "loss": 0.5, "note": "text is left out"})
    again.close()
    found = scalars(tmp_path / "tensorboard")
    assert found[("train/loss", 3)] == 0.5 and found[("train/loss", 2)] == 8.0
    assert ("train/note", 3) not in found


def test_asked_for_but_not_installed_is_an_error_naming_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    assert tensorboard_writer(tmp_path, None, 1) is None  # unsaid: off, quietly
    with pytest.raises(UsageError, match="tensorboard extra"):
        tensorboard_writer(tmp_path, True, 1)
