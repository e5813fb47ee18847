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
import tempfile

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_transformer.model import sharding
from jax_transformer.training import trainer
from jax_transformer.training.distributed import DataParallel
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
    state = devices.place_state(trainer.create_train_state(config, optim, seed=0))
    arrays = jax.tree.leaves((state.params, state.opt_state))
    matrices = [x for x in arrays if x.ndim == 2]  # what the rules split over fsdp and tensor both
    placed = {
        "per_device": sharding.bytes_per_device(arrays),
        "total": sharding.total_bytes(arrays),
        "matrices_per_device": sharding.bytes_per_device(matrices),
        "matrices_total": sharding.total_bytes(matrices),
    }
    if mesh == PLANNED and accumulate == 1:  # the plan's arguments, less its batch, against the placed state's bytes
        from jax_transformer.training.plan import plan_step

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
    return {
        "losses": losses,
        "tokens": tokens,
        "params": params,
        "devices": devices,
        "bytes": placed,
        "kept": kept,
        "state": state,
    }


def checkpoint_across_meshes(state, config, optim, directory: str) -> dict:
    """The (2,2,2) state after its steps saved as it lies (each array written shard by shard), then read onto
    (8,1,1), (1,2,4) and the host: whether each read is the gathered state bit for bit, whether the arrays came
    back in the layout asked for, and whether the checksums computed from the split arrays are those of the
    gathered ones (they verify every read)."""
    from jax_transformer.checkpoint import manager as ckpt_lib
    from jax_transformer.data.tokenizer import Tokenizer

    saved = trainer.state_for_saving(state)
    whole = {key: np.asarray(value) for key, value in flat(jax.device_get(saved)).items()}
    tokenizer = Tokenizer.train([f"w{i} v{i % 7}" for i in range(200)], 30, model_type="bpe")
    manager = ckpt_lib.CheckpointManager(directory, async_save=False)
    manager.save(3, saved, config=config, optim=optim.to_dict(), tokenizer=tokenizer)
    manager.close()
    out = {
        "split_arrays_saved": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(saved)),
        "sums_equal": ckpt_lib.array_sums(saved) == ckpt_lib.array_sums(jax.device_get(saved)),
    }
    for mesh in ("data=8", "fsdp=2,tensor=4", None):
        placement = None if mesh is None else DataParallel("sharded", 1, mesh).placement
        restored = ckpt_lib.load(directory, 3, placement=placement)
        arrays = flat(restored.state)
        same = arrays.keys() == whole.keys() and all(
            np.array_equal(np.asarray(jax.device_get(arrays[key])), whole[key]) for key in whole
        )
        leaves = jax.tree_util.tree_flatten_with_path(restored.state)[0]
        laid_out = placement is None or all(
            value.sharding.is_equivalent_to(placement(sharding.path_name(path), value.shape), value.ndim)
            for path, value in leaves
        )
        out[mesh or "host"] = {"equal": bool(same), "laid_out": bool(laid_out), "verified": restored.verified}
    return out


DECODE_MESH = "fsdp=2,tensor=4"  # the weights split 8 ways, the way a model too large for one device would be


def decoding_on_a_mesh() -> dict:
    """The trained tiny model (tests/data, so the claim holds on every CPU) on one device and with its weights split
    over DECODE_MESH: greedy and beam-4 tokens of 32 of its validation sources, one batch, compared whole."""
    from jax_transformer.decoding import decoders
    from jax_transformer.decoding.schedule import Whole
    from tests.helpers.saved import load_saved_model

    saved = load_saved_model("trained_tiny")
    placement = DataParallel("sharded", 1, DECODE_MESH).placement
    split = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, placement("params/" + sharding.path_name(path), x.shape)), saved.params
    )
    src = saved.sources[:32]
    out = {"split_arrays": sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(split))}
    for beam in (1, 4):
        one, mesh = (
            np.asarray(
                decoders.greedy_search(params, saved.config, src, schedule=Whole())[0]
                if beam == 1
                else decoders.beam_search(params, saved.config, src, beam_size=beam, schedule=Whole())[0]
            )
            for params in (decoders.on_device(saved.params), split)
        )
        out[f"beam {beam}"] = {"sentences": len(src), "equal": int((one == mesh).all(axis=1).sum())}
    return out


def translate_cli_on_a_mesh(directory: str) -> bool:
    """`train.py translate --mesh` on the checkpoint saved split: the same lines as on one device."""
    from tests.helpers.training import run_main

    source = f"{directory}/source.txt"
    with open(source, "w", encoding="utf-8") as f:
        f.write("".join(f"w{i} v{i % 7}\n" for i in range(0, 60, 7)))
    outputs = []
    for extra in ([], ["--mesh", DECODE_MESH]):
        code, out, err = run_main(["translate", "--checkpoint", directory, "--step", "3", "--input", source, *extra])
        assert code == 0, err
        outputs.append(out)
    return outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 9


def main() -> dict:
    jax.config.update("jax_default_matmul_precision", "highest")
    # the tiny preset, vocabulary and positions divisible by 8: every matrix splits on every mesh
    config = unit_config().replace(num_encoder_layers=1, num_decoder_layers=1, src_vocab_size=64, tgt_vocab_size=64)
    optim = trainer.OptimConfig(warmup_steps=5)
    batches = [packed_batch(config, 10 + i, ROWS) for i in range(STEPS)]
    results = {"jit": run("jit", 1, None, config, optim, batches)}
    for name, (mesh, accumulate) in MESHES.items():
        results[name] = run("sharded", accumulate, mesh, config, optim, batches)
    with tempfile.TemporaryDirectory() as directory:
        across = checkpoint_across_meshes(results[PLANNED]["state"], config, optim, directory)
        across["translate_cli_equal"] = translate_cli_on_a_mesh(directory)
    report = build_report(results, config, optim, batches)
    report["checkpoint"] = across
    report["decoding"] = decoding_on_a_mesh()
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
    across, decoded = report["checkpoint"], report["decoding"]
    assert across["split_arrays_saved"] > 0 and across["sums_equal"] and across["translate_cli_equal"], across
    assert decoded["split_arrays"] > 0, decoded
    for beam in ("beam 1", "beam 4"):
        assert decoded[beam]["equal"] == decoded[beam]["sentences"] > 0, decoded
    lines.append(
        f"trained tiny model, weights split over {DECODE_MESH}: greedy {decoded['beam 1']['equal']}/"
        f"{decoded['beam 1']['sentences']} and beam-4 {decoded['beam 4']['equal']}/{decoded['beam 4']['sentences']}"
        f" sentences' tokens as on one device; `translate --mesh` the same lines"
    )
    for where in ("data=8", "fsdp=2,tensor=4", "host"):
        assert across[where] == {"equal": True, "laid_out": True, "verified": True}, (where, across)
    lines.append(
        f"checkpoint saved on (2,2,2) ({across['split_arrays_saved']} arrays written split), read onto (8,1,1), "
        f"(1,2,4) and the host: bit for bit, laid out as asked, verified; checksums of the split arrays = gathered"
    )
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
