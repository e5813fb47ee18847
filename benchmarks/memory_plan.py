#!/usr/bin/env python3
"""The memory plan (`train.py plan`: the training step compiled from abstract shapes, XLA's memory_analysis per
device) of real models' shapes on 8, 16 and 64 devices under a few meshes: docs/scaling.md's table. Each device
count runs in a child process with that many simulated CPU devices (nothing is allocated; the arguments' and
outputs' bytes are exact, the temporaries the CPU compiler's).

    python benchmarks/memory_plan.py                               # the whole table (minutes: compiling)
    python benchmarks/memory_plan.py --models nllb-600m --devices 8
    python benchmarks/memory_plan.py --remat-cost base --max-tokens 4096   # --remat: step time and memory, 1 device
    python benchmarks/memory_plan.py --fine-tuning --models nllb-600m,nllb-1.3b,nllb-3.3b --max-tokens 2048

--remat-cost: the training step of a preset on this machine's first device with each remat policy: its
temporaries (memory_analysis) and the median and best of --repeats timed steps (after one untimed), the policies
interleaved within each repeat.

--fine-tuning: one device, each model fine-tuned in full, with LoRA (rank 16 on every matrix) and with QLoRA (the
same adapters on an int8 base), and which device sizes each fits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The released models' shapes (config.json): one table for source, target and output, pre-norm (M2M-100 / NLLB),
# or post-norm (Marian). Positions: the batches' width (128 tokens a row) is what the step sees.
SHAPES = {
    "opus-mt-base": dict(d_model=512, num_heads=8, d_ff=2048, layers=6, vocab=58101, norm_first=False),
    "nllb-600m": dict(d_model=1024, num_heads=16, d_ff=4096, layers=12, vocab=256206, norm_first=True),
    "nllb-1.3b": dict(d_model=1024, num_heads=16, d_ff=8192, layers=24, vocab=256206, norm_first=True),
    "nllb-3.3b": dict(d_model=2048, num_heads=16, d_ff=8192, layers=24, vocab=256206, norm_first=True),
}
MESHES = {  # device count -> meshes
    8: ("data=8", "fsdp=8", "fsdp=4,tensor=2"),
    16: ("fsdp=16", "fsdp=8,tensor=2"),
    64: ("fsdp=64", "data=8,fsdp=8", "data=4,fsdp=8,tensor=2"),
}


def config_of(name: str):
    from jax_transformer.settings.config import TransformerConfig

    s = SHAPES[name]
    return TransformerConfig(
        d_model=s["d_model"],
        num_heads=s["num_heads"],
        d_ff=s["d_ff"],
        num_encoder_layers=s["layers"],
        num_decoder_layers=s["layers"],
        src_vocab_size=s["vocab"],
        tgt_vocab_size=s["vocab"],
        share_embeddings=True,
        norm_first=s["norm_first"],
        final_norm=s["norm_first"],
        max_len=1024,
    )


def child(models: list[str], meshes: list[str], max_tokens: int, width: int) -> list[dict]:
    """In a process with the devices: one plan per (model, mesh)."""
    import jax

    from jax_transformer.model.sharding import MeshShape
    from jax_transformer.settings.config import OptimConfig
    from jax_transformer.training import plan

    rows = []
    for model in models:
        config = config_of(model)
        for text in meshes:
            mesh = MeshShape.parse(text, jax.device_count())
            n_rows = plan.rows_for(max_tokens, width, mesh.batch_devices)
            p = plan.plan_step(config, OptimConfig(), mesh, n_rows, width)
            rows.append(
                dict(
                    model=model,
                    devices=mesh.size,
                    mesh=str(mesh),
                    rows=n_rows,
                    width=width,
                    state_gib=p.state_total / plan.GiB,
                    arguments_gib=p.arguments / plan.GiB,
                    temporaries_gib=p.temporaries / plan.GiB,
                    peak_gib=p.peak / plan.GiB,
                    unsplit=list(p.unsplit),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


# The fine-tuning modes of --fine-tuning: TransformerConfig fields over the model's.
MODES = {
    "full": {},
    "LoRA r16": dict(lora_rank=16, lora_alpha=32.0, lora_targets="q,k,v,out,ffn"),
    "QLoRA r16": dict(lora_rank=16, lora_alpha=32.0, lora_targets="q,k,v,out,ffn", quantize="int8-weights"),
}
DEVICE_SIZES = (16, 24, 40, 80)  # GB, as accelerators are sold (10^9 bytes)


def fine_tuning(models: list[str], max_tokens: int, width: int, dtype: str, remat: str) -> list[dict]:
    """The memory plan of each model in each of MODES on one device (this machine's first)."""
    from jax_transformer.model.sharding import MeshShape
    from jax_transformer.settings.config import OptimConfig
    from jax_transformer.training import plan

    rows = []
    for model in models:
        for mode, fields in MODES.items():
            config = config_of(model).replace(dtype=dtype, remat=remat, **fields)
            p = plan.plan_step(config, OptimConfig(), MeshShape(), max_tokens // width, width)
            rows.append(
                dict(
                    model=model,
                    mode=mode,
                    parameters=p.parameters,
                    trained=p.trained,
                    state_gib=p.state_total / plan.GiB,
                    temporaries_gib=p.temporaries / plan.GiB,
                    peak_gib=p.peak / plan.GiB,
                    fits=[gb for gb in DEVICE_SIZES if p.peak <= gb * 1e9],
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def remat_cost(name: str, max_tokens: int, width: int, repeats: int) -> list[dict]:
    """Temporaries and step time of `name`'s training step with each remat policy, on one device."""
    import statistics
    import time

    import jax
    import numpy as np

    from jax_transformer.model.sharding import MeshShape
    from jax_transformer.settings.config import REMAT_POLICIES, OptimConfig, preset
    from jax_transformer.training import plan, trainer

    optim, rows = OptimConfig(), max_tokens // width
    rng = np.random.default_rng(0)
    runs = {}
    for remat in REMAT_POLICIES:
        config = preset(name, remat=remat)
        memory = plan.plan_step(config, optim, MeshShape(), rows, width)
        batch = {k: rng.integers(4, config.tgt_vocab_size, (rows, width), dtype=np.int32) for k in ("src", "tgt_in")}
        batch["tgt_out"] = batch["tgt_in"]
        step = trainer.make_train_step(config, optim)
        state = trainer.create_train_state(config, optim, seed=0)
        state, _ = step(state, batch)  # compiles
        runs[remat] = dict(step=step, state=state, batch=batch, memory=memory, seconds=[])
    for _ in range(repeats):
        for run in runs.values():
            began = time.perf_counter()
            run["state"], sums = run["step"](run["state"], run["batch"])
            jax.block_until_ready(sums)
            run["seconds"].append(time.perf_counter() - began)
    out = []
    for remat, run in runs.items():
        out.append(
            dict(
                remat=remat,
                temporaries_gib=run["memory"].temporaries / plan.GiB,
                peak_gib=run["memory"].peak / plan.GiB,
                step_s_median=statistics.median(run["seconds"]),
                step_s_best=min(run["seconds"]),
            )
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of {','.join(SHAPES)}")
    parser.add_argument("--devices", default="8,16,64", help="comma-separated device counts (default: 8,16,64)")
    parser.add_argument("--max-tokens", type=int, default=8192, help="target tokens per global batch (default: 8192)")
    parser.add_argument("--width", type=int, default=128, help="tokens per row (default: 128)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--remat-cost", metavar="PRESET", help="time and memory of --remat's policies instead")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per policy with --remat-cost")
    parser.add_argument("--fine-tuning", action="store_true", help="full, LoRA and QLoRA on one device instead")
    parser.add_argument("--dtype", default="float32", help="compute dtype with --fine-tuning (default float32)")
    parser.add_argument("--remat", default="none", help="remat policy with --fine-tuning (default none)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if args.remat_cost:
        from benchmarks.machine import machine_info

        info = machine_info()
        print(f"machine: {info['cpu_model']}, {info['cores']} cores; {info['libraries']}", flush=True)
        rows = remat_cost(args.remat_cost, args.max_tokens, args.width, args.repeats)
        none = next(r for r in rows if r["remat"] == "none")
        print(f"\n{args.remat_cost}, {args.max_tokens} token slots in rows of {args.width}, one device, float32\n")
        print("| remat | temporaries | peak | step, median | best | time / none |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['remat']} | {r['temporaries_gib']:.2f} GiB | {r['peak_gib']:.2f} GiB | "
                f"{r['step_s_median']:.3f} s | {r['step_s_best']:.3f} s | "
                f"{r['step_s_median'] / none['step_s_median']:.2f} |"
            )
        return 0
    if args.fine_tuning:
        from benchmarks.machine import machine_info

        info = machine_info()
        print(f"machine: {info['cpu_model']}, {info['cores']} cores; {info['libraries']}", flush=True)
        rows = fine_tuning(models, args.max_tokens, args.width, args.dtype, args.remat)
        shape = f"{args.max_tokens} token slots in rows of {args.width}, {args.dtype}, remat {args.remat}"
        print(f"\none device, {shape}\n")
        print("| model | mode | trained parameters | state | temporaries | peak | fits (GB) |")
        print("|---|---|---:|---:|---:|---:|---|")
        for r in rows:
            fits = ", ".join(map(str, r["fits"])) or "none of " + "/".join(map(str, DEVICE_SIZES))
            print(
                f"| {r['model']} | {r['mode']} | {r['trained']:,} of {r['parameters']:,} | {r['state_gib']:.2f} GiB | "
                f"{r['temporaries_gib']:.2f} GiB | {r['peak_gib']:.2f} GiB | {fits} |"
            )
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
        return 0
    if args.child:
        child(models, args.child.split(";"), args.max_tokens, args.width)
        return 0
    from benchmarks.machine import machine_info

    info = machine_info()
    print(f"machine: {info['cpu_model']}, {info['cores']} cores; {info['libraries']}", flush=True)
    rows = []
    for n in map(int, args.devices.split(",")):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
        command = [sys.executable, __file__, "--models", args.models, "--child", ";".join(MESHES[n])]
        command += ["--max-tokens", str(args.max_tokens), "--width", str(args.width)]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"\n{args.max_tokens} target tokens per global batch, rows of {args.width}; float32, Adam, state donated\n")
    print("| model | devices | mesh | state, all devices | per device: arguments | temporaries | peak |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['devices']} | {r['mesh']} | {r['state_gib']:.2f} GiB | {r['arguments_gib']:.2f} GiB"
            f" | {r['temporaries_gib']:.2f} GiB | {r['peak_gib']:.2f} GiB |"
        )
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
