"""The memory plan of a training run, before the run: the training step compiled ahead of time from abstract shapes
(`jax.eval_shape`; nothing allocated) on the run's mesh, and XLA's own account of the compiled program per device
(`Compiled.memory_analysis()`: arguments, outputs, the outputs' bytes that reuse the donated arguments, temporaries),
against the memory of common accelerators. `train.py plan`; docs/scaling.md.

Compiled for the machine it runs on, or for N simulated CPU devices (`devices=N` more than this machine has: the
arguments' and outputs' bytes are exact, the temporaries are the CPU compiler's, which fuses and schedules unlike a
GPU's or TPU's compiler). The state is donated as on an accelerator, so the new state reuses the old one's memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_transformer.errors import ConfigError
from jax_transformer.model.sharding import BATCH_AXES, MeshShape, total_bytes, tree_shardings, unsplit
from jax_transformer.settings.config import OptimConfig, TransformerConfig
from jax_transformer.training import finetuning
from jax_transformer.training.trainer import abstract_train_state, make_train_step

GiB = 2**30
# The memory of one device as its maker states it (HBM; what a framework can use is a little less).
DEVICE_KINDS = {
    "TPU v5e (16 GiB)": 16 * GiB,
    "TPU v4 (32 GiB)": 32 * GiB,
    "A100 40GB": 40 * GiB,
    "A100 80GB": 80 * GiB,
    "H100 80GB": 80 * GiB,
    "TPU v5p (95 GiB)": 95 * GiB,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """One compiled training step's memory on its most loaded device, in bytes."""

    mesh: MeshShape
    rows: int  # the global batch's rows
    width: int  # tokens per row
    accumulate: int
    parameters: int  # how many the model has
    trained: int  # how many of them the step trains (LoRA adapters, or what --freeze leaves)
    state_total: int  # parameters + optimizer state, all devices together
    arguments: int  # per device: the state's shards and the batch's
    outputs: int  # per device: the new state's shards and the loss sums
    aliased: int  # per device: output bytes written over donated arguments
    temporaries: int  # per device: activations, gradients, collectives' buffers
    unsplit: tuple[str, ...]  # arrays a rule would split that the mesh's axes do not divide

    @property
    def peak(self) -> int:
        """Arguments + outputs not written over arguments + temporaries: what the step needs at once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def fits(self) -> dict[str, int]:
        """{device kind: bytes left (negative: short by)}."""
        return {kind: size - self.peak for kind, size in DEVICE_KINDS.items()}


def plan_step(
    config: TransformerConfig, optim: OptimConfig, mesh: MeshShape, rows: int, width: int, accumulate: int = 1
) -> Plan:
    """Compiles the training step for `mesh` on the devices JAX has (abstract shapes only) and reads its memory."""
    if rows % (mesh.batch_devices * accumulate):
        raise ConfigError(
            f"{rows} rows of a batch do not split over data x fsdp = {mesh.batch_devices} devices x {accumulate} "
            f"micro-batch(es): choose --max-tokens for a multiple of {mesh.batch_devices * accumulate} rows"
        )
    devices = mesh.mesh()
    freeze = optim.freeze
    step = make_train_step(
        config, optim, n_devices=mesh.size, parallel="sharded", accumulate=accumulate, mesh=mesh, donate=True
    )
    abstract = abstract_train_state(config, optim)
    shardings = tree_shardings(abstract, devices, mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
    by_rows = NamedSharding(devices, P(BATCH_AXES))
    batch = {k: jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=by_rows) for k in ("src", "tgt_in", "tgt_out")}
    memory = step.lower(state, batch).compile().memory_analysis()
    return Plan(
        mesh=mesh,
        rows=rows,
        width=width,
        accumulate=accumulate,
        parameters=sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params)),
        trained=sum(math.prod(x.shape) for x in jax.tree.leaves(finetuning.split(abstract.params, config, freeze)[0])),
        state_total=total_bytes(abstract),
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        unsplit=tuple(unsplit(abstract, mesh)),
    )


def rows_for(max_tokens: int, width: int, divisor: int) -> int:
    """A batch of about `max_tokens` target tokens in rows of `width`, rounded down to a multiple of `divisor` (at
    least one multiple)."""
    return max(divisor, (max_tokens // width) // divisor * divisor)


def describe(plan: Plan, config: TransformerConfig, optim: OptimConfig | None = None) -> str:
    """The plan as a reader wants it: the mesh, the per-device figures, and the fit on each device kind, with the
    axis that would make it fit where it does not."""
    lines = [
        f"mesh {plan.mesh} ({plan.mesh.size} devices): {plan.parameters:,} parameters; batch {plan.rows} rows x "
        f"{plan.width} tokens, {plan.accumulate} micro-batch(es); {config.dtype}, remat {config.remat}",
        finetuning.describe(config, (optim or OptimConfig()).freeze),
        f"state (parameters + optimizer moments), all devices: {_size(plan.state_total)}",
        "per device (XLA's memory_analysis of the compiled step):",
        f"  arguments    {_size(plan.arguments):>11}  (the state's shards and the batch's)",
        f"  outputs      {_size(plan.outputs):>11}  ({_size(plan.aliased)} of them over the donated state)",
        f"  temporaries  {_size(plan.temporaries):>11}  (activations, gradients, collectives)",
        f"  peak         {_size(plan.peak):>11}",
    ]
    for item in plan.unsplit:
        lines.append(f"  not split (replicated along that axis): {item}")
    # The part of the peak that more fsdp (or tensor) devices divide: the state's shards and the trained
    # parameters' gradients' (float32, as the parameters); the rest is activations and buffers.
    split = plan.mesh.fsdp * plan.mesh.tensor
    state_part = (plan.state_total + 4 * plan.trained) / split
    lines.append(
        f"  of which about {_size(state_part)} the state's and gradients' shards (1/{split} of them), which "
        f"a larger fsdp divides; the rest, activations, --accumulate and --max-tokens divide"
    )
    lines.append("fits:")
    for kind, left in plan.fits().items():
        if left >= 0:
            lines.append(f"  {kind:<18} yes, {_size(left)} left")
            continue
        size = DEVICE_KINDS[kind]
        need = next((k for k in (2, 4, 8, 16, 32, 64) if plan.peak - state_part * (1 - 1 / k) <= size), None)
        hint = f"; about fsdp x {need} would fit (--mesh fsdp={plan.mesh.fsdp * need})" if need else ""
        lines.append(f"  {kind:<18} no, short by {_size(-left)}{hint}")
    return "\n".join(lines)


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 10 else f"{n / 2**20:.2f} MiB"
