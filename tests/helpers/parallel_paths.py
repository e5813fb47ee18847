"""Every way of running a training step on the devices this process sees, against single-device jit.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.helpers.parallel_paths   # 4 CPU devices
    python -m tests.helpers.parallel_paths                                                      # an accelerator

Five steps, dropout on, from the same state and the same global batches of packed rows (two sentence pairs per
row, `trainer.PACKING_KEYS`; rows of unequal token counts; tests/test_scale.py runs unpacked batches through
train.py), of:
jit on one device (the reference); pmap over all local devices; sharded jit over a mesh of all devices;
sharded jit and pmap with 2 micro-batches (`accumulate`); jit with 4 micro-batches. With a single device (one GPU) pmap
and sharded jit run on that one device. Prints one line "REPORT {json}": for each path its per-step losses and
token counts, the largest parameter differences from jit, and how far each tensor moved; then `check`'s lines
(the largest difference per path) and "all paths equal jit", or the first difference beyond tolerance (exit 1).
tests/test_training.py runs this with 4 simulated CPU devices; on a GPU run it by hand (about a minute, most of it
compilation).
"""

from __future__ import annotations

import json

import jax
import numpy as np

from jax_transformer.training import trainer
from jax_transformer.training.distributed import DataParallel
from tests.helpers.batches import make_batch
from tests.helpers.configs import unit_config
from tests.helpers.twins import flat

STEPS = 5
ROWS = 8  # global batch rows: 2 per device on 4 devices, 4 micro-batches of 2 rows on one
WIDTH = 16  # two pairs of at most 8 tokens a side per row


def packed_batch(config, seed: int, rows: int = ROWS) -> dict[str, np.ndarray]:
    """Two random pairs per row (make_batch's "noise" layout, 8 tokens wide), side by side: segment ids 1 and 2,
    positions restarting at 0 for the second pair, padding after both."""
    keys = ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions", "tgt_positions")
    batch = {key: np.zeros((rows, WIDTH), np.int32) for key in keys}
    parts = [make_batch(config, seed + k, rows, 8, 8, layout="noise", padding_row=False) for k in (0, 1000)]
    for r in range(rows):
        at = {"src": 0, "tgt": 0}
        for segment, part in enumerate(parts, start=1):
            for side, keys_of_side in (("src", ("src",)), ("tgt", ("tgt_in", "tgt_out"))):
                n = int(np.count_nonzero(part[keys_of_side[0]][r]))  # tgt_in's span; tgt_out is tgt_in shifted
                span = slice(at[side], at[side] + n)
                for key in keys_of_side:
                    batch[key][r, span] = part[key][r, :n]
                batch[f"{side}_segments"][r, span] = segment
                batch[f"{side}_positions"][r, span] = np.arange(n)
                at[side] += n
    return batch


def run_path(mode: str, accumulate: int, config, optim, batches) -> dict:
    """`STEPS` steps of one path from the seed-0 state; the losses, token counts and final parameters."""
    devices = DataParallel(mode, accumulate)
    state = devices.place_state(trainer.create_train_state(config, optim, seed=0))
    step = devices.make_step(config, optim)
    losses, tokens = [], []
    for batch in batches:
        state, sums = step(state, devices.place_batch(batch))
        sums = jax.device_get(devices.local(sums))
        losses.append(float(sums["loss"]) / float(sums["tokens"]))
        tokens.append(float(sums["tokens"]))
    return {"losses": losses, "tokens": tokens, "params": flat(devices.local(state).params), "devices": devices}


def main() -> dict:
    jax.config.update("jax_default_matmul_precision", "highest")
    config = unit_config().replace(num_encoder_layers=1, num_decoder_layers=1)  # depth changes nothing here
    optim = trainer.OptimConfig(warmup_steps=5)
    batches = [packed_batch(config, 10 + i) for i in range(STEPS)]
    paths = {"jit": ("jit", 1), "pmap": ("pmap", 1), "sharded": ("sharded", 1), "sharded, accumulate 2": ("sharded", 2)}
    paths.update({"pmap, accumulate 2": ("pmap", 2), "jit, accumulate 4": ("jit", 4)})
    results = {name: run_path(mode, k, config, optim, batches) for name, (mode, k) in paths.items()}
    return build_report(results, config, optim, batches)


def build_report(results: dict, config, optim, batches) -> dict:
    """What `check` reads, from each path's `run_path` result ("jit" the reference): per path its losses, token
    counts and parameter differences from jit; the loss with dropout off; the parts' token counts."""
    start = flat(trainer.create_train_state(config, optim, seed=0).params)
    # Without dropout the loss differs: dropout really is on in the steps above.
    _, sums = DataParallel("jit", 1).make_step(config, optim, dropout=False)(
        trainer.create_train_state(config, optim, seed=0), batches[0]
    )
    reference = results["jit"]
    report = {
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "dropout_off_first_loss": float(sums["loss"]) / float(sums["tokens"]),
        # target tokens in each quarter of a batch's rows: a device's block on 4 devices, a micro-batch of
        # "jit, accumulate 4". Unequal, so averaging per-device or per-micro-batch means would change the update.
        "quarter_tokens": [[int((block != 0).sum()) for block in np.split(b["tgt_out"], 4)] for b in batches],
        "moved": {k: float(np.max(np.abs(reference["params"][k] - start[k]))) for k in start},
        "paths": {},
    }
    for name, result in results.items():
        diff = {k: float(np.max(np.abs(result["params"][k] - reference["params"][k]))) for k in start}
        relative = {
            k: float(
                np.linalg.norm(result["params"][k] - reference["params"][k])
                / max(np.linalg.norm(reference["params"][k] - start[k]), 1e-30)
            )
            for k in start
        }
        report["paths"][name] = {
            "mode": result["devices"].mode,
            "n_devices": result["devices"].n_devices,
            "losses": result["losses"],
            "tokens": result["tokens"],
            "max_abs": diff,
            "relative": relative,
        }
    return report


def check(report: dict, dropout_effect: float = 1e-3) -> list[str]:
    """Asserts that every path took the steps of jit; returns one line per path with its largest differences.

    Tolerances come from float summation order. Losses: relative 1e-6 (a path adds the same per-token terms in
    another order, partial sums per device or micro-batch; reassociating float32 sums moves them by a few ulp,
    ~1e-7 relative). The loss also proves that the dropout masks are the same: one element masked differently out
    of the ~2,600 of one dropout site moves the loss by ~1e-4 relative, and without dropout it differs by ~1%.
    Parameters: per tensor, ||path - jit|| <= 1e-4 of how far the tensor moved in 5 steps. Gradients differ by
    reassociation noise only, but Adam divides each gradient element by its own RMS, so an element whose gradient
    is itself at noise level (cancellation: seen in a run on unpacked batches, an embedding element with gradient
    ~4e-8 against ~1e-3 typical) steps differently by up to ~lr; the tensor norm averages such elements out. The
    key biases, whose gradient is zero analytically (softmax is invariant to them), are noise only and are left
    out.
    A per-device or per-micro-batch *mean* instead of one division by the global token count would weight the
    parts' tokens unequally (the report shows the parts hold different token counts) and change every update.
    """
    paths = report["paths"]
    reference = paths["jit"]["losses"]
    assert all(len(set(counts)) > 1 for counts in report["quarter_tokens"])  # the parts' token counts differ
    assert abs(report["dropout_off_first_loss"] / reference[0] - 1) > dropout_effect  # dropout really is on
    assert min(report["moved"].values()) > 1e-4  # the steps really changed every tensor
    lines = []
    for name, path in paths.items():
        assert path["tokens"] == paths["jit"]["tokens"], name  # every path divides by the global token count
        loss_rel = max(abs(a / b - 1) for a, b in zip(path["losses"], reference))
        relative = {k: v for k, v in path["relative"].items() if "'key']['bias'" not in k}
        worst = max(relative, key=relative.get)
        max_abs = max(v for k, v in path["max_abs"].items() if "'key']['bias'" not in k)
        lines.append(
            f"{name} ({path['mode']}, {path['n_devices']} device(s)): losses {loss_rel:.1e} relative, worst tensor "
            f"{worst} {relative[worst]:.1e} of its movement, max abs {max_abs:.1e}"
        )
        assert loss_rel <= 1e-6, lines[-1]
        assert relative[worst] <= 1e-4, lines[-1]
    return lines


if __name__ == "__main__":
    report = main()
    print("REPORT " + json.dumps(report))
    print(f"{report['devices']} {report['platform']} device(s), 5 steps, dropout on; each path against jit:")
    print("\n".join("  " + line for line in check(report)))
    print("all paths equal jit within the tolerances of float summation order")
