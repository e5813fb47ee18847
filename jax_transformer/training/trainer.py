"""The twin of `torch_reference/training.py`: Adam with the paper's schedule (section 5.3), the train state, the
train step (label-smoothed cross-entropy summed over real target tokens, divided once by the global token count;
under jit, pmap or sharded jit, with gradient accumulation, all computing the same update) and the eval step.
Dropout keys are folded from the step number, so a resumed run draws the same masks. docs/internals.md#training."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_transformer import compilation
from jax_transformer.errors import ConfigError
from jax_transformer.model import lora
from jax_transformer.model.dropout import global_rows
from jax_transformer.model.sharding import BATCH_AXES, MeshShape, check_divisible, total_bytes, tree_shardings
from jax_transformer.model.transformer import Transformer, init_params
from jax_transformer.settings.config import PARALLEL_MODES, OptimConfig, TransformerConfig
from jax_transformer.training import finetuning
from jax_transformer.training.losses import loss_sums

__all__ = [
    "OptimConfig",
    "TrainState",
    "create_train_state",
    "restore_train_state",
    "make_optimizer",
    "make_train_step",
    "make_eval_step",
    "evaluate_loss",
    "noam_rate",
    "summarize",
]

AXIS = "devices"  # pmap axis name used by the data-parallel step
# A batch is a dict of (B, L) int32 arrays: src, tgt_in, tgt_out, and for packed rows these as well.
PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")


# =============================================================================================================
# 1. Optimiser and learning-rate schedule (settings: `jax_transformer.settings.config.OptimConfig`)
# =============================================================================================================


def noam_rate(step, d_model: int, warmup_steps: int, scale: float = 1.0):
    """The paper's learning rate for the update numbered `step` (1, 2, ...):
    lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5). Works on Python numbers and jnp arrays."""
    xp = jnp if isinstance(step, jax.Array) else np
    step = xp.maximum(xp.asarray(step, dtype=xp.float32), 1.0)
    return scale * d_model**-0.5 * xp.minimum(step**-0.5, step * warmup_steps**-1.5)


def learning_rate_schedule(d_model: int, opt: OptimConfig) -> optax.Schedule:
    """An optax schedule. optax calls it with the number of updates already applied (0 for the first update).
    noam: the paper counts from 1, so the first update uses noam_rate(1). The fine-tuning schedules are optax's,
    joined after a linear warm-up from 0 (so the first update's rate is 0, as with transformers'
    get_*_schedule_with_warmup on torch's LambdaLR)."""
    if opt.schedule == "noam":
        return lambda count: noam_rate(count + 1, d_model, opt.warmup_steps, opt.lr_scale)
    peak, warmup = opt.lr, opt.warmup_steps
    if opt.schedule in ("linear", "cosine") and opt.decay_steps is None:
        raise ConfigError(
            f"optimiser field 'decay_steps' is needed with --schedule {opt.schedule} (--decay-steps; `train` sets "
            f"it to the run's --steps)"
        )
    after = {
        "constant": lambda: optax.constant_schedule(peak),
        "linear": lambda: optax.linear_schedule(peak, 0.0, opt.decay_steps - warmup),
        "cosine": lambda: optax.cosine_decay_schedule(peak, opt.decay_steps - warmup),
        # transformers' get_inverse_sqrt_schedule (fairseq's inverse_sqrt): peak * sqrt(warmup / step); optax has
        # no such schedule
        "inverse_sqrt": lambda: lambda count: peak * jnp.sqrt(warmup / jnp.maximum(count + warmup, warmup)),
    }[opt.schedule]()
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def _decay_mask(params):
    # Decay weight matrices and embeddings only; biases and LayerNorm scales are left alone (common practice).
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def make_optimizer(config: TransformerConfig, opt: OptimConfig) -> optax.GradientTransformation:
    """Adam(b1, b2, eps) on `learning_rate_schedule`'s schedule; clip_by_global_norm first if asked; AdamW if
    weight_decay > 0."""
    schedule = learning_rate_schedule(config.d_model, opt)
    if opt.weight_decay:
        adam = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay, mask=_decay_mask)
    else:
        adam = optax.adam(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    if opt.clip_norm is not None:
        return optax.chain(optax.clip_by_global_norm(opt.clip_norm), adam)
    return adam


# =============================================================================================================
# 2. Train state
# =============================================================================================================


class TrainState(flax.struct.PyTreeNode):
    """Everything one step reads and writes. `step` counts updates applied so far (an int32 scalar array, so
    the state is a pure pytree); `dropout_key` is the run's base key and never changes."""

    step: jax.Array
    params: Any
    opt_state: Any
    dropout_key: jax.Array


def create_train_state(config: TransformerConfig, opt: OptimConfig, *, seed: int = 0, params=None) -> TrainState:
    """A fresh state: params from `init_params(config, seed)` unless given (e.g. ported from PyTorch)."""
    if params is None:
        params = init_params(config, seed)
    # A copy: the train step may donate the state's buffers, which must not be the caller's arrays.
    params = jax.tree_util.tree_map(lambda p: jnp.array(p, copy=True), params)
    if config.lora_rank:  # adapters the given weights lack (a pretrained model's) start fresh
        params = lora.with_adapters(params, config, seed)
    if config.quantize != "none":  # QLoRA: the frozen base's matrices in int8, the adapters float32
        params = finetuning.quantized_base(params, config)
    tx = make_optimizer(config, opt)
    # The dropout key is derived from the seed but kept apart from the init key (fold_in 1).
    dropout_key = jax.random.fold_in(jax.random.key(seed), 1)
    trained, _ = finetuning.split(params, config, opt.freeze)  # the optimiser's state: for the trained arrays only
    return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(trained), dropout_key=dropout_key)


def abstract_train_state(config: TransformerConfig, opt: OptimConfig) -> TrainState:
    """Shapes and dtypes of a train state (nothing allocated)."""
    return jax.eval_shape(lambda: create_train_state(config, opt))


def restore_train_state(saved: Mapping[str, Any], config: TransformerConfig, opt: OptimConfig) -> TrainState:
    """A TrainState from the nested dict of arrays a checkpoint holds (`state_for_saving`'s form), structured for
    `config` and `opt`; the dropout key's raw words are wrapped back into a typed key. ValueError naming the
    first mismatches when the saved arrays do not fit the model or the optimiser."""
    template = abstract_train_state(config, opt)
    try:
        state = serialization.from_state_dict(template, saved)
    except (ValueError, KeyError) as e:
        raise ValueError(f"the saved train state does not fit the model/optimiser config: {e}") from None
    expected = jax.tree_util.tree_flatten_with_path(template.replace(dropout_key=None))[0]
    found = jax.tree_util.tree_leaves(state.replace(dropout_key=None))
    wrong = [
        f"{jax.tree_util.keystr(path)} saved {np.shape(have)}, expected {want.shape}"
        for (path, want), have in zip(expected, found)
        if tuple(want.shape) != np.shape(have)
    ]
    if wrong:
        raise ValueError(f"the saved train state does not fit the model/optimiser config: {'; '.join(wrong[:5])}")
    return state.replace(dropout_key=jax.random.wrap_key_data(jnp.asarray(state.dropout_key, jnp.uint32)))


def state_for_saving(state: TrainState) -> dict[str, Any]:
    """The state as a nested dict of arrays, left where they are (a checkpoint writes each process's shards), the
    dropout key as its raw words: what a checkpoint holds."""
    return serialization.to_state_dict(state.replace(dropout_key=jax.random.key_data(state.dropout_key)))


# =============================================================================================================
# 3. The training step
# =============================================================================================================


def batch_loss_sums(
    params, batch: Mapping[str, jax.Array], config: TransformerConfig, label_smoothing: float, dropout_key=None
) -> dict[str, jax.Array]:
    """Teacher-forced forward pass -> summed loss statistics over the batch's real target tokens (src, tgt_in,
    tgt_out, and `PACKING_KEYS` for packed rows). Dropout is on when a key is given (training), off otherwise."""
    deterministic = dropout_key is None
    rngs = None if deterministic else {"dropout": dropout_key}
    packing = {key: batch[key] for key in PACKING_KEYS if key in batch}  # packed rows: segment ids, positions
    logits = Transformer(config).apply(
        {"params": params}, batch["src"], batch["tgt_in"], deterministic=deterministic, rngs=rngs, **packing
    )  # (B, T, V)
    return loss_sums(logits, batch["tgt_out"], config.pad_id, label_smoothing)


def micro_batches(batch: Mapping[str, jax.Array], accumulate: int, blocks: int = 1) -> dict[str, jax.Array]:
    """(B, L) arrays -> (accumulate, blocks, B / (blocks * accumulate), L): micro-batch k holds the k-th slice of
    each of the `blocks` contiguous row blocks (one block per device under sharded jit), so no row moves between
    devices."""
    return {
        key: jnp.swapaxes(x.reshape(blocks, accumulate, -1, *x.shape[1:]), 0, 1)  # (K, blocks, m, L)
        for key, x in batch.items()
    }


def micro_batch_rows(k, rows: int, accumulate: int, blocks: int = 1, first_row=0) -> jax.Array:
    """(blocks, m): the global batch row of each row of micro-batch k (`micro_batches`) of a batch of `rows` rows
    whose row 0 is global row `first_row` (nonzero for a pmap device's block): what dropout hashes."""
    per_block = rows // blocks
    m = per_block // accumulate
    return first_row + jnp.arange(blocks)[:, None] * per_block + k * m + jnp.arange(m)[None, :]


def train_step(
    state: TrainState,
    batch,
    *,
    config: TransformerConfig,
    tx: optax.GradientTransformation,
    label_smoothing: float,
    freeze: str | None = None,
    dropout: bool = True,
    axis_name: str | None = None,
    accumulate: int = 1,
    mesh: Mesh | None = None,
    param_shardings=None,
):
    """One optimiser update. Returns (new state, the batch's loss sums before the update).

    The gradient is that of the *sum* of the loss over the batch's real target tokens, divided once by the number
    of those tokens. Summing first makes every way of splitting the batch compute the same update (up to the order
    of float additions); averaging per-part means would weight a token by 1 / its part's own token count:
    - pmap (axis_name given): each device holds a block of rows; gradients and sums are added over devices
      with psum.
    - sharded jit (`mesh` given: the batch is a global array split over the mesh's (data, fsdp) devices by rows;
      `param_shardings` where the state is split over fsdp / tensor, `jax_transformer.model.sharding`): the compiler
      adds the devices' partial sums itself.
    - `accumulate` K > 1 (gradient accumulation): K micro-batches, one after the other in a `lax.scan`, their
      gradient and loss sums added up; only one micro-batch's activations are alive at a time. Under sharded
      jit with a replicated state each device adds up its own rows' partial sums over the micro-batches (a
      per-device block axis, under `vmap`) and the devices' sums are added once after the scan: one all-reduce
      per step, not one per micro-batch. With a split state, each micro-batch's gradient is reduce-scattered
      into the parameters' layout as it is added (a whole gradient per device is what splitting avoids).
    Dropout masks are a function of each element's global batch row (`dropout.global_rows`), so they do not
    depend on any of these splits either: every path takes the same step as one device on the whole batch.
    Only the trained parameters are differentiated and updated (LoRA adapters, or what `freeze` leaves:
    `finetuning.split`); the frozen ones are read as they are.
    """
    key = jax.random.fold_in(state.dropout_key, state.step)  # depends only on the step: resume is exact
    trained, frozen = finetuning.split(state.params, config, freeze)
    if param_shardings is not None:
        param_shardings, _ = finetuning.split(param_shardings, config, freeze)
    rows = batch["tgt_out"].shape[0]  # rows this program sees: the global batch, or a pmap device's block
    first_row = 0 if axis_name is None else lax.axis_index(axis_name) * rows

    def grads_and_sums(part, row_ids):
        def summed_loss(trained):
            params = finetuning.joined(trained, frozen)
            with global_rows(row_ids):
                sums = batch_loss_sums(params, part, config, label_smoothing, key if dropout else None)
            return sums["loss"], sums

        return jax.grad(summed_loss, has_aux=True)(trained)

    if accumulate == 1:
        grads, sums = grads_and_sums(batch, first_row + jnp.arange(rows))
    else:
        # the devices' row blocks (data x fsdp), each micro-batch a slice of every block: no row moves
        blocks = 1 if mesh is None else mesh.shape[BATCH_AXES[0]] * mesh.shape[BATCH_AXES[1]]
        micro = _laid_out(micro_batches(batch, accumulate, blocks), mesh, P(None, BATCH_AXES))  # (K, blocks, m, L)
        first = jax.tree_util.tree_map(lambda x: x[0], micro)
        if param_shardings is None:
            per_block = jax.vmap(grads_and_sums)  # (blocks, m, L) rows -> (blocks, ...) partial sums
            layout = lambda tree: _laid_out(tree, mesh, P(BATCH_AXES))  # noqa: E731
        else:  # the micro-batch's rows all at once: (blocks, m, L) -> (blocks * m, L), still in the devices' order

            def per_block(part, row_ids):
                flat = jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]), (part, row_ids))
                return grads_and_sums(*flat)

            layout = lambda tree: (lax.with_sharding_constraint(tree[0], param_shardings), tree[1])  # noqa: E731
        shapes = jax.eval_shape(per_block, first, micro_batch_rows(0, rows, accumulate, blocks, first_row))

        def add_micro_batch(total, k_and_micro):
            k, part = k_and_micro
            partial_sums = per_block(part, micro_batch_rows(k, rows, accumulate, blocks, first_row))
            return layout(jax.tree_util.tree_map(jnp.add, total, partial_sums)), None

        zeros = layout(jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
        (grads, sums), _ = lax.scan(add_micro_batch, zeros, (jnp.arange(accumulate), micro))
        if param_shardings is None:
            grads, sums = jax.tree_util.tree_map(lambda x: x.sum(axis=0), (grads, sums))  # over the blocks
    if axis_name is not None:
        grads, sums = lax.psum((grads, sums), axis_name)
    tokens = jnp.maximum(sums["tokens"], 1.0)  # an all-padding batch has no tokens: avoid 0 / 0
    grads = jax.tree_util.tree_map(lambda g: g / tokens, grads)  # gradient of the mean loss per real token
    grads = keep_start_row(grads, config)
    with jax.named_scope("optimizer"):  # names the update's ops in a profile (benchmarks/step_profile.py)
        updates, opt_state = tx.update(grads, state.opt_state, trained)
        params = finetuning.joined(optax.apply_updates(trained, updates), frozen)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), sums


def keep_start_row(grads, config: TransformerConfig):
    """Marian's convention (the decoder starts from the pad token): the target embedding's pad row is the decoder's
    start vector, which Marian and CTranslate2 hard-code as zero. Its lookup gets no gradient (Transformer._embed),
    but a tied output projection would still train it as the pad token's output row; that gradient is zeroed, so
    fine-tuning an imported model keeps the row zero and the exported model starts where those engines start."""
    if config.decoder_start_id != config.pad_id or not config.tie_output:
        return grads
    name = "shared_embed" if config.share_embeddings else "target_embed"
    if "embedding" not in grads.get(name, {}):  # the table is frozen
        return grads
    table = grads[name]["embedding"]  # (V, D)
    return {**grads, name: {**grads[name], "embedding": table.at[config.pad_id].set(0.0)}}


def _laid_out(tree, mesh: Mesh | None, spec: P):
    """`tree` laid out over `mesh` as `spec` says (a constraint for the compiler inside jit); unchanged without
    a mesh."""
    return tree if mesh is None else lax.with_sharding_constraint(tree, NamedSharding(mesh, spec))


def make_train_step(
    config: TransformerConfig,
    opt: OptimConfig,
    *,
    n_devices: int = 1,
    dropout: bool = True,
    parallel: str = "auto",
    accumulate: int = 1,
    mesh: MeshShape | None = None,
    donate: bool | None = None,
):
    """The compiled step. Callers must not use the state they passed in after the call: on accelerators it is
    donated (its buffers are reused for the new state; see `state_donation`; `donate` says so for any backend: the
    memory plan compiles as an accelerator would). `parallel`:
    - "jit": `jax.jit` on one device (n_devices must be 1);
    - "pmap": `jax.pmap` over the first `n_devices` local devices; the state is replicated and the batch has a
      leading device axis (`replicate`, `shard_batch`);
    - "sharded": `jax.jit` over a `Mesh` of the first `n_devices` global devices, shaped by `mesh` (default: all
      on `data`): the state laid out by `sharding.RULES` (replicated on a data-only mesh), the batch a global array
      split by rows over data x fsdp (`P(("data", "fsdp"))`);
    - "auto": jit on one device, sharded on more.
    `accumulate` K splits each device's rows into K micro-batches (see `train_step`)."""
    if parallel == "auto":
        parallel = "jit" if n_devices == 1 else "sharded"
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {('auto',) + PARALLEL_MODES}, got {parallel!r}")
    if parallel == "jit" and n_devices != 1:
        raise ValueError(f"parallel='jit' runs on one device, got n_devices={n_devices}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
    if parallel == "sharded":
        mesh = mesh or MeshShape(data=n_devices)
        if mesh.size != n_devices:
            raise ValueError(f"a mesh of {mesh.size} devices ({mesh}) for a step on {n_devices}")
        check_divisible(config, mesh)
    elif mesh is not None and mesh.size > 1:
        raise ValueError(f"a mesh ({mesh}) is for parallel='sharded', not {parallel!r}")
    return _compiled_train_step(config, opt, n_devices, dropout, parallel, accumulate, mesh, donate)


def state_donation(config: TransformerConfig, opt: OptimConfig) -> tuple[int, ...]:
    """The step's donated arguments: the state on GPU and TPU, where memory is scarce. On a CPU, nothing while two
    copies of the train state take at most half the host's memory: there XLA, given a donated state, copies every
    parameter that the backward pass reads before the update may write the new value over it (all but the
    embeddings), which costs more step time than fresh buffers do (measured in docs/benchmarks.md). A state too
    large for two copies is donated there too."""
    if jax.default_backend() != "cpu":
        return (0,)
    state_bytes = total_bytes(abstract_train_state(config, opt))
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return (0,) if 2 * state_bytes > host_bytes / 2 else ()


@functools.lru_cache(maxsize=16)  # one compiled step per (config, optimiser, devices, options), reused by later runs
def _compiled_train_step(
    config: TransformerConfig,
    opt: OptimConfig,
    n_devices: int,
    dropout: bool,
    parallel: str,
    accumulate: int,
    mesh_shape: MeshShape | None,
    donate_state: bool | None,
):
    donate = state_donation(config, opt) if donate_state is None else ((0,) if donate_state else ())
    tx = make_optimizer(config, opt)
    options = dict(config=config, tx=tx, label_smoothing=opt.label_smoothing, freeze=opt.freeze, dropout=dropout)
    options.update(accumulate=accumulate)
    if parallel == "jit":
        return compilation.jit(functools.partial(train_step, **options), config.dtype, donate_argnums=donate)
    if parallel == "pmap":
        # jax.pmap takes no compiler options: the pmapped step is compiled by an enclosing jit, which gives it its
        # options (jit of pmap is pmap's own program; its outputs keep pmap's sharding).
        pmapped = jax.pmap(functools.partial(train_step, axis_name=AXIS, **options), axis_name=AXIS)
        return compilation.jit(pmapped, config.dtype, donate_argnums=donate)
    mesh = mesh_shape.mesh()
    state = state_shardings(config, opt, mesh_shape, mesh)
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(BATCH_AXES))
    split = state.params if mesh_shape.shards_state else None
    fn = functools.partial(train_step, mesh=mesh, param_shardings=split, **options)
    shardings = dict(in_shardings=(state, by_rows), out_shardings=(state, replicated))
    return compilation.jit(fn, config.dtype, donate_argnums=donate, **shardings)


def state_shardings(config: TransformerConfig, opt: OptimConfig, mesh_shape: MeshShape, mesh: Mesh | None = None):
    """Where each array of the train state lives on the mesh (a TrainState of NamedShardings, `sharding.RULES`)."""
    return tree_shardings(abstract_train_state(config, opt), mesh or mesh_shape.mesh(), mesh_shape)


@functools.lru_cache(maxsize=16)
def make_eval_step(config: TransformerConfig, label_smoothing: float):
    """Compiled evaluation on one device: (params, batch) -> loss sums, dropout off. Params are not donated."""
    return compilation.jit(lambda params, batch: batch_loss_sums(params, batch, config, label_smoothing), config.dtype)


def shard_batch(batch: Mapping[str, np.ndarray], n_devices: int) -> dict[str, np.ndarray]:
    """(B, L) arrays -> (n_devices, B / n_devices, L) for pmap: each device gets a contiguous block of rows."""
    out = {}
    for key, value in batch.items():
        if value.shape[0] % n_devices:
            raise ValueError(
                f"batch[{key!r}] has {value.shape[0]} rows, not divisible by {n_devices} devices; "
                f"build the BatchStream with a row_multiple divisible by {n_devices}"
            )
        out[key] = value.reshape(n_devices, value.shape[0] // n_devices, *value.shape[1:])
    return out


def replicate(tree, n_devices: int):
    """A pytree copied onto each of the first n local devices (leading axis n) for pmap."""
    import flax.jax_utils

    devices = jax.local_devices()[:n_devices]
    replicated = flax.jax_utils.replicate(tree, devices=devices)
    # flax's replicate gives the arrays a different sharding than a pmap step returns, so the step's second call
    # would compile again (tens of seconds on CPU). One identity pmap gives them the step's own sharding.
    return jax.pmap(lambda x: x, axis_name=AXIS, devices=devices)(replicated)


def unreplicate(tree, n_devices: int):
    """The first device's copy of a pmap-replicated pytree (they are equal)."""
    return jax.tree_util.tree_map(lambda x: x[0], tree)


def summarize(sums: Mapping[str, Any]) -> dict[str, float]:
    """Loss sums -> per-token numbers: loss (smoothed), nll, perplexity = exp(mean nll), accuracy, tokens."""
    tokens = float(sums["tokens"])
    denom = max(tokens, 1.0)
    nll = float(sums["nll"]) / denom
    return {
        "loss": float(sums["loss"]) / denom,
        "nll": nll,
        "ppl": math.exp(min(nll, 700.0)),
        "accuracy": float(sums["correct"]) / denom,
        "tokens": tokens,
    }


# =============================================================================================================
# 4. Evaluation
# =============================================================================================================


def evaluate_loss(params, eval_step, batches: Iterable[Mapping[str, np.ndarray]]) -> dict[str, float]:
    """Loss, perplexity and token accuracy over evaluation batches (dicts src/tgt_in/tgt_out), on one device
    (under pmap training, pass the first replica's params)."""
    total = {"loss": 0.0, "nll": 0.0, "tokens": 0.0, "correct": 0.0}
    for batch in batches:
        sums = jax.device_get(eval_step(params, batch))
        for k in total:
            total[k] += float(sums[k])
    return summarize(total)
