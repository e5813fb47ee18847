"""Quality against wall-clock time of several runs (`plot`)."""

from __future__ import annotations

from jax_transformer.cli import output


def add(sub) -> None:
    pl = sub.add_parser(
        "plot",
        help="validation BLEU and loss of several runs against wall-clock minutes, in one PNG",
        description="Reads each run's metrics.jsonl and draws validation BLEU (left) and loss (right) against "
        "wall-clock minutes (resumed commands' time added up), a star for each run's final evaluation.",
    )
    pl.add_argument("--runs", nargs="+", required=True, metavar="DIR", help="run directories (or metrics.jsonl files)")
    pl.add_argument("--labels", nargs="+", metavar="NAME", help="a legend label per run (default: the paths as given)")
    pl.add_argument("--output", default="quality.png", metavar="FILE", help="the PNG to write (default quality.png)")
    pl.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.errors import DataError
    from jax_transformer.training.curves import plot_runs

    try:
        path, curves = plot_runs(args.runs, args.output, args.labels)
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"plot: {e}") from None
    for curve in curves:
        final = curve.final
        last = f"; final BLEU {final['bleu']:.2f} at {final['minutes']:.1f} min" if final and "bleu" in final else ""
        output.say(f"{curve.label}: {len(curve.minutes)} evaluations{last}")
    output.say(f"wrote {path}")
    return 0
