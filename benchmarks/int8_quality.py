#!/usr/bin/env python3
"""What int8 decoding costs in quality: a trained run's checkpoint decoded in float32 and with its weights quantized
at load (jax_transformer.model.quantization), on the run's validation data (or --src/--tgt).

    python benchmarks/int8_quality.py --run runs/m30k                      # greedy and beam 4, both int8 modes
    python benchmarks/int8_quality.py --run runs/m30k --sentences 200 --beams 1 --modes int8-dynamic

Per decoding (greedy, beam K) and quantization mode: sacreBLEU and chrF of the float32 and the int8 translations
against the references, the share of sentences whose int8 translation is the float32 one, letter for letter, and,
over the teacher-forced validation batches, the largest |logit difference| between the two models (beside the
largest |logit|, for scale). Needs the `quantize` extra (qwix).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/int8_quality.py` puts benchmarks/ first on the path
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402

MODES = ("int8-dynamic", "int8-weights")


def largest_logit_difference(params, config, qparams, qconfig, batches) -> tuple[float, float]:
    """(largest |float32 - int8| logit, largest |float32 logit|) over the real target positions of `batches`."""
    from jax_transformer.interop.verify import flax_logits_fn

    exact, quantized = flax_logits_fn(config), flax_logits_fn(qconfig)
    diff = largest = 0.0
    for batch in batches:
        real = batch["tgt_out"] != config.pad_id  # (B, T)
        a = np.asarray(exact(params, batch["src"], batch["tgt_in"]))  # (B, T, V)
        b = np.asarray(quantized(qparams, batch["src"], batch["tgt_in"]))
        diff = max(diff, float(np.max(np.abs(a - b)[real])))
        largest = max(largest, float(np.max(np.abs(a[real]))))
    return diff, largest


def measure(run: Path, step: str, sources, references, batches, beams: Sequence[int], modes: Sequence[str], log=print):
    import jax

    from jax_transformer.decoding import loading
    from jax_transformer.decoding.evaluation import score_translations
    from jax_transformer.decoding.translation import translate
    from jax_transformer.model import quantization
    from jax_transformer.settings.config import DecodeConfig

    loaded = loading.load(run, step)  # the float weights, as train.py loads them
    params, config, tokenizer = loaded.params, loaded.config, loaded.tokenizer
    rows = []
    with jax.default_matmul_precision("highest"):
        for beam in beams:
            began = time.perf_counter()
            reference = translate(params, config, tokenizer, sources, DecodeConfig(beam_size=beam), progress=False)
            seconds = time.perf_counter() - began
            base = score_translations(reference, references)
            log(f"beam {beam} float32: BLEU {base['bleu']:.2f} chrF {base['chrf']:.2f} ({seconds:.0f} s)")
            for mode in modes:
                qparams, qconfig = quantization.quantized(params, config, mode)
                began = time.perf_counter()
                output = translate(qparams, qconfig, tokenizer, sources, DecodeConfig(beam_size=beam), progress=False)
                qseconds = time.perf_counter() - began
                scores = score_translations(output, references)
                same = sum(a == b for a, b in zip(output, reference))
                diff, largest = largest_logit_difference(params, config, qparams, qconfig, batches)
                rows.append(
                    dict(
                        beam=beam,
                        mode=mode,
                        sentences=len(sources),
                        bleu_float32=base["bleu"],
                        bleu_int8=scores["bleu"],
                        chrf_float32=base["chrf"],
                        chrf_int8=scores["chrf"],
                        identical=same,
                        logit_max_abs_diff=diff,
                        logit_max_abs=largest,
                        seconds_float32=seconds,
                        seconds_int8=qseconds,
                        bleu_signature=scores["bleu_signature"],
                    )
                )
                log(
                    f"beam {beam} {mode}: BLEU {scores['bleu']:.2f} ({scores['bleu'] - base['bleu']:+.2f}), chrF "
                    f"{scores['chrf']:.2f}, identical {same}/{len(sources)}, largest |logit difference| {diff:.3f} "
                    f"(largest |logit| {largest:.1f}) ({qseconds:.0f} s)"
                )
    return {"machine": machine_info(), "run": str(run), "step": loaded.step, "results": rows}


def table(report: dict) -> str:
    lines = [
        "| decoding | int8 mode | BLEU float32 | BLEU int8 | difference | chrF float32 | chrF int8 | identical "
        "translations | largest logit difference (largest logit) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        search = "greedy" if r["beam"] == 1 else f"beam {r['beam']}"
        lines.append(
            f"| {search} | {r['mode']} | {r['bleu_float32']:.2f} | {r['bleu_int8']:.2f} | "
            f"{r['bleu_int8'] - r['bleu_float32']:+.2f} | {r['chrf_float32']:.2f} | {r['chrf_int8']:.2f} | "
            f"{r['identical']}/{r['sentences']} ({100 * r['identical'] / r['sentences']:.1f}%) | "
            f"{r['logit_max_abs_diff']:.3f} ({r['logit_max_abs']:.1f}) |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a run directory (trained or imported)")
    parser.add_argument("--step", default="best", help="which checkpoint (default: best)")
    parser.add_argument("--src", type=Path, help="source sentences (default: the run's validation data)")
    parser.add_argument("--tgt", type=Path, help="reference translations, line-aligned with --src")
    parser.add_argument("--sentences", type=int, help="the first N pairs only (default: all)")
    parser.add_argument("--beams", default="1,4", help="comma-separated beam sizes (default: 1,4; 1 = greedy)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"int8 modes (default: {','.join(MODES)})")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        import qwix  # noqa: F401
    except ImportError:
        print("qwix is not installed (pip install -e '.[quantize]'): this benchmark is skipped")
        return 0
    import dataclasses

    from jax_transformer.checkpoint import manager as checkpoint
    from jax_transformer.checkpoint.settings import stored_settings
    from jax_transformer.data.batching import ValidationSet, encode_corpus
    from jax_transformer.data.reading import load_corpus
    from jax_transformer.settings.config import DataConfig

    loaded = checkpoint.load(args.run, args.step, weights_only=True)
    if args.src:
        corpus = load_corpus(DataConfig(src=str(args.src), tgt=str(args.tgt)), "train")
    else:
        corpus = load_corpus(DataConfig.from_dict(stored_settings(loaded)["data"]), "valid")
    if corpus is None:
        parser.error("the run had no validation data: give --src and --tgt")
    if args.sentences:
        n = args.sentences
        corpus = dataclasses.replace(
            corpus, sources=corpus.sources[:n], targets=corpus.targets[:n], line_numbers=corpus.line_numbers[:n]
        )
    encoded = encode_corpus(corpus, loaded.tokenizer, loaded.config.max_len, on_too_long="skip")
    valid = ValidationSet.from_encoded(encoded, corpus, DataConfig().max_tokens)
    info = machine_info()
    print(f"machine: {info['cpu_model']}, {info['cores']} cores; {info['libraries']}", flush=True)
    report = measure(
        args.run,
        args.step,
        valid.sources,
        valid.references,
        valid.batches,
        [int(b) for b in args.beams.split(",")],
        [m for m in args.modes.split(",") if m],
        log=lambda line: print(line, flush=True),
    )
    print()
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
