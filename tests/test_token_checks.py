"""Token ids and shapes checked at every public entry point (jax_transformer/checks.py): the model on concrete
arrays, the model under jit (trace-time shapes, checkify for values), the loss, the training loop's batch
boundary, packed batches, the port; and a property test of the checks against a plain-numpy oracle."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_transformer import checks
from jax_transformer.errors import TokenError
from jax_transformer.model.transformer import Transformer, init_params
from jax_transformer.training import trainer
from jax_transformer.training.losses import loss_sums
from tests.helpers.batches import packed_batch, unit_batch
from tests.helpers.configs import unit_config, unit_optim
from tests.helpers.tooling import fuzz
from tests.helpers.twins import flat

CONFIG = unit_config()  # vocabulary 50 on both sides, max_len 16
V, MAX_LEN = CONFIG.src_vocab_size, CONFIG.max_len


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, 0)


def _apply(params, src, tgt_in, **packing):
    return Transformer(CONFIG).apply({"params": params}, src, tgt_in, **packing)


def _with(array, row, column, value):
    array = np.array(array)
    array[row, column] = value
    return array


# --- the model on concrete arrays ---------------------------------------------------------------------------------


def test_model_refuses_bad_ids_and_lengths_naming_array_position_and_limit(params):
    batch = unit_batch(0)
    src, tgt = batch["src"], batch["tgt_in"]
    cases = [
        # Without the checks: an id == V gives NaN logits (XLA's gather fills out-of-range rows with NaN) ...
        ((_with(src, 1, 3, V), tgt), r"src\[1, 3\] = 50 is outside the source vocabulary \[0, 50\)"),
        # ... and a negative id silently reads another row of the embedding table (finite, wrong logits).
        ((src, _with(tgt, 2, 0, -1)), r"tgt_in\[2, 0\] = -1 is outside the target vocabulary \[0, 50\)"),
        # ... and a long source fails inside XLA ("slice_sizes must be less than or equal to operand shape").
        ((np.ones((2, MAX_LEN + 1), np.int32), tgt[:2]), r"src has length 17, more than config.max_len=16"),
        ((src, np.ones((4, MAX_LEN + 4), np.int32)), r"tgt_in has length 20, more than config.max_len=16"),
        ((src.astype(np.float32), tgt), r"src must hold integer token ids, got dtype float32"),
        ((src[0], tgt), r"src must have shape \(batch, length\), got shape \(10,\)"),
    ]
    for (bad_src, bad_tgt), message in cases:
        with pytest.raises(TokenError, match=message):
            _apply(params, bad_src, bad_tgt)
    memory = Transformer(CONFIG).apply({"params": params}, src, method=Transformer.encode)
    with pytest.raises(TokenError, match=r"memory has shape \(4, 10, 32\) but src \(3, 10\)"):
        Transformer(CONFIG).apply({"params": params}, memory, src[:3], tgt[:3], method=Transformer.decode)
    # Good input is untouched by the checks: finite logits of the expected shape.
    logits = _apply(params, src, tgt)
    assert logits.shape == (4, 10, V) and np.isfinite(logits).all()


def test_decoding_step_by_step_past_max_len_is_refused(params):
    """Beyond the positions table `dynamic_slice` would silently clamp and reuse the last position."""
    model = Transformer(CONFIG)
    src = unit_batch(0)["src"][:1]
    memory = model.apply({"params": params}, src, method=Transformer.encode)
    dummy = np.zeros((1, MAX_LEN), np.int32)
    _, state = model.apply({"params": params}, memory, src, dummy, decode=True, mutable=["cache"], method=model.decode)
    token = np.full((1, 1), CONFIG.bos_id, np.int32)

    def step_at(position: int):
        history = np.zeros((1, MAX_LEN), np.int32)  # one slot a position
        return model.apply(
            {"params": params, "cache": state["cache"]},
            memory,
            src,
            token,
            decode=True,
            step=position,
            history=history,
            mutable=["cache"],
            method=model.decode,
        )

    logits, _ = step_at(MAX_LEN - 1)  # the last position of the table
    assert logits.shape == (1, 1, V)
    with pytest.raises(TokenError, match=r"starting at position 16, more than config.max_len=16"):
        step_at(MAX_LEN)


# --- under jit: shapes at trace time, values with checkify -------------------------------------------------------


def test_under_jit_lengths_fail_at_trace_time_and_checkify_names_bad_ids(params):
    batch = unit_batch(0)
    forward = lambda p, s, t: Transformer(CONFIG).apply({"params": p}, s, t)  # noqa: E731
    with pytest.raises(TokenError, match="src has length 17, more than config.max_len=16"):
        jax.jit(forward)(params, np.ones((2, MAX_LEN + 1), np.int32), batch["tgt_in"][:2])  # fails while tracing

    # A plain jit cannot look at values: the checks there are checkify debug checks, which do nothing, and the
    # compiled evaluation step (model + loss) returns NaN for an id beyond the vocabulary ...
    bad_src = _with(batch["src"], 2, 4, 77)
    assert np.isnan(float(trainer.make_eval_step(CONFIG, 0.1)(params, dict(batch, src=bad_src))["loss"]))
    # ... until the caller checkifies its function: then the bad id is named, under the caller's own jit.
    loss = jax.jit(checks.checkified(lambda p, b: trainer.batch_loss_sums(p, b, CONFIG, 0.1)))
    cases = [
        ("src", (2, 4), 77, r"src\[2, 4\] = 77 is outside the source vocabulary \[0, 50\)"),
        ("tgt_in", (3, 9), -5, r"tgt_in\[3, 9\] = -5 is outside the target vocabulary \[0, 50\)"),
        ("tgt_out", (0, 1), 50, r"targets\[0, 1\] = 50 is outside the vocabulary \[0, 50\)"),  # the loss's
    ]
    for key, (row, column), value, message in cases:
        error, _ = loss(params, dict(batch, **{key: _with(batch[key], row, column, value)}))
        assert re.match(message, error.get()), error.get()
    error, sums = loss(params, batch)
    assert error.get() is None
    plain = trainer.make_eval_step(CONFIG, 0.1)(params, batch)
    assert all(np.array_equal(sums[k], plain[k]) for k in plain)  # checkified or not: the same numbers


def _opcodes(compiled_text: str) -> collections.Counter:
    """The multiset of HLO opcodes of a compiled program (names and source metadata ignored)."""
    return collections.Counter(re.findall(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9_-]*)\(", compiled_text))


def test_debug_checks_leave_the_compiled_train_step_unchanged(monkeypatch):
    """The in-graph checks must cost nothing in a plain jit: the compiled training step has the very same
    operations with them as with every debug check removed."""
    config = CONFIG.replace(num_encoder_layers=1, num_decoder_layers=1)  # one layer each: half the compile time
    batch = unit_batch(0)
    tx = trainer.make_optimizer(config, unit_optim())
    state = trainer.create_train_state(config, unit_optim())

    def compiled() -> str:
        step = lambda s, b: trainer.train_step(s, b, config=config, tx=tx, label_smoothing=0.1)  # noqa: E731
        return jax.jit(step).lower(state, batch).compile().as_text()

    with_checks = compiled()
    monkeypatch.setattr(checks, "debug_check_ids", lambda *a, **k: None)
    monkeypatch.setattr(checks, "debug_check_range", lambda *a, **k: None)
    without = compiled()
    ops = _opcodes(with_checks)
    assert sum(ops.values()) > 100 and ops["dot"] + ops["fusion"] > 10  # the parse found the program
    assert ops == _opcodes(without)


def test_the_lowered_train_step_does_not_depend_on_what_was_traced_before():
    """A plain jit lowers the same program whatever the process traced before it: checkify numbers its error
    codes process-wide in tracing order, and JAX's persistent compilation cache keys on the lowered program, so
    debug checks traced outside `checks.checkified` made two runs miss each other's cache entries."""
    config = CONFIG.replace(num_encoder_layers=1, num_decoder_layers=1)
    batch = unit_batch(0)
    tx = trainer.make_optimizer(config, unit_optim())
    state = trainer.create_train_state(config, unit_optim())

    def lowered() -> str:
        step = lambda s, b: trainer.train_step(s, b, config=config, tx=tx, label_smoothing=0.1)  # noqa: E731
        return jax.jit(step).lower(state, batch).as_text()

    first = lowered()
    checked = jax.jit(checks.checkified(lambda p, b: trainer.batch_loss_sums(p, b, config, 0.1)))
    error, _ = checked(state.params, dict(batch, src=_with(batch["src"], 0, 1, 77)))  # the checks still trace here
    assert error.get() is not None
    assert lowered() == first


# --- the loss, the training loop's batch boundary, packed batches --------------------------------------------------


def test_loss_checks_targets():
    logits = jnp.zeros((2, 3, 7))
    with pytest.raises(TokenError, match=r"targets\[1, 2\] = 7 is outside the vocabulary \[0, 7\)"):
        loss_sums(logits, np.array([[1, 2, 3], [4, 5, 7]]), pad_id=0)
    with pytest.raises(TokenError, match=r"targets have shape \(2, 4\), logits \(2, 3, 7\)"):
        loss_sums(logits, np.ones((2, 4), np.int32), pad_id=0)
    assert float(loss_sums(logits, np.array([[1, 2, 3], [4, 5, 0]]), pad_id=0)["tokens"]) == 5.0


@pytest.mark.slow
def test_the_loop_checks_each_batch_before_the_step(tmp_path):
    """A bad batch is a DataError naming the batch, array, position and limit, raised before the compiled step
    sees it (so before the donated state is touched); the steps before it ran normally."""
    from jax_transformer.checkpoint import manager as ckpt_lib
    from jax_transformer.data.batching import ValidationSet
    from jax_transformer.data.tokenizer import Tokenizer
    from jax_transformer.errors import DataError
    from jax_transformer.settings.config import LoopConfig
    from jax_transformer.training import loop as loop_lib

    class Batches:  # unit batches, the third one with a target id beyond the vocabulary
        index = 0

        def __next__(self):
            self.index += 1
            batch = unit_batch(self.index)
            return dict(batch, tgt_out=_with(batch["tgt_out"], 1, 2, V)) if self.index == 3 else batch

        def state(self):
            return {"epoch": 0, "index": self.index, "batches_per_epoch": 1000}

    tokenizer = Tokenizer.train([f"w{i} v{i % 7}" for i in range(200)], 40, model_type="bpe")
    run = loop_lib.Run(
        config=CONFIG,
        optim=unit_optim(),
        tokenizer=tokenizer,
        stream=Batches(),
        state=trainer.create_train_state(CONFIG, unit_optim()),
        loop=LoopConfig(steps=10, save_every=100, progress=False),
        run_dir=tmp_path / "run",
        checkpoints=ckpt_lib.CheckpointManager(tmp_path / "run" / "checkpoints"),
        print=lambda s: None,
    )
    steps, after = [], {}  # each step called, and the step and parameters of the state it returned
    real_step = run.train_step

    def counted_step(state, batch):
        steps.append(1)
        state, sums = real_step(state, batch)
        after.update(step=int(state.step), params=flat(jax.device_get(state.params)))  # before the next donates it
        return state, sums

    run.train_step = counted_step
    with pytest.raises(DataError, match=r"training batch 3\['tgt_out'\]\[1, 2\] = 50 is outside the target vocab"):
        loop_lib.train_loop(run)
    run.checkpoints.close()
    assert len(steps) == 2 and after["step"] == 2
    assert all(np.isfinite(v).all() for v in after["params"].values())

    # Validation batches are checked once, when the run is built.
    valid = ValidationSet([dict(unit_batch(0), src=_with(unit_batch(0)["src"], 0, 0, -2))], ["a"], ["b"])
    with pytest.raises(DataError, match=r"validation batch 0\['src'\]\[0, 0\] = -2 is outside the source vocab"):
        loop_lib.Run(
            config=CONFIG,
            optim=unit_optim(),
            tokenizer=tokenizer,
            stream=Batches(),
            state=trainer.create_train_state(CONFIG, unit_optim()),
            loop=LoopConfig(steps=1, progress=False),
            run_dir=tmp_path / "run2",
            checkpoints=None,
            valid=valid,
        )


PACKED = packed_batch(CONFIG, [[(3, 2), (4, 5)], [(6, 3)], [(2, 2), (2, 1), (1, 1)]], width=12)

PACKING_FAULTS = {
    # name: (key, (row, column), value, message)
    "position beyond max_len": ("src_positions", (0, 3), MAX_LEN, r"src_positions'\]\[0, 3\] = 16 is outside the pos"),
    "position not restarting": ("tgt_positions", (0, 3), 3, r"tgt_positions'\]\[0, 3\] = 3, expected 0: positions re"),
    "segment on padding": ("src_segments", (1, 10), 1, r"src_segments'\]\[1, 10\] = 1 is not 0 under a padding"),
    "no segment on a token": ("tgt_segments", (2, 1), 0, r"tgt_segments'\]\[2, 1\] = 0 is 0 \(padding\) under a real"),
    "segment going back": ("src_segments", (2, 6), 1, r"src_segments'\]\[2, 6\] = 1 goes back to an earlier segm"),
    "target without source": ("tgt_segments", (1, 2), 2, r"row 1 has segment 2, which .* does not have"),
}


@pytest.mark.parametrize("fault", list(PACKING_FAULTS))
def test_packed_batches_are_checked(fault):
    checks.check_batch(PACKED, CONFIG)  # the well-formed packed batch passes
    key, (row, column), value, message = PACKING_FAULTS[fault]
    bad = dict(PACKED, **{key: _with(PACKED[key], row, column, value)})
    if fault == "target without source":  # a consistent target segment 2 in a row whose source has only 1
        bad["tgt_segments"] = _with(PACKED["tgt_segments"], 1, slice(0, 4), 2)
        bad["tgt_positions"] = _with(PACKED["tgt_positions"], 1, slice(0, 4), np.arange(4))
    with pytest.raises(TokenError, match=message):
        checks.check_batch(bad, CONFIG)


def test_batch_checks_know_the_packing_keys_and_leave_other_arrays_alone():
    assert checks.PACKING_KEYS == trainer.PACKING_KEYS
    checks.check_batch(dict(PACKED, weights=np.ones((3, 12), np.float32)), CONFIG)


def test_model_checks_packed_positions(params):
    packing = {key: PACKED[key] for key in trainer.PACKING_KEYS}
    logits = _apply(params, PACKED["src"], PACKED["tgt_in"], **packing)
    assert np.isfinite(logits).all()
    with pytest.raises(TokenError, match=r"tgt_positions\[0, 0\] = 16 is outside the positions \[0, 16\)"):
        _apply(
            params,
            PACKED["src"],
            PACKED["tgt_in"],
            **dict(packing, tgt_positions=_with(PACKED["tgt_positions"], 0, 0, 16)),
        )


def test_port_names_weights_of_another_vocabulary():
    from jax_transformer.errors import PortError
    from jax_transformer.interop.port import flax_to_torch, torch_to_flax

    state = flax_to_torch(init_params(CONFIG, 0))
    with pytest.raises(PortError, match=r"shape mismatch source_embed.weight: expected \(51, 32\), got \(50, 32\)"):
        torch_to_flax(state, CONFIG.replace(src_vocab_size=51))


# --- property: the checks agree with a plain-numpy oracle, on the host and under checkify ------------------------

_checked_ids = jax.jit(checks.checkified(lambda a: checks.debug_check_ids("src", a, V, "source")))


@fuzz(40)
@given(
    rows=st.integers(1, 4),
    length=st.integers(1, MAX_LEN + 3),
    seed=st.integers(0, 2**31 - 1),
    bad=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, MAX_LEN + 2), st.sampled_from([-7, -1, V, V + 9])), max_size=3
    ),
)
def test_token_checks_agree_with_a_numpy_oracle(rows, length, seed, bad):
    src = np.random.default_rng(seed).integers(0, V, (rows, length)).astype(np.int32)
    for r, c, value in bad:
        if r < rows and c < length:
            src[r, c] = value
    # The oracle: a length beyond max_len first, else the first out-of-range id in row-major order.
    outside = [(r, c) for r in range(rows) for c in range(length) if not 0 <= src[r, c] < V]
    if length > MAX_LEN:
        expected = f"src has length {length}, more than config.max_len={MAX_LEN} positions"
    elif outside:
        r, c = outside[0]
        expected = f"src[{r}, {c}] = {src[r, c]} is outside the source vocabulary [0, {V})"
    else:
        expected = None
    try:
        checks.check_tokens("src", src, CONFIG, "source")
        found = None
    except TokenError as e:
        found = str(e)
    assert found == expected
    # The in-graph check names the same position and value as the host check (lengths are the host's job).
    error = _checked_ids(src)[0].get()
    if outside:
        r, c = outside[0]
        assert error.startswith(f"src[{r}, {c}] = {src[r, c]} is outside the source vocabulary [0, {V})")
    else:
        assert error is None
