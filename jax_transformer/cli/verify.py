"""A trained checkpoint against its PyTorch twin (`verify`)."""

from __future__ import annotations

import json
import sys

from jax_transformer.cli import flags, output

EXIT_NOT_VERIFIED = 4  # the frameworks differ by more than --logit-tolerance


def add(sub) -> None:
    v = sub.add_parser(
        "verify",
        help="cross-framework check of a trained checkpoint against its PyTorch twin on the validation set",
        description="Exports the checkpoint to the PyTorch twin (as `export` does), runs both on the validation "
        "set and prints the largest logit difference under teacher forcing, the share of sentences decoded to "
        "identical tokens (greedy and beam) and each framework's BLEU. Exit code 4 when the logits differ by "
        "more than --logit-tolerance.",
    )
    flags.checkpoint_flags(v, compute=True)
    flags.language_flags(v)
    flags.evaluation_data_flags(v)
    flags.decoding_flags(v, more=("progress",), only=("beam_size", "alpha"))
    v.add_argument(
        "--sentences",
        type=flags.number(int, 1),
        metavar="N",
        help="verify on the first N sentence pairs only (default all)",
    )
    v.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help="torch device of the PyTorch twin, e.g. cpu or cuda (default cpu); JAX uses its default backend",
    )
    v.add_argument(
        "--batch-size",
        type=flags.number(int, 1),
        default=32,
        metavar="N",
        help="sentences per decoding batch (default 32)",
    )
    v.add_argument(
        "--logit-tolerance",
        type=flags.number(float, 0),
        default=1e-4,
        metavar="X",
        help="largest |logit difference| accepted (default 1e-4: float32 in both frameworks differs by summation "
        "order only, ~1e-6 on logits of size ~10; a wrong weight moves logits by 1e-2 or more)",
    )
    v.add_argument(
        "--torch-threads",
        type=flags.number(int, 1),
        default=1,
        metavar="N",
        help="CPU threads of the PyTorch twin (default 1: its reference decoding works one sentence at a time on "
        "small matrices, where more threads mostly wait for each other)",
    )
    v.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    v.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.decoding import loading
    from jax_transformer.errors import UsageError
    from jax_transformer.interop.verify import verify

    if args.device != "cpu":
        import torch

        try:
            torch.empty(1, device=args.device)
        except (RuntimeError, AssertionError) as e:
            raise UsageError(f"--device {args.device}: not usable here ({e})") from None
    import torch

    # One thread by default: under load, torch's threads fight XLA's for the cores (docs/internals.md#verify).
    torch.set_num_threads(args.torch_threads)
    loaded = flags.load(args, quantize_weights=False)
    decode = loading.decoding(loaded, flags.given(args, "decode"))  # its beam width and alpha, by this project's rules
    valid = flags.evaluation_data(args, loaded, limit=args.sentences)
    report = verify(
        loaded,
        valid.batches,
        valid.sources,
        valid.references,
        decode,
        batch_size=args.batch_size,
        device=args.device,
        progress=flags.given(args, "loop").get("progress", True),
        print_fn=lambda line: print(line, file=sys.stderr),
    )
    output.say(report.table())
    if args.json:
        from jax_transformer import files

        files.write_text(args.json, json.dumps(report.to_dict(), indent=1) + "\n")
    if not report.logit_max_abs_diff <= args.logit_tolerance:
        print(
            f"error: the frameworks differ: largest logit difference {report.logit_max_abs_diff:.3e} > "
            f"--logit-tolerance {args.logit_tolerance:g}",
            file=sys.stderr,
        )
        return EXIT_NOT_VERIFIED
    output.say(f"verified: logits agree within {args.logit_tolerance:g}")
    return 0
