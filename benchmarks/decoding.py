#!/usr/bin/env python3
"""Decoding speed: the cached, jitted Flax search against PyTorch decoders that re-run the whole prefix.

    python benchmarks/decoding.py                      # small preset, greedy and beam 4, batch 16 and 1
    python benchmarks/decoding.py --quick              # 2 timed repeats: a first look
    python benchmarks/decoding.py --preset tiny --new-tokens 16 --repeats 1    # smoke test
    python benchmarks/decoding.py --json decoding.json

Implementations (all decode the same random-weight model on the same random sources):
  flax-cached             jax_transformer.decoding.decoders: key/value cache, the whole loop one jitted lax.while_loop.
  torch-tutorial          the Annotated Transformer's greedy_decode, batched: each step re-runs the decoder over
                          the whole prefix and appends the argmax (greedy only; the tutorial has no beam search).
  torch-reference         torch_reference.decoding, the parity reference: re-runs the whole prefix each step,
                          with the reference's bookkeeping (length limits, banned tokens; beam search per sentence).
  torch-reference-cached  torch_reference.decoding with use_cache=True: its own key/value cache, in eager PyTorch.

Every call produces exactly `new_tokens` tokens per sentence: the searches run with max_len_a=0,
max_len_b=new_tokens (the limit) and min_len=new_tokens (EOS banned until then), and the tutorial loop simply
runs new_tokens steps. tokens/s = sentences x new_tokens / seconds per call (the output tokens; beam search does K
times the decoder work for them). A call includes encoding the sources. Each figure is the min and the median over
the timed repeats, after one untimed warm-up call per implementation (it includes Flax's compilation). The
implementations are interleaved within each repeat, in a rotating order, so that load from other processes on a
shared machine hits all of them alike.

benchmarks/run.py's decode section (`section_decode`, at the end of this file) runs benchmark_decoding and turns
its report into the run's figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/decoding.py` puts benchmarks/ first on the path, not the repo
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.report import add_ratio, figure_from_summary, ratio  # noqa: E402
from jax_transformer.settings.config import TransformerConfig  # noqa: E402
from tests.helpers.configs import preset_config  # noqa: E402
from tests.helpers.twins import twin_models  # noqa: E402

if TYPE_CHECKING:
    from benchmarks.common import Settings

IMPLEMENTATIONS = ("flax-cached", "torch-tutorial", "torch-reference", "torch-reference-cached")


def tutorial_greedy_decode(model, src, new_tokens: int, bos_id: int):
    """The Annotated Transformer's greedy_decode, batched: re-run the decoder over the whole prefix, project only
    the last position onto the vocabulary, append its argmax; no EOS handling, no cache.
    src (B, S) long -> (B, new_tokens) long."""
    import torch

    with torch.no_grad():
        memory = model.encode(src)
        ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long)
        for _ in range(new_tokens):
            hidden = model.decoder_hidden(memory, src, ys)[:, -1:]  # (B, 1, D): the last position
            ys = torch.cat([ys, model.logits(hidden)[:, 0].argmax(dim=-1, keepdim=True)], dim=1)
    return ys[:, 1:]


def _decoders(
    config: TransformerConfig, params, torch_model, src: np.ndarray, beam_size: int, new_tokens: int
) -> dict[str, Callable[[], np.ndarray]]:
    """name -> a zero-argument call that decodes `src` and returns the tokens (B, new_tokens) as numpy."""
    import torch

    from jax_transformer.decoding import decoders
    from torch_reference import decoding as torch_decoding

    src_t = torch.from_numpy(src).long()
    fixed = dict(max_len_a=0, max_len_b=new_tokens, min_len=new_tokens)  # exactly new_tokens tokens
    if beam_size == 1:
        calls = {
            "flax-cached": lambda: decoders.greedy_search(params, config, src, **fixed)[0],
            "torch-tutorial": lambda: tutorial_greedy_decode(torch_model, src_t, new_tokens, config.bos_id).numpy(),
            "torch-reference": lambda: torch_decoding.greedy_search(torch_model, src_t, **fixed)[0].numpy(),
            "torch-reference-cached": lambda: torch_decoding.greedy_search(torch_model, src_t, use_cache=True, **fixed)[
                0
            ].numpy(),
        }
    else:
        beam = dict(beam_size=beam_size, alpha=0.6, **fixed)
        calls = {
            "flax-cached": lambda: decoders.beam_search(params, config, src, **beam)[0],
            "torch-reference": lambda: torch_decoding.beam_search(torch_model, src_t, **beam)[0].numpy(),
            "torch-reference-cached": lambda: torch_decoding.beam_search(torch_model, src_t, use_cache=True, **beam)[
                0
            ].numpy(),
        }
    return calls


def benchmark_decoding(
    preset_name: str = "small",
    *,
    batch_sizes: Sequence[int] = (16, 1),
    beam_sizes: Sequence[int] = (1, 4),
    new_tokens: int = 64,
    src_len: int = 24,
    vocab: int = 8000,
    repeats: int = 5,
    implementations: Sequence[str] = IMPLEMENTATIONS,
    seed: int = 0,
    torch_threads: int | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Measures every (search, batch size, implementation); returns {"machine", "settings", "results"}, where each
    result has search, batch, implementation, seconds (min, median), tokens_per_s (best, median), the share of
    tokens equal to flax-cached's ("agreement"; random weights have near-ties, so 1.0 is not guaranteed).
    `torch_threads` sets torch.set_num_threads for the run (restored after); None keeps torch's setting."""
    import torch

    previous = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        return _benchmark(
            preset_name, batch_sizes, beam_sizes, new_tokens, src_len, vocab, repeats, implementations, seed, log
        )
    finally:
        torch.set_num_threads(previous)


def _benchmark(
    preset_name, batch_sizes, beam_sizes, new_tokens, src_len, vocab, repeats, implementations, seed, log
) -> dict:
    import jax
    import torch

    unknown = sorted(set(implementations) - set(IMPLEMENTATIONS))
    if unknown:
        raise ValueError(f"unknown implementations {unknown}; choose from {IMPLEMENTATIONS}")
    config = preset_config(preset_name, vocab)
    if config.max_len < max(new_tokens, src_len):  # the positions table must cover both sides
        config = config.replace(max_len=max(new_tokens, src_len))
    _, params, torch_model = twin_models(config, seed)
    rng = np.random.default_rng(seed)
    settings = dict(
        preset=preset_name,
        d_model=config.d_model,
        layers=[config.num_encoder_layers, config.num_decoder_layers],
        vocab=vocab,
        src_len=src_len,
        new_tokens=new_tokens,
        repeats=repeats,
        batch_sizes=list(batch_sizes),
        beam_sizes=list(beam_sizes),
        torch_threads=torch.get_num_threads(),
        jax_backend=jax.default_backend(),
    )
    results = []
    for beam_size in beam_sizes:
        for batch in batch_sizes:
            # Random non-special source tokens, every row the full src_len (the last one EOS).
            src = rng.integers(3, vocab, (batch, src_len)).astype(np.int32)
            src[:, -1] = config.eos_id
            calls = {
                name: call
                for name, call in _decoders(config, params, torch_model, src, beam_size, new_tokens).items()
                if name in implementations
            }
            search = "greedy" if beam_size == 1 else f"beam {beam_size}"
            log(f"{search}, batch {batch}: warm-up ({', '.join(calls)})")
            outputs = {name: call() for name, call in calls.items()}  # untimed: includes jit compilation
            times: dict[str, list[float]] = {name: [] for name in calls}
            names = list(calls)
            for r in range(repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order every repeat
                    start = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - start)
            reference = outputs.get("flax-cached")
            for name in names:
                best, median = min(times[name]), statistics.median(times[name])
                produced = batch * new_tokens
                row = dict(
                    search=search,
                    batch=batch,
                    implementation=name,
                    seconds_min=best,
                    seconds_median=median,
                    tokens_per_s_best=produced / best,
                    tokens_per_s_median=produced / median,
                    agreement=None if reference is None else float(np.mean(outputs[name] == reference)),
                )
                results.append(row)
                log(
                    f"  {name:<24} {row['tokens_per_s_median']:>10.1f} tokens/s median, "
                    f"{row['tokens_per_s_best']:>10.1f} best  ({median:.3f} s / call)"
                )
    return {"machine": machine_info(), "settings": settings, "results": results}


def format_table(report: dict) -> str:
    """A Markdown table of the results, with the speed-up of each implementation over torch-reference."""
    lines = [
        "| search | batch | implementation | tokens/s (median) | tokens/s (best) | s/call (median) | "
        "vs torch-reference | same tokens as flax |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    rows = report["results"]
    for row in rows:
        base = next(
            (
                r
                for r in rows
                if r["search"] == row["search"]
                and r["batch"] == row["batch"]
                and r["implementation"] == "torch-reference"
            ),
            None,
        )
        ratio = f"{base['seconds_median'] / row['seconds_median']:.1f}x" if base else "-"
        agree = "-" if row["agreement"] is None else f"{100 * row['agreement']:.0f}%"
        lines.append(
            f"| {row['search']} | {row['batch']} | {row['implementation']} | "
            f"{row['tokens_per_s_median']:.1f} | {row['tokens_per_s_best']:.1f} | "
            f"{row['seconds_median']:.3f} | {ratio} | {agree} |"
        )
    return "\n".join(lines)


def describe_machine(info: dict) -> str:
    libs = ", ".join(f"{k} {v}" for k, v in info["libraries"].items())
    return (
        f"{info['cpu_model']} ({', '.join(info['cpu_features']) or 'no SIMD flags read'}), {info['cores']} "
        f"cores, {info['memory_gib']} GiB; {info['os']}; {libs}; load average {info['load_average']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model size preset (default: small)")
    parser.add_argument("--batch-sizes", default="16,1", help="comma-separated (default: 16,1)")
    parser.add_argument("--beam-sizes", default="1,4", help="comma-separated; 1 = greedy (default: 1,4)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens produced per sentence (default: 64)")
    parser.add_argument("--src-len", type=int, default=24, help="source tokens per sentence (default: 24)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default: 8000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure (default: 5)")
    parser.add_argument("--quick", action="store_true", help="2 timed repeats")
    parser.add_argument(
        "--implementations",
        default=",".join(IMPLEMENTATIONS),
        help=f"comma-separated subset of {','.join(IMPLEMENTATIONS)}",
    )
    parser.add_argument("--torch-threads", type=int, help="torch.set_num_threads (default: torch's own choice)")
    parser.add_argument("--json", type=Path, help="also write the full report here")
    args = parser.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    info = machine_info()
    print(f"machine: {describe_machine(info)}", flush=True)
    report = benchmark_decoding(
        args.preset,
        batch_sizes=ints(args.batch_sizes),
        beam_sizes=ints(args.beam_sizes),
        new_tokens=args.new_tokens,
        src_len=args.src_len,
        vocab=args.vocab,
        repeats=2 if args.quick else args.repeats,
        implementations=[x for x in args.implementations.split(",") if x],
        torch_threads=args.torch_threads,
        log=lambda line: print(line, flush=True),
    )
    print(f"\nsettings: {json.dumps(report['settings'])}")
    print(f"load average after: {machine_info()['load_average']}\n")
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


# =============================================================================================================
# benchmarks/run.py's section 4: decoding
# =============================================================================================================


DECODE_LABELS = {  # IMPLEMENTATIONS -> what they are, in the run's figure names
    "flax-cached": "Flax, key/value cache (jit)",
    "torch-tutorial": "torch, tutorial loop (re-runs the prefix)",
    "torch-reference": "torch reference decoder (re-runs the prefix)",
    "torch-reference-cached": "torch reference decoder, its key/value cache",
}


def section_decode(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Greedy and beam 4 at batch 16 and 1: the cached Flax decoder against the tutorial-style PyTorch loop and
    the PyTorch reference's decoder, all measured by benchmark_decoding (which interleaves them, warms each up
    once, and produces exactly `new_tokens` tokens per sentence)."""
    # --quick leaves out the reference's cached decoder: the brief's three are Flax, tutorial and reference.
    implementations = [i for i in IMPLEMENTATIONS if not (s.quick and i == "torch-reference-cached")]
    # The reference's beam search re-runs the prefix for one sentence at a time: minutes per call at batch 16
    # on 2 cores. So at most 3 timed calls, and --quick times one (after the warm-up one) and runs beam search
    # at batch 1 only.
    plan = [((1,), s.decode_batch_sizes), ((4,), s.decode_batch_sizes)]
    if s.quick:
        plan = [
            ((1,), s.decode_batch_sizes),
            ((4,), tuple(b for b in s.decode_batch_sizes if b == 1) or (min(s.decode_batch_sizes),)),
        ]
    for name in s.aux_presets:
        repeats = 1 if s.quick else min(3, s.repeats_for(name))
        reports = []
        for beam_sizes, batch_sizes in plan:
            try:
                reports.append(
                    benchmark_decoding(
                        name,
                        batch_sizes=batch_sizes,
                        beam_sizes=beam_sizes,
                        new_tokens=s.decode_new_tokens,
                        vocab=s.vocab,
                        repeats=repeats,
                        torch_threads=s.torch_threads,
                        implementations=implementations,
                        log=lambda line: print(f"  [{name}] {line}", flush=True),
                    )
                )
            except Exception as e:  # reported with the other failures; the remaining sections still run
                failures.append({"name": f"decode/{name} beam {beam_sizes[0]}", "error": f"{type(e).__name__}: {e}"})
                print(f"  failed: {type(e).__name__}: {e}", flush=True)
        if not reports:
            continue
        report = {"settings": reports[0]["settings"], "results": [r for rep in reports for r in rep["results"]]}
        settings = report["settings"]
        # Random weights have near-ties, so an implementation may pick other tokens than Flax: say where.
        differ = [
            f"{r['search']} batch {r['batch']} {r['implementation']} {100 * r['agreement']:.0f}%"
            for r in report["results"]
            if r["agreement"] is not None and r["agreement"] < 1.0
        ]
        note = (
            f"decode {name}: {settings['new_tokens']} new tokens per sentence from {settings['src_len']} "
            f"source tokens; tokens/s counts output tokens and a call includes encoding the sources; "
            f"tokens equal to Flax's: " + ("all" if not differ else "all but " + ", ".join(differ))
        )
        groups: dict[tuple[str, int], dict[str, dict]] = {}
        for row in report["results"]:
            search, batch, impl = row["search"], row["batch"], row["implementation"]
            produced = batch * settings["new_tokens"]
            fig = figure_from_summary(
                f"decode {name} {search} batch {batch}: {DECODE_LABELS.get(impl, impl)}",
                "tokens/s",
                row["seconds_min"],
                row["seconds_median"],
                repeats,
                lambda t, n=produced: n / t,
                section="decode",
                preset_name=name,
                note=note,
            )
            fig["agreement_with_flax"] = row["agreement"]
            groups.setdefault((search, batch), {})[impl] = fig
        for figs in groups.values():
            flax = figs.get("flax-cached")
            for impl, fig in figs.items():
                if flax is not None and impl != "flax-cached":
                    add_ratio(flax, f"Flax/{impl}", ratio(flax, fig))
            figures.extend(figs.values())


if __name__ == "__main__":
    sys.exit(main())
