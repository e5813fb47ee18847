"""The training step: schedule, dropout keys, data parallelism and accumulation (== jit), and that the default task
learns."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_transformer.training import trainer
from tests.helpers.batches import corpus_batches, unit_batch
from tests.helpers.configs import unit_config, unit_optim
from tests.helpers.training import report_on_cpu_devices

CONFIG = unit_config()
OPTIM = unit_optim()
_batch = unit_batch


def test_schedule_is_the_papers():
    d, warmup = 512, 4000
    assert trainer.noam_rate(1, d, warmup) == pytest.approx(d**-0.5 * warmup**-1.5)
    assert trainer.noam_rate(warmup, d, warmup) == pytest.approx(d**-0.5 * warmup**-0.5)  # the peak
    assert trainer.noam_rate(4 * warmup, d, warmup) == pytest.approx(0.5 * trainer.noam_rate(warmup, d, warmup))
    steps = np.arange(1, 3 * warmup)
    rates = trainer.noam_rate(steps, d, warmup)
    assert np.argmax(rates) + 1 == warmup  # rises linearly to the warmup step, then decays as step^-0.5
    schedule = trainer.learning_rate_schedule(d, trainer.OptimConfig(warmup_steps=warmup, lr_scale=2.0))
    # optax counts updates from 0; the first update must get the paper's step 1
    assert float(schedule(0)) == pytest.approx(2.0 * trainer.noam_rate(1, d, warmup), rel=1e-6)


def test_first_update_is_adam_with_the_step_one_rate():
    """Adam's first step is lr * g / (|g| + eps): exactly lr in size wherever |g| >> eps = 1e-9."""
    state = trainer.create_train_state(CONFIG, OPTIM, seed=0)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    # (dropout changes the gradient, not the size of Adam's first step)
    state, _ = trainer.make_train_step(CONFIG, OPTIM)(state, _batch(0))
    steps = np.concatenate(
        [
            np.abs(np.asarray(a) - b).ravel()
            for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(before))
        ]
    )
    lr = trainer.noam_rate(1, CONFIG.d_model, OPTIM.warmup_steps, OPTIM.lr_scale)
    assert int(state.step) == 1
    assert steps.max() <= lr * (1 + 1e-5)
    assert np.median(steps) == pytest.approx(lr, rel=1e-3)


def test_dropout_masks_depend_on_the_step_number_only():
    optim = OPTIM
    step = trainer.make_train_step(CONFIG, optim)  # dropout on (the tiny preset's 0.1)
    batch = _batch(1)

    def loss_at(step_number: int) -> float:
        state = trainer.create_train_state(CONFIG, optim, seed=0)  # fresh: off the CPU the step donates it
        state = state.replace(step=jax.numpy.array(step_number, jax.numpy.int32))
        _, sums = step(state, batch)
        return float(sums["loss"])

    deterministic = float(
        trainer.batch_loss_sums(trainer.create_train_state(CONFIG, optim).params, batch, CONFIG, optim.label_smoothing)[
            "loss"
        ]
    )
    assert loss_at(3) == loss_at(3)  # same step, same masks: reproducible, so a resume replays it
    assert loss_at(3) != loss_at(4)  # another step, other masks
    assert loss_at(3) != deterministic  # dropout really is on


# --- sharded jit == pmap == jit, and accumulation == one big step ----------------------------------------------


@pytest.mark.slow
def test_every_parallel_path_equals_the_single_device_step():
    """tests/helpers/parallel_paths.py with 4 simulated CPU devices, 5 steps, dropout on, batches of 8 rows: pmap
    (2 rows per device), sharded jit (the same), both with 2 micro-batches of 1 row per device, and jit with 4
    micro-batches of 2 rows (`--accumulate 4` == one step on the 4x batch) must all take the steps of single-device
    jit on the whole batch, within the tolerances of float summation order that `parallel_paths.check` states."""
    from tests.helpers.parallel_paths import check

    report = report_on_cpu_devices("tests.helpers.parallel_paths", 4)
    assert report["devices"] == 4
    assert {name: (p["mode"], p["n_devices"]) for name, p in report["paths"].items()} == {
        "jit": ("jit", 1),
        "pmap": ("pmap", 4),
        "sharded": ("sharded", 4),
        "sharded, accumulate 2": ("sharded", 4),
        "pmap, accumulate 2": ("pmap", 4),
        "jit, accumulate 4": ("jit", 1),
    }
    print("parallel paths vs jit, 5 steps, dropout on:\n  " + "\n  ".join(check(report)))


# --- the default task learns ---------------------------------------------------------------------------------


# bfloat16 training may end below float32's held-out token accuracy by at most this much (absolute). Stated, not
# derived: bfloat16 rounds every matmul to 8 bits, which perturbs each step like a little gradient noise; after 200
# steps from the same start on the same batches, a gap of more than 5 points would mean training itself is harmed.
BF16_ACCURACY_MARGIN = 0.05


@pytest.mark.slow
def test_default_task_learns():
    """200 steps of the tiny model on (a subset of) the built-in numbers task, with the default task's tokenizer
    settings, in float32 and again in bfloat16 (same start, same batches): the validation loss must fall from
    ~ln(V) = 5.5 to below 2.0 and teacher-forced token accuracy rise above 60% in both, and bfloat16 must end
    within BF16_ACCURACY_MARGIN of float32's accuracy. Chance is 1/V = 0.4%; a model that learned only token
    frequencies stays near loss 4. Batches are 128 random pairs padded to 24 tokens (one shape, one compilation
    per dtype). Measured: see the print."""
    from jax_transformer.data import default_task
    from jax_transformer.data.batching import encode_corpus, eval_batches
    from jax_transformer.data.tokenizer import Tokenizer

    train, valid = default_task.default_pairs("train", n=3000), default_task.default_pairs("valid", n=100)
    tokenizer = Tokenizer.train(
        train.sources + train.targets, default_task.TOKENIZER_VOCAB_SIZE, model_type=default_task.TOKENIZER_MODEL_TYPE
    )
    config = unit_config().replace(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=24, share_embeddings=True
    )
    optim = trainer.OptimConfig(warmup_steps=400, lr_scale=2.0)  # train.py's defaults for this task
    valid_batches = [b for b, _ in eval_batches(encode_corpus(valid, tokenizer, 24), 4096)]
    encoded = encode_corpus(train, tokenizer, 24)
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = config.replace(dtype=dtype)
        batches = corpus_batches(encoded, config, 128)  # 128 random pairs x 24 tokens, the same for both dtypes
        eval_step = trainer.make_eval_step(config, optim.label_smoothing)
        state = trainer.create_train_state(config, optim, seed=0)
        before = trainer.evaluate_loss(state.params, eval_step, valid_batches)
        step = trainer.make_train_step(config, optim)
        for _ in range(200):
            state, _ = step(state, next(batches))
        results[dtype] = (before, trainer.evaluate_loss(state.params, eval_step, valid_batches))
        print(
            f"default task, 200 steps, {dtype}: valid loss {before['loss']:.3f} -> {results[dtype][1]['loss']:.3f}, "
            f"token accuracy {before['accuracy']:.3f} -> {results[dtype][1]['accuracy']:.3f}"
        )
    for before, after in results.values():
        assert before["loss"] > 5.0
        assert after["loss"] < 2.0
        assert after["accuracy"] > 0.6
    assert results["bfloat16"][1]["accuracy"] >= results["float32"][1]["accuracy"] - BF16_ACCURACY_MARGIN
