"""The memory a training step needs per device (`plan`)."""

from __future__ import annotations

from jax_transformer.cli import flags, output


def add(sub) -> None:
    from jax_transformer.settings.config import PRESETS, REMAT_POLICIES

    pl = sub.add_parser(
        "plan",
        help="the memory a training step needs per device on a mesh, before the run (nothing allocated)",
        description="Compiles the training step ahead of time from abstract shapes on the mesh and prints XLA's "
        "account of its memory per device (arguments, outputs, temporaries) and whether it fits common "
        "accelerators (docs/scaling.md). With --devices: compiled for that many simulated CPU devices (exact "
        "argument and output sizes; the CPU compiler's temporaries); without: for the devices JAX sees.",
    )
    model = pl.add_mutually_exclusive_group()
    model.add_argument("--preset", choices=sorted(PRESETS), help="a preset's shape (default: base)")
    model.add_argument("--init-from", metavar="DIR", help="the model of a run directory (an imported one too)")
    pl.add_argument(
        "--mesh", metavar="AXES", help="data=D,fsdp=F,tensor=T (as train's --mesh; default: all devices on data)"
    )
    pl.add_argument(
        "--devices",
        type=flags.number(int, 1),
        metavar="N",
        help="simulated CPU devices of the mesh (default: the devices JAX sees)",
    )
    pl.add_argument(
        "--max-tokens",
        type=flags.number(int, 1),
        metavar="N",
        default=4096,
        help="target tokens per batch (default: 4096)",
    )
    pl.add_argument(
        "--width",
        type=flags.number(int, 2),
        metavar="N",
        help="tokens per row (default: the model's positions, at most 128)",
    )
    pl.add_argument(
        "--accumulate", type=flags.number(int, 1), metavar="N", default=1, help="micro-batches per step (default: 1)"
    )
    pl.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the model's)")
    pl.add_argument("--remat", choices=REMAT_POLICIES, help="recompute layers in the backward pass (as train's)")
    from jax_transformer.settings.config import LORA_FIELDS, OptimConfig, TransformerConfig

    flags.add_settings(pl, TransformerConfig, "model", "fine-tuning (as train's)", only=(*LORA_FIELDS, "quantize"))
    flags.add_settings(pl, OptimConfig, "optim", "fine-tuning", only=("freeze",))
    pl.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer import compilation

    if args.devices:  # that many simulated CPU devices: set before JAX starts
        compilation.simulate_cpu_devices(args.devices)
    import jax

    from jax_transformer.checkpoint.manager import saved_config
    from jax_transformer.errors import UsageError
    from jax_transformer.model.sharding import MeshShape
    from jax_transformer.settings.config import OptimConfig, preset
    from jax_transformer.settings.resolve import requested_model
    from jax_transformer.training import plan

    if args.devices and jax.device_count() != args.devices:
        raise UsageError(f"--devices {args.devices}: JAX sees {jax.device_count()} (it started before the flag)")
    config = saved_config(args.init_from) if args.init_from else preset(args.preset or "base")
    how = {k: getattr(args, k) for k in ("dtype", "remat") if getattr(args, k)}
    config = requested_model(config, None, {**how, **flags.given(args, "model")})  # how to compute, the LoRA flags
    optim = OptimConfig(**flags.given(args, "optim"))
    n = args.devices or jax.device_count()
    mesh = MeshShape.parse(args.mesh, n)
    width = args.width or min(config.max_len, 128)
    rows = plan.rows_for(args.max_tokens, width, mesh.batch_devices * args.accumulate)
    output.say(plan.describe(plan.plan_step(config, optim, mesh, rows, width, args.accumulate), config, optim))
    return 0
