"""Checkpoints: exact round trip, which steps are kept, config mismatches, and exact resume through train.py."""

from __future__ import annotations

import json
import logging
import re

import jax
import numpy as np
import pytest

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.errors import ConfigError
from jax_transformer.training import trainer
from tests.helpers.batches import unit_batch
from tests.helpers.configs import unit_config, unit_optim
from tests.helpers.training import run_main, tiny_train_args, write_corpus
from tests.helpers.twins import flat

CONFIG = unit_config()
OPTIM = unit_optim()


@pytest.fixture(scope="module")
def tokenizer():
    words = [f"w{i} v{i % 7} u{i % 3}" for i in range(300)]
    return Tokenizer.train(words, 40, model_type="bpe")


def _trained_state(steps: int = 2):
    state = trainer.create_train_state(CONFIG, OPTIM, seed=1)
    step = trainer.make_train_step(CONFIG, OPTIM)
    for i in range(steps):
        state, _ = step(state, unit_batch(i))
    return state


def test_save_restore_round_trip_is_exact(tmp_path, tokenizer):
    state = _trained_state()
    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt")
    data_state = {"epoch": 3, "index": 7, "batches_per_epoch": 11}
    manager.save(
        2,
        trainer.state_for_saving(state),
        config=CONFIG,
        optim=OPTIM.to_dict(),
        tokenizer=tokenizer,
        data_state=data_state,
        run={"seed": 5},
    )
    manager.close()

    restored = ckpt_lib.load(tmp_path / "ckpt", "latest")
    assert restored.step == 2 and restored.config == CONFIG and restored.data_state == data_state
    assert restored.run == {"seed": 5} and restored.optim == OPTIM.to_dict()
    assert restored.tokenizer.to_bytes() == tokenizer.to_bytes()
    rebuilt = trainer.restore_train_state(restored.state, CONFIG, OPTIM)
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(state)
    before, after = flat(jax.device_get(state)), flat(rebuilt)
    assert before.keys() == after.keys()
    for key in before:  # params, both Adam moments, step counts, the dropout key: bit for bit
        assert before[key].dtype == after[key].dtype and np.array_equal(before[key], after[key]), key


def test_reading_a_checkpoint_logs_no_warning(tmp_path, tokenizer, caplog):
    """Every translate, evaluate and export opens the checkpoints read-only: orbax's warnings about that (and about
    saves without metrics) say nothing the user can act on, so none reaches the log."""
    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt")
    manager.save(1, trainer.state_for_saving(_trained_state(1)), config=CONFIG, optim=OPTIM.to_dict(),
                 tokenizer=tokenizer, data_state=None, run={})  # fmt: skip
    manager.close()
    with caplog.at_level(logging.INFO):
        assert ckpt_lib.load(tmp_path / "ckpt", "latest").step == 1
        assert ckpt_lib.load(tmp_path / "ckpt", "latest", weights_only=True).step == 1
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_weights_only_reads_the_parameters_alone_and_verifies_them(tmp_path, tokenizer, monkeypatch):
    """load(..., weights_only=True), what translate, evaluate, export and --init-from use: the saved parameters
    bit for bit, no optimizer state, and still checked against their checksums."""
    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt")
    manager.save(3, trainer.state_for_saving(_trained_state()), config=CONFIG, optim=OPTIM.to_dict(),
                 tokenizer=tokenizer, data_state=None, run={"seed": 5})  # fmt: skip
    manager.close()
    full = ckpt_lib.load(tmp_path / "ckpt", "latest")
    weights = ckpt_lib.load(tmp_path / "ckpt", "latest", weights_only=True)
    assert list(weights.state) == ["params"] and "opt_state" in full.state
    assert (weights.step, weights.config, weights.run, weights.verified) == (3, CONFIG, {"seed": 5}, True)
    before, after = flat(full.params), flat(weights.params)
    assert before.keys() == after.keys()
    for key in before:
        assert before[key].dtype == after[key].dtype and np.array_equal(before[key], after[key]), key

    read = ckpt_lib._restore_state

    def one_bit_off(state_dir, **how):  # what a damaged file read without an error would give
        state = read(state_dir, **how)
        kernel = state["params"]["encoder"]["layer_0"]["feed_forward"]["linear1"]["kernel"]
        kernel.view(np.uint32)[0, 0] ^= 1
        return state

    monkeypatch.setattr(ckpt_lib, "_restore_state", one_bit_off)
    with pytest.raises(ckpt_lib.CheckpointError, match=r"array params/encoder/layer_0/feed_forward/linear1/kernel "):
        ckpt_lib.load(tmp_path / "ckpt", "latest", weights_only=True)


def test_keeps_the_last_k_and_the_best(tmp_path, tokenizer):
    state = _trained_state(0)
    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt", keep=2)
    scores = {2: 10.0, 4: 30.0, 6: 20.0}  # step 4 is the best; steps 1, 3, 5, 7, 8 carry no score
    for step in range(1, 9):
        metrics = {"score": scores[step]} if step in scores else None
        manager.save(
            step,
            trainer.state_for_saving(state),
            config=CONFIG,
            optim=OPTIM.to_dict(),
            tokenizer=tokenizer,
            metrics=metrics,
        )
    manager.wait()
    assert manager.steps() == [4, 7, 8]
    assert manager.best_step() == 4 and manager.latest_step() == 8
    manager.close()
    assert ckpt_lib.load(tmp_path / "ckpt").step == 4  # load() defaults to the best


def test_restoring_into_a_different_config_names_the_field(tmp_path, tokenizer):
    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt")
    manager.save(
        1, trainer.state_for_saving(_trained_state(0)), config=CONFIG, optim=OPTIM.to_dict(), tokenizer=tokenizer
    )
    manager.close()
    with pytest.raises(ConfigError, match=r"'d_model': checkpoint .* has 32, requested 64"):
        ckpt_lib.load(tmp_path / "ckpt", "latest", expected_config=CONFIG.replace(d_model=64))
    with pytest.raises(ckpt_lib.CheckpointError, match="no checkpoint for step 5; saved steps are \\[1\\]"):
        ckpt_lib.load(tmp_path / "ckpt", 5)


# --- resume through train.py ---------------------------------------------------------------------------------


def _final_state(run_dir):
    loaded = ckpt_lib.load(run_dir, "latest")
    return loaded.step, flat(loaded.state)


def _train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def resumed_and_straight(tmp_path_factory):
    """Trains 4 steps and stops; resumes that run (a fresh TrainState, BatchStream and Trainer) to 10 steps; and
    runs 10 steps uninterrupted. Dropout is on (the tiny preset's 0.1) and 10 steps cross an epoch boundary (the
    corpus makes 5 packed batches), so data order, the reshuffle and the dropout keys all have to be restored."""
    root = tmp_path_factory.mktemp("resume")
    train = write_corpus(root, empty_line=True, long_line=True)
    interrupted, straight = root / "interrupted", root / "straight"
    first = run_main(tiny_train_args(interrupted, train, steps=4))
    resumed = run_main(["train", "--resume", str(interrupted), "--steps", "10", "--no-progress"])
    uninterrupted = run_main(tiny_train_args(straight, train, steps=10))
    return interrupted, straight, first, resumed, uninterrupted


def test_resume_equals_uninterrupted_run(resumed_and_straight):
    interrupted, straight, first, resumed, uninterrupted = resumed_and_straight
    for code, out, err in (first, resumed, uninterrupted):
        assert code == 0, out + err
    assert "resuming" in resumed[1] and "from step 4" in resumed[1]
    per_epoch = int(re.search(r"token slots, (\d+) per epoch", uninterrupted[1]).group(1))
    assert 4 < per_epoch < 10  # the resume is inside the first epoch and the run goes on into the second
    step_a, state_a = _final_state(interrupted)
    step_b, state_b = _final_state(straight)
    assert step_a == step_b == 10
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        # Bit-identical: the same XLA programs on the same inputs in the same order on the same CPU.
        assert np.array_equal(state_a[key], state_b[key]), f"{key} differs after resume"
    losses_a, losses_b = _train_losses(interrupted), _train_losses(straight)
    assert sorted(losses_a) == list(range(1, 11))  # the resumed log continues the first one, each step once
    assert losses_a == losses_b
    assert len(set(losses_b.values())) == 10  # the losses do change from step to step


def test_skipped_pairs_are_counted_and_reported(resumed_and_straight):
    _, _, (code, out, _), _, _ = resumed_and_straight
    assert code == 0
    assert "skipped 1 with an empty side (lines 5)" in out
    assert "skipped 1 too long (lines 7)" in out


def test_resume_with_another_config_names_the_field(resumed_and_straight):
    interrupted = resumed_and_straight[0]
    code, out, err = run_main(["train", "--resume", str(interrupted), "--d-model", "64", "--no-progress"])
    assert code == 1
    assert "'d_model': checkpoint" in err and "has 32, requested 64" in err
    assert "Traceback" not in err
    code, out, err = run_main(["train", "--resume", str(interrupted), "--warmup-steps", "99", "--no-progress"])
    assert code == 1 and "warmup_steps=20" in err and "warmup_steps=99" in err
    assert "Traceback" not in err


def test_runs_from_before_packing_resume_with_length_buckets():
    """A checkpoint whose data settings predate `batching` was trained on length buckets: its resume keeps them, and
    asking for packed batches on that resume is refused (the data order would change)."""
    from jax_transformer.errors import UsageError
    from jax_transformer.settings.resolve import resolve

    def data(given, stored_data):  # what a resume with these data flags continues with
        stored = {"seed": 0, "optim": {}, "loop": {}, "data": stored_data}
        return resolve({"data": given}, stored).data

    old = {"tsv": "/data/train.tsv", "vocab_size": 100, "max_tokens": 512}
    assert data({}, old).batching == "buckets"
    assert data({}, {**old, "batching": "packed"}).batching == "packed"
    with pytest.raises(UsageError, match="batching='buckets'"):
        data({"batching": "packed"}, old)
    with pytest.raises(UsageError, match="pack_length=None"):
        data({"pack_length": 32}, {**old, "batching": "packed"})


def test_array_sums_are_the_same_on_host_and_device_and_see_any_change(monkeypatch):
    """The format-4 checksum: a host array (summed in flat chunks on the CPU) and the same array summed on a device
    where it lies (as a split array is; tests/helpers/mesh_paths.py compares split arrays) give the same sums, for
    every dtype a state holds, an empty and a 0-d array, and an array over one chunk; one element changed by one
    bit, or two elements swapped, changes it."""
    import jax.numpy as jnp
    from ml_dtypes import bfloat16

    rng = np.random.default_rng(0)
    arrays = [
        np.full((), 1.5, np.float32),
        np.zeros((0, 3), np.float32),
        rng.standard_normal(7).astype(bfloat16),
        rng.integers(0, 2**31, (3, 5), dtype=np.uint32),
        rng.integers(-5, 5, (4100,), dtype=np.int32),
        rng.standard_normal((1100, 1000)).astype(np.float32),  # 1.1M elements: two chunks of 2^20
        np.array([True, False, True]),
    ]
    for array in arrays:
        on_device = np.asarray(ckpt_lib._device_sums(jnp.asarray(array)))  # how split arrays are summed
        assert np.array_equal(on_device, ckpt_lib._host_sums(array)), array.dtype
        assert ckpt_lib.array_sum(array) == ckpt_lib.array_sum(jnp.asarray(array)), array.dtype
    with monkeypatch.context() as m:  # JAX without its CPU backend: numpy alone, the same sums
        m.setattr(ckpt_lib, "_host_cpu", lambda: None)
        for array in arrays:
            assert np.array_equal(np.asarray(ckpt_lib._device_sums(jnp.asarray(array))), ckpt_lib._host_sums(array))
    big = arrays[5].copy()
    before = ckpt_lib.array_sum(big)
    big.view(np.uint32)[1099, 999] ^= 1
    assert ckpt_lib.array_sum(big) != before
    big.view(np.uint32)[1099, 999] ^= 1
    big[0, 0], big[0, 1] = big[0, 1], big[0, 0]
    assert ckpt_lib.array_sum(big) != before
    assert ckpt_lib.array_sum(arrays[4].astype(np.float32)) != ckpt_lib.array_sum(arrays[4])  # the dtype counts


def test_a_format_3_step_is_still_verified_by_its_sha256(tmp_path, tokenizer):
    """Steps written before the element sums carry the SHA-256 of each whole array: they load verified by it (onto
    the host, then where a placement asks), and an array that does not match it is named."""
    from jax_transformer.checkpoint.manager import _meta_checksum

    manager = ckpt_lib.CheckpointManager(tmp_path / "ckpt")
    state = jax.device_get(trainer.state_for_saving(_trained_state()))
    manager.save(3, state, config=CONFIG, optim=OPTIM.to_dict(), tokenizer=tokenizer)
    manager.close()
    meta_file = tmp_path / "ckpt" / "3" / "meta" / "metadata"

    def write_as_format_3(arrays):
        meta = json.loads(meta_file.read_text())
        meta["format"] = 3
        meta["checksums"] = {"arrays": arrays, "meta": _meta_checksum(meta)}
        meta_file.write_text(json.dumps(meta))

    sha = ckpt_lib.array_checksums(state)
    assert all(digest.startswith("sha256:") for digest in sha.values())
    write_as_format_3(sha)
    loaded = ckpt_lib.load(tmp_path / "ckpt", 3)
    assert (loaded.format, loaded.verified) == (3, True)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = ckpt_lib.load(tmp_path / "ckpt", 3, placement=lambda name, shape: device)  # read whole, then placed
    for a, b in zip(jax.tree.leaves(placed.state), jax.tree.leaves(loaded.state)):
        assert isinstance(a, jax.Array) and a.sharding == device and np.array_equal(np.asarray(a), b)
    name = next(name for name in sha if name.startswith("params/"))
    write_as_format_3({**sha, name: "sha256:" + "0" * 64})
    with pytest.raises(ckpt_lib.CheckpointError, match=f"array {name} does not match its checksum"):
        ckpt_lib.load(tmp_path / "ckpt", 3)
