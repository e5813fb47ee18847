"""A train state laid out over a mesh of devices with three named axes, for models larger than one device
(docs/scaling.md):

- `data`: a batch's rows split over it; the state replicated along it (data parallelism).
- `fsdp`: a batch's rows split over it too, and every large array of the state (parameters, gradients, Adam's
  moments) split along one of its dimensions: each device holds 1/fsdp of it; the compiler gathers a parameter
  before its use and reduce-scatters its gradient (ZeRO-3, "fully sharded data parallel").
- `tensor`: the attention's heads and the feed-forward's hidden units split over it (Megatron's split): each device
  computes its heads and units; the sums over them (the `out` and `linear2` products) become an all-reduce.

The state is given to `jax.jit` as `NamedSharding`s from `RULES`, one table by parameter path; the compiler's
partitioner inserts every collective. Nothing here communicates by hand. The PyTorch twin needs nothing of this:
the numbers are those of one device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import TransformerConfig

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # a batch's rows: every device of a (data, fsdp) position holds its own rows

# Which mesh axis each dimension of an array is split over, by the end of its path ("/"-joined keys): the first rule
# that matches wins. Adam's moments have their parameter's path below `mu` / `nu`, so one table serves both. What
# no rule names (layer norms, the biases added after a sum over heads or units, `logits_bias`, step counters) is
# replicated: small next to the matrices.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(query|key|value)/kernel$", ("fsdp", "tensor")),  # (D, H*K): a head's K columns stay on one device
    (r"(query|key|value)/bias$", ("tensor",)),  # (H*K,)
    (r"out/kernel$", ("tensor", "fsdp")),  # (H*K, D): the sum over heads is over `tensor`
    (r"linear1/kernel$", ("fsdp", "tensor")),  # (D, F): hidden units over `tensor`
    (r"linear1/bias$", ("tensor",)),  # (F,)
    (r"linear2/kernel$", ("tensor", "fsdp")),  # (F, D)
    (r"output_proj/kernel$", ("tensor", "fsdp")),  # (D, V): the vocabulary over `fsdp`
    (r"embedding$", ("fsdp", "tensor")),  # (V, D) token tables, (P, D) learned positions
)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """The sizes of the mesh's axes; their product is the number of devices a run uses."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @classmethod
    def parse(cls, text: str | None, n_devices: int) -> MeshShape:
        """`--mesh` ("data=2,fsdp=2,tensor=2"; an axis left out is 1, except `data`, which takes the devices the
        others leave) for a run on `n_devices` devices; empty: all on `data`. ConfigError naming the axis and sizes
        when the product is not the device count."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in (text or "").split(","))):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in MESH_AXES or not value.strip().isdigit() or int(value) < 1:
                raise ConfigError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {MESH_AXES}")
            if name in sizes:
                raise ConfigError(f"--mesh {text!r}: axis {name!r} given twice")
            sizes[name] = int(value)
        others = sizes.get("fsdp", 1) * sizes.get("tensor", 1)
        if "data" not in sizes:
            if n_devices % others:
                raise ConfigError(
                    f"--mesh {text!r}: fsdp x tensor = {others} does not divide the {n_devices} devices; choose "
                    f"sizes whose product divides {n_devices}"
                )
            sizes["data"] = n_devices // others
        shape = cls(**sizes)
        if shape.size != n_devices:
            raise ConfigError(
                f"--mesh {shape}: data x fsdp x tensor = {shape.size}, but the run has {n_devices} devices; choose "
                f"sizes whose product is {n_devices}"
            )
        return shape

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def batch_devices(self) -> int:
        """The devices a batch's rows are split over: data x fsdp (the `tensor` devices of one position share rows)."""
        return self.data * self.fsdp

    @property
    def shards_state(self) -> bool:
        """Whether the state is split at all (otherwise it is replicated, as plain data parallelism keeps it)."""
        return self.fsdp * self.tensor > 1

    def __str__(self) -> str:
        return ",".join(f"{axis}={getattr(self, axis)}" for axis in MESH_AXES)

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """A `Mesh` over the first `size` devices (`jax.devices()` order: process by process, so a process's devices
        hold neighbouring rows of a batch), shaped (data, fsdp, tensor): `tensor` innermost, the axis whose
        collectives run every layer, on the devices nearest each other."""
        devices = list(jax.devices() if devices is None else devices)
        if self.size > len(devices):
            raise ConfigError(f"--mesh {self} needs {self.size} devices; jax sees {len(devices)}")
        return Mesh(np.array(devices[: self.size]).reshape(self.data, self.fsdp, self.tensor), MESH_AXES)


def check_divisible(config: TransformerConfig, shape: MeshShape) -> None:
    """ConfigError unless the heads and the feed-forward width split evenly over `tensor`."""
    for what, size in (("attention heads (num_heads)", config.num_heads), ("feed-forward width (d_ff)", config.d_ff)):
        if size % shape.tensor:
            raise ConfigError(
                f"--mesh {shape}: the model's {size} {what} do not split over tensor={shape.tensor}; choose a tensor "
                f"size that divides {size} (and {config.num_heads if size == config.d_ff else config.d_ff})"
            )


def spec_for(path: str, shape: tuple[int, ...], mesh_shape: MeshShape) -> P:
    """The PartitionSpec of the array at `path` (keys joined by "/") of `shape`: its rule's axes, less the axes of
    size 1 and those that do not divide their dimension (NLLB's 256,206-entry vocabulary over fsdp=4): the array
    stays whole along such an axis. (Splitting the table's width over fsdp instead, as the batch is, makes every
    device compute its own copy of the whole batch's logits: measured, docs/scaling.md.)"""
    axes = _rule(path, shape)
    if axes is None:
        return P()
    sizes = dataclasses.asdict(mesh_shape)
    return P(*(a if a and sizes[a] > 1 and n % sizes[a] == 0 else None for a, n in zip(axes, shape)))


def _rule(path: str, shape: tuple[int, ...]) -> tuple[str | None, ...] | None:
    for pattern, axes in RULES:
        if re.search(pattern, path) and len(axes) == len(shape):
            return axes
    return None


def path_name(path) -> str:
    """A pytree path as "/"-joined keys: params/encoder/layer_0/self_attention/query/kernel."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def tree_specs(tree, mesh_shape: MeshShape):
    """The PartitionSpec of every array of `tree` (a train state, its parameters, their abstract shapes)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: spec_for(path_name(path), np.shape(x), mesh_shape), tree)


def tree_shardings(tree, mesh: Mesh, mesh_shape: MeshShape):
    """`tree_specs` as NamedShardings on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh_shape), is_leaf=_is_spec)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def unsplit(tree, mesh_shape: MeshShape) -> list[str]:
    """The arrays that stay whole along a mesh axis their rule names, the axis not dividing that dimension:
    "path (shape): dimension d of n whole along axis=k". The memory plan lists them."""
    out = []
    sizes = dataclasses.asdict(mesh_shape)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name, shape = path_name(path), tuple(np.shape(leaf))
        spec = spec_for(name, shape, mesh_shape)
        for d, axis in enumerate(_rule(name, shape) or ()):
            if axis and sizes[axis] > 1 and spec[d] is None:
                out.append(f"{name} {shape}: dimension {d} of {shape[d]} whole along {axis}={sizes[axis]}")
    return out


def bytes_per_device(tree) -> int:
    """The bytes of `tree`'s arrays of numbers on its most loaded device, read from the arrays' addressable
    shards."""
    per_device: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue  # (as `total_bytes` counts)
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def total_bytes(tree) -> int:
    """The bytes of `tree`'s arrays of numbers (arrays or their abstract shapes), each counted once."""
    leaves = [x for x in jax.tree.leaves(tree) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)


def placement(mesh: str):
    """Where each array of a state goes on a mesh of every device (`--mesh data=D,fsdp=F,tensor=T`), as training
    splits it: a `checkpoint.Placement` (name, shape) -> NamedSharding, for a restore that reads each array
    straight onto the mesh, each process only its own shards."""
    import jax
    from jax.sharding import NamedSharding

    mesh_shape = MeshShape.parse(mesh, jax.device_count())
    devices = mesh_shape.mesh()
    return lambda name, shape: NamedSharding(devices, spec_for(name, shape, mesh_shape))
