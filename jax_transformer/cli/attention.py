"""Attention heatmaps of one sentence (`attention`)."""

from __future__ import annotations

from jax_transformer.cli import flags, output


def add(sub) -> None:
    a = sub.add_parser(
        "attention",
        help="draw the attention weights of a checkpoint on one sentence (PNG)",
        description="Translate one sentence greedily and draw every head's attention as heatmaps.",
    )
    flags.checkpoint_flags(a)
    a.add_argument("--sentence", required=True, metavar="TEXT", help="the source sentence")
    a.add_argument("--output", default="attention.png", metavar="FILE", help="the PNG to write (default attention.png)")
    a.add_argument(
        "--kinds",
        nargs="+",
        default=["cross"],
        choices=("cross", "self", "encoder"),
        help="which attention: cross (decoder over the source), self (decoder self-attention), encoder "
        "(encoder self-attention); one grid row per layer, one column per head (default cross)",
    )
    a.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.decoding import attention

    loaded = flags.load(args)
    path = attention.plot_attention(
        loaded.params, loaded.config, loaded.tokenizer, args.sentence, args.output, kinds=args.kinds
    )
    output.say(f"wrote {path} (greedy translation; attention of {', '.join(args.kinds)})")
    return 0
