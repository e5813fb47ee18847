"""The training step: schedule, dropout keys, data parallelism (pmap == jit) and that the default task learns."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_transformer import training
from tests.fixtures import corpus_batches, unit_batch, unit_config, unit_optim
from tests.helpers_training import REPO

CONFIG = unit_config()
OPTIM = unit_optim()
_batch = unit_batch


def test_schedule_is_the_papers():
    d, warmup = 512, 4000
    assert training.noam_rate(1, d, warmup) == pytest.approx(d**-0.5 * warmup**-1.5)
    assert training.noam_rate(warmup, d, warmup) == pytest.approx(d**-0.5 * warmup**-0.5)  # the peak
    assert training.noam_rate(4 * warmup, d, warmup) == pytest.approx(0.5 * training.noam_rate(warmup, d, warmup))
    steps = np.arange(1, 3 * warmup)
    rates = training.noam_rate(steps, d, warmup)
    assert np.argmax(rates) + 1 == warmup  # rises linearly to the warmup step, then decays as step^-0.5
    schedule = training.learning_rate_schedule(d, training.OptimConfig(warmup_steps=warmup, lr_scale=2.0))
    # optax counts updates from 0; the first update must get the paper's step 1
    assert float(schedule(0)) == pytest.approx(2.0 * training.noam_rate(1, d, warmup), rel=1e-6)


def test_first_update_is_adam_with_the_step_one_rate():
    """Adam's first step is lr * g / (|g| + eps): exactly lr in size wherever |g| >> eps = 1e-9."""
    state = training.create_train_state(CONFIG, OPTIM, seed=0)
    before = jax.tree_util.tree_map(np.asarray, state.params)
    # (dropout changes the gradient, not the size of Adam's first step)
    state, _ = training.make_train_step(CONFIG, OPTIM)(state, _batch(0))
    steps = np.concatenate(
        [
            np.abs(np.asarray(a) - b).ravel()
            for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(before))
        ]
    )
    lr = training.noam_rate(1, CONFIG.d_model, OPTIM.warmup_steps, OPTIM.lr_scale)
    assert int(state.step) == 1
    assert steps.max() <= lr * (1 + 1e-5)
    assert np.median(steps) == pytest.approx(lr, rel=1e-3)


def test_dropout_masks_depend_on_the_step_number_only():
    optim = OPTIM
    step = training.make_train_step(CONFIG, optim)  # dropout on (the tiny preset's 0.1)
    batch = _batch(1)

    def loss_at(step_number: int) -> float:
        state = training.create_train_state(CONFIG, optim, seed=0)  # fresh: the step donates its input
        state = state.replace(step=jax.numpy.array(step_number, jax.numpy.int32))
        _, sums = step(state, batch)
        return float(sums["loss"])

    deterministic = float(
        training.batch_loss_sums(
            training.create_train_state(CONFIG, optim).params, batch, CONFIG, optim.label_smoothing
        )["loss"]
    )
    assert loss_at(3) == loss_at(3)  # same step, same masks: reproducible, so a resume replays it
    assert loss_at(3) != loss_at(4)  # another step, other masks
    assert loss_at(3) != deterministic  # dropout really is on


# --- pmap == jit ---------------------------------------------------------------------------------------------

PMAP_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax_transformer import training
from tests.fixtures import flat, unit_batch as _batch, unit_config
# depth does not matter here; compile time does
CONFIG = unit_config().replace(num_encoder_layers=1, num_decoder_layers=1)

assert jax.local_device_count() == 4
optim = training.OptimConfig(warmup_steps=5)
batches = [_batch(10 + i, rows=8) for i in range(5)]  # global batches of 8 rows: 2 per device
initial = jax.tree_util.tree_map(np.asarray, training.create_train_state(CONFIG, optim, seed=0).params)

single = training.create_train_state(CONFIG, optim, seed=0)
jit_step = training.make_train_step(CONFIG, optim, dropout=False)
replicated = training.replicate(training.create_train_state(CONFIG, optim, seed=0), 4)
pmap_step = training.make_train_step(CONFIG, optim, n_devices=4, dropout=False)
losses, token_counts = [], []
for batch in batches:
    single, s = jit_step(single, batch)
    replicated, p = pmap_step(replicated, training.shard_batch(batch, 4))
    per_device_tokens = (training.shard_batch(batch, 4)["tgt_out"] != 0).sum(axis=(1, 2))
    token_counts.append(per_device_tokens.tolist())
    losses.append((float(s["loss"] / s["tokens"]), float(p["loss"][0] / p["tokens"][0]), float(p["tokens"][0]),
                   float(s["tokens"])))

jit_params, pmap_all = flat(single.params), flat(replicated.params)
start = flat(initial)
replicas_equal = all(np.array_equal(v[0], v[i]) for v in pmap_all.values() for i in range(4))
report = {"losses": losses, "token_counts": token_counts, "replicas_equal": replicas_equal, "tensors": {}}
for k, a in jit_params.items():
    b = pmap_all[k][0]
    report["tensors"][k] = {"max_abs": float(np.max(np.abs(a - b))),
                            "relative": float(np.linalg.norm(a - b) / np.linalg.norm(a - start[k])),
                            "moved": float(np.max(np.abs(a - start[k])))}
print("REPORT " + json.dumps(report))
"""


def test_pmap_step_equals_jit_step_on_the_global_batch():
    """4 simulated CPU devices, 5 steps, dropout off: the data-parallel step must equal the single-device step on
    the whole batch (the tiny preset with one layer each side: depth changes nothing here but compile time).

    Tolerances: losses relative 1e-6 (float32: the pmap loss is the psum of 4 partial sums, the jit loss one sum
    over the batch; reassociating a sum changes it by a few ulp, ~1e-7 relative). Parameters: per tensor,
    ||jit - pmap|| <= 1e-4 of how far the tensor moved (measured: ~2e-6). Gradients differ by the same
    reassociation noise, and Adam divides each gradient element by its own RMS, so an element whose gradient is
    at noise level (the key biases, whose gradient is zero analytically) can step differently by up to ~lr: the
    tensor norm averages such elements out, and key biases are left out. A per-device *mean* instead of the
    global token normalisation would weight the devices' tokens unequally (the test checks the devices do hold
    different token counts) and change every step's update, not only rounding.
    """
    # The simulated devices are CPU devices: ask for the CPU backend, which is not the default on a GPU machine.
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-c", PMAP_SCRIPT], capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["replicas_equal"]  # psum gives every device the same gradient: replicas never drift apart
    # the devices really hold different numbers of tokens, so a per-device mean would not be the global mean
    assert any(len(set(counts)) > 1 for counts in report["token_counts"])
    for jit_loss, pmap_loss, pmap_tokens, jit_tokens in report["losses"]:
        assert pmap_tokens == jit_tokens  # normalised by the global token count
        assert pmap_loss == pytest.approx(jit_loss, rel=1e-6)
    tensors = {k: v for k, v in report["tensors"].items() if "'key']['bias'" not in k}
    worst = max(tensors, key=lambda k: tensors[k]["relative"])
    print(
        f"pmap vs jit after 5 steps: losses {[(round(a, 6), round(b, 6)) for a, b, *_ in report['losses']]}; "
        f"worst tensor {worst}: {tensors[worst]['relative']:.2e} of its movement "
        f"(max abs {max(v['max_abs'] for v in tensors.values()):.2e})"
    )
    assert tensors[worst]["relative"] <= 1e-4
    assert min(v["moved"] for v in tensors.values()) > 1e-4  # the steps really changed every tensor


# --- the default task learns ---------------------------------------------------------------------------------


# bfloat16 training may end below float32's held-out token accuracy by at most this much (absolute). Stated, not
# derived: bfloat16 rounds every matmul to 8 bits, which perturbs each step like a little gradient noise; after 200
# steps from the same start on the same batches, a gap of more than 5 points would mean training itself is harmed.
BF16_ACCURACY_MARGIN = 0.05


def test_default_task_learns():
    """200 steps of the tiny model on (a subset of) the built-in numbers task, with the default task's tokenizer
    settings, in float32 and again in bfloat16 (same start, same batches): the validation loss must fall from
    ~ln(V) = 5.5 to below 2.0 and teacher-forced token accuracy rise above 60% in both, and bfloat16 must end
    within BF16_ACCURACY_MARGIN of float32's accuracy. Chance is 1/V = 0.4%; a model that learned only token
    frequencies stays near loss 4. Batches are 128 random pairs padded to 24 tokens (one shape, one compilation
    per dtype). Measured: see the print."""
    from jax_transformer import default_task
    from jax_transformer.data import Tokenizer, encode_corpus, eval_batches

    train, valid = default_task.default_pairs("train", n=3000), default_task.default_pairs("valid", n=100)
    tokenizer = Tokenizer.train(
        train.sources + train.targets, default_task.TOKENIZER_VOCAB_SIZE, model_type=default_task.TOKENIZER_MODEL_TYPE
    )
    config = unit_config().replace(
        src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=24, share_embeddings=True
    )
    optim = training.OptimConfig(warmup_steps=400, lr_scale=2.0)  # train.py's defaults for this task
    valid_batches = [b for b, _ in eval_batches(encode_corpus(valid, tokenizer, 24), 4096)]
    encoded = encode_corpus(train, tokenizer, 24)
    results = {}
    for dtype in ("float32", "bfloat16"):
        config = config.replace(dtype=dtype)
        batches = corpus_batches(encoded, config, 128)  # 128 random pairs x 24 tokens, the same for both dtypes
        eval_step = training.make_eval_step(config, optim.label_smoothing)
        state = training.create_train_state(config, optim, seed=0)
        before = training.evaluate_loss(state.params, eval_step, valid_batches)
        step = training.make_train_step(config, optim)
        for _ in range(200):
            state, _ = step(state, next(batches))
        results[dtype] = (before, training.evaluate_loss(state.params, eval_step, valid_batches))
        print(
            f"default task, 200 steps, {dtype}: valid loss {before['loss']:.3f} -> {results[dtype][1]['loss']:.3f}, "
            f"token accuracy {before['accuracy']:.3f} -> {results[dtype][1]['accuracy']:.3f}"
        )
    for before, after in results.values():
        assert before["loss"] > 5.0
        assert after["loss"] < 2.0
        assert after["accuracy"] > 0.6
    assert results["bfloat16"][1]["accuracy"] >= results["float32"][1]["accuracy"] - BF16_ACCURACY_MARGIN
