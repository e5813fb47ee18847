"""The sharded training step on meshes of (data, fsdp, tensor) against single-device jit, and where the state lives.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python -m tests.helpers.mesh_paths

Three steps, dropout on, from the same state and the same global batches of packed rows (parallel_paths.py's,
16 rows), on the meshes (2,4,1), (2,2,2), (1,2,4) and (2,2,2) with 2 micro-batches. Prints one line
"REPORT {json}" in parallel_paths' form (so `parallel_paths.check` judges it: the same tolerances of float summation
order) plus, per mesh, the bytes of the placed state's parameters and Adam moments on the most loaded device against
their total, and the memory plan's figure for the state's arguments (`plan.plan_step`, compiled from abstract
shapes) on (2,2,2) beside the placed arrays' own; then the check's lines.
"""

from __future__ import annotations

import json

import jax
from jax.sharding import PartitionSpec as P

from jax_transformer import sharding, training
from jax_transformer.distributed import DataParallel
from tests.helpers.configs import unit_config
from tests.helpers.parallel_paths import build_report, check, packed_batch
from tests.helpers.twins import flat

STEPS = 3
ROWS = 16  # 2 rows per device on (2,4,1); 8 per (data, fsdp) position on (1,2,4)
PLANNED = "data=2,fsdp=2,tensor=2"  # the mesh whose memory plan is compared with its arrays (a compile of its own)
MESHES = {  # (8,1,1), plain data parallelism, is parallel_paths.py's "sharded"
    "data=2,fsdp=4": ("data=2,fsdp=4", 1),
    "data=2,fsdp=2,tensor=2": ("data=2,fsdp=2,tensor=2", 1),
    "fsdp=2,tensor=4": ("data=1,fsdp=2,tensor=4", 1),
    "data=2,fsdp=2,tensor=2, accumulate 2": ("data=2,fsdp=2,tensor=2", 2),
}


def run(mode: str, accumulate: int, mesh: str | None, config, optim, batches) -> dict:
    devices = DataParallel(mode, accumulate, mesh)
    state = devices.place_state(training.create_train_state(config, optim, seed=0))
    arrays = jax.tree.leaves((state.params, state.opt_state))
    matrices = [x for x in arrays if x.ndim == 2]  # what the rules split over fsdp and tensor both
    placed = {
        "per_device": sharding.bytes_per_device(arrays),
        "total": sharding.total_bytes(arrays),
        "matrices_per_device": sharding.bytes_per_device(matrices),
        "matrices_total": sharding.total_bytes(matrices),
    }
    if mesh == PLANNED and accumulate == 1:  # the plan's arguments, less its batch, against the placed state's bytes
        from jax_transformer.plan import plan_step

        planned = plan_step(config, optim, devices.mesh_shape, ROWS, 16, accumulate)
        batch_bytes = 3 * (ROWS // devices.mesh_shape.batch_devices) * 16 * 4  # src, tgt_in, tgt_out int32
        placed["plan_state_per_device"] = planned.arguments - batch_bytes
        placed["state_per_device"] = sharding.bytes_per_device(jax.tree.leaves(state)) + 8  # + the key's 2 words
    step = devices.make_step(config, optim)
    losses, tokens = [], []
    for batch in batches:
        state, sums = step(state, devices.place_batch(batch))
        sums = jax.device_get(devices.local(sums))
        losses.append(float(sums["loss"]) / float(sums["tokens"]))
        tokens.append(float(sums["tokens"]))
    kept = True  # the step returns the state in the layout it was given (the next step compiles nothing new)
    if devices.mesh_shape is not None:
        wanted = jax.tree.leaves(sharding.tree_specs(state, devices.mesh_shape), is_leaf=lambda x: isinstance(x, P))
        kept = [tuple(x.sharding.spec) for x in jax.tree.leaves(state)] == [tuple(spec) for spec in wanted]
    params = flat(jax.device_get(devices.local(state).params))
    return {"losses": losses, "tokens": tokens, "params": params, "devices": devices, "bytes": placed, "kept": kept}


def main() -> dict:
    jax.config.update("jax_default_matmul_precision", "highest")
    # the tiny preset, vocabulary and positions divisible by 8: every matrix splits on every mesh
    config = unit_config().replace(num_encoder_layers=1, num_decoder_layers=1, src_vocab_size=64, tgt_vocab_size=64)
    optim = training.OptimConfig(warmup_steps=5)
    batches = [packed_batch(config, 10 + i, ROWS) for i in range(STEPS)]
    results = {"jit": run("jit", 1, None, config, optim, batches)}
    for name, (mesh, accumulate) in MESHES.items():
        results[name] = run("sharded", accumulate, mesh, config, optim, batches)
    report = build_report(results, config, optim, batches)
    for name, result in results.items():
        mesh_shape = result["devices"].mesh_shape
        report["paths"][name].update(
            mesh=None if mesh_shape is None else [mesh_shape.data, mesh_shape.fsdp, mesh_shape.tensor],
            bytes=result["bytes"],
            kept_layout=result["kept"],
        )
    return report


def check_meshes(report: dict) -> list[str]:
    """`parallel_paths.check` on every mesh (its tolerances; dropout's effect on this batch's loss, 8e-4 relative,
    is 800 times the loss tolerance, where that check asks for 1e-3 of its own batches), and per mesh: the step
    kept the state's layout, and each device holds exactly 1/(fsdp x tensor) of the matrices' bytes (every matrix
    divides on every mesh here) and the small arrays whole."""
    lines = check(report, dropout_effect=1e-4)
    for name, path in report["paths"].items():
        if path["mesh"] is None:
            continue
        _, fsdp, tensor = path["mesh"]
        b = path["bytes"]
        assert path["kept_layout"], name
        assert b["matrices_per_device"] * fsdp * tensor == b["matrices_total"], (name, b)
        small = b["total"] - b["matrices_total"]
        assert b["per_device"] <= b["matrices_per_device"] + small, (name, b)
        if "plan_state_per_device" in b:  # the plan's figure is the arrays' own
            assert b["plan_state_per_device"] == b["state_per_device"], (name, b)
        lines.append(
            f"{name}: parameters + Adam moments {b['per_device']:,} bytes on the most loaded device of "
            f"{b['total']:,}; matrices {b['matrices_per_device']:,} of {b['matrices_total']:,} (1/{fsdp * tensor})"
        )
    return lines


if __name__ == "__main__":
    report = main()
    print("REPORT " + json.dumps(report))
    print(f"{report['devices']} {report['platform']} device(s), {STEPS} steps, dropout on; each mesh against jit:")
    print("\n".join("  " + line for line in check_meshes(report)))
