"""The mean of a run's last checkpoints (`average`)."""

from __future__ import annotations

from jax_transformer.cli import flags, output


def add(sub) -> None:
    av = sub.add_parser(
        "average",
        help="average the parameters of a run's last K checkpoints into a new checkpoint",
        description="The mean of the last K saved checkpoints' parameters (fairseq's average_checkpoints), "
        "written as a run-like directory that evaluate, translate, export, attention and verify read. The "
        "optimiser state is not averaged nor kept (translation does not need it), so the output cannot be "
        "resumed. A run keeps its last --keep checkpoints: train with --keep K or more to average K.",
    )
    av.add_argument("--checkpoint", required=True, metavar="DIR", help="the run directory whose checkpoints to average")
    av.add_argument(
        "--last", required=True, type=flags.number(int, 1), metavar="K", help="how many of the newest saved steps"
    )
    av.add_argument("--output", required=True, metavar="DIR", help="the new directory to write (must not exist)")
    av.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.checkpoint.averaging import average_checkpoints
    from jax_transformer.errors import UsageError

    try:
        written, step, steps = average_checkpoints(args.checkpoint, args.last, args.output, print_fn=output.say)
    except ValueError as e:
        raise UsageError(str(e)) from None
    output.say(
        f"wrote {written}: the mean of the parameters of steps {steps} (no optimiser state: for evaluate, translate, "
        f"export, attention and verify, not for --resume), saved as step {step}"
    )
    return 0
