"""The fine-tuning learning-rate schedules against the library users know them from: transformers'
get_{constant,linear,cosine,inverse_sqrt}_schedule_with_warmup on a torch optimizer, step by step, for this
project's optax schedule (what the update uses) and the PyTorch twin's LambdaLR. And the settings' faults."""

from __future__ import annotations

import numpy as np
import pytest

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import OptimConfig
from jax_transformer.settings.resolve import resolve
from jax_transformer.training.trainer import learning_rate_schedule, noam_rate
from tests.helpers.training import run_main
from torch_reference.training import schedule_lambda

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PEAK, WARMUP, TOTAL = 3e-4, 10, 50


def their_rates(schedule: str) -> list[float]:
    """The rate of each of TOTAL + 5 updates (the first one's first) under transformers' schedule."""
    from transformers import optimization

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    make = {
        "constant": lambda: optimization.get_constant_schedule_with_warmup(optimizer, WARMUP),
        "linear": lambda: optimization.get_linear_schedule_with_warmup(optimizer, WARMUP, TOTAL),
        "cosine": lambda: optimization.get_cosine_schedule_with_warmup(optimizer, WARMUP, TOTAL),
        "inverse_sqrt": lambda: optimization.get_inverse_sqrt_schedule(optimizer, WARMUP),
    }[schedule]
    scheduler, rates = make(), []
    for _ in range(TOTAL + 5):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "inverse_sqrt"])
def test_each_schedule_is_transformers(schedule):
    opt = OptimConfig(schedule=schedule, lr=PEAK, warmup_steps=WARMUP, decay_steps=TOTAL)
    ours = learning_rate_schedule(512, opt)
    theirs = their_rates(schedule)[: TOTAL + 1]  # (past its end transformers' cosine rises again; ours stays 0)
    counts = range(len(theirs))  # optax's count: the updates applied before this one
    # optax computes in float32: a few ulps of the peak apart
    np.testing.assert_allclose([float(ours(c)) for c in counts], theirs, rtol=1e-6, atol=1e-7 * PEAK)
    twin = schedule_lambda(512, opt)
    np.testing.assert_allclose([twin(c) for c in counts], theirs, rtol=1e-12, atol=1e-15)
    assert theirs[0] == 0.0 and max(theirs) == pytest.approx(PEAK)
    if schedule in ("linear", "cosine"):
        assert [float(ours(c)) for c in range(TOTAL, TOTAL + 5)] == [0.0] * 5
        assert [twin(c) for c in range(TOTAL, TOTAL + 5)] == [0.0] * 5


def test_noam_is_unchanged():
    opt = OptimConfig(warmup_steps=WARMUP, lr_scale=2.0)
    ours = learning_rate_schedule(256, opt)
    assert [float(ours(c)) for c in range(30)] == pytest.approx([noam_rate(c + 1, 256, WARMUP, 2.0) for c in range(30)])


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"schedule": "linear"}, "'lr' is needed with --schedule linear"),
        ({"lr": 1e-4}, "noam's rate is set by --lr-scale"),
        ({"schedule": "cosine", "lr": 1e-4, "warmup_steps": 100, "decay_steps": 100}, "must be after the warm-up"),
    ],
)
def test_faults_name_the_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        OptimConfig(**fields)


def test_decay_ends_at_the_runs_last_step_unless_given():
    settings = resolve({"optim": {"schedule": "linear", "lr": 1e-4, "warmup_steps": 10}, "loop": {"steps": 300}})
    assert settings.optim.decay_steps == 300
    given = {"optim": {"schedule": "cosine", "lr": 1e-4, "warmup_steps": 10, "decay_steps": 400}}
    assert resolve({**given, "loop": {"steps": 300}}).optim.decay_steps == 400
    with pytest.raises(ConfigError, match=r"\(--decay-steps; its default is the run's --steps\)"):
        resolve({"optim": {"schedule": "linear", "lr": 1e-4, "warmup_steps": 500}, "loop": {"steps": 300}})


def test_inverse_sqrt_is_fairseqs():
    """fairseq's inverse_sqrt (warmup_init_lr 0), written out: lr * min(step / warmup, sqrt(warmup / step)) for the
    update after `step` updates."""
    opt = OptimConfig(schedule="inverse_sqrt", lr=PEAK, warmup_steps=WARMUP)
    ours = learning_rate_schedule(512, opt)
    steps = [1, 5, WARMUP - 1, WARMUP, WARMUP + 1, 4 * WARMUP, 1000]
    expected = [PEAK * min(s / WARMUP, (WARMUP / s) ** 0.5) for s in steps]
    np.testing.assert_allclose([float(ours(s)) for s in steps], expected, rtol=1e-6)
    assert float(ours(4 * WARMUP)) == pytest.approx(PEAK / 2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--schedule", "linear"], "optimiser field 'lr' is needed with --schedule linear (--lr)"),
        (["--lr", "1e-4"], "noam's rate is set by --lr-scale (--lr)"),
        (
            ["--schedule", "linear", "--lr", "1e-4", "--warmup-steps", "5", "--decay-steps", "20"],
            "past --decay-steps 20",
        ),
        (
            ["--schedule", "linear", "--lr", "1e-4", "--warmup-steps", "40"],
            "(30) must be after the warm-up (--warmup-steps",
        ),
    ],
)
def test_the_command_refuses_naming_the_flag(tmp_path, flags, message):
    code, out, err = run_main(["train", "--steps", "30", "--run-dir", str(tmp_path / "run"), *flags])
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "run").exists()
