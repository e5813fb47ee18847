#!/usr/bin/env python3
"""Speed of the Flax Transformer against its PyTorch reference, on this machine, in one process tree.

    python benchmarks/run.py                    # the full run (15-20 minutes on a quiet 2-core machine)
    python benchmarks/run.py --quick            # batch 16 x 32, fewer repeats, no torch.compile, 64 new tokens
                                                # when decoding: a few minutes on a quiet machine
    python benchmarks/run.py --json out.json --markdown out.md
    python benchmarks/run.py --presets tiny --sections train,flops --repeats 1 --json smoke.json   # smoke test

Sections (`--sections`, comma-separated; all by default):
  train       one training step on the same batch in every framework (batch 64 x 32 tokens; 16 x 32 with
              --quick): JAX `jit` (make_train_step) against the PyTorch reference step
              (torch_reference.training.train_step) run eagerly with Adam's default (for-loop on CPU), foreach
              and fused implementations, and with the model under torch.compile: ms/step, target tokens/s, and
              the first call's time (compilation) apart.
  flops       achieved GFLOP/s of those steps: matmul FLOPs counted from the shapes (`train_step_matmul_flops`),
              cross-checked with the traced step's dot_general ops and XLA's cost analysis, as a percentage of
              the float32 matmul peak (jnp.dot, torch.mm) measured in the same run.
  first-step  time to the first finished step (trace + compile + run) in a fresh process, persistent caches off.
  decode      greedy and beam 4 search, batch 16 and 1, 64 new tokens (benchmarks/decoding.py's
              benchmark_decoding): the cached Flax decoder against PyTorch loops that re-run the prefix.
  pmap        data parallel `pmap` over 4 simulated CPU devices against single-device `jit`, same global batch,
              both in one subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=4.

Fairness: the frameworks are interleaved in one loop (JAX step, torch step, ..., JAX step, ...; the order rotates
every round) so that load from other processes on a shared machine hits all of them alike. Each figure is given
at the fastest and at the median of its timed repeats, after untimed warm-up steps. Ratios are of medians.
torch runs with torch.set_num_threads(number of cores); XLA uses all cores by default.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/run.py` puts benchmarks/ first on the path, not the repo
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

# Neither of these imports jax or torch: both are imported inside the functions that use them, after
# `isolate_caches` (they read its settings when first imported) and only in the processes that need them.
from benchmarks.machine import core_count, machine_info  # noqa: E402
from jax_transformer.config import PRESETS, TransformerConfig, preset  # noqa: E402

SECTIONS = ("train", "flops", "first-step", "decode", "pmap")
TORCH_VARIANTS = {  # variant -> how the PyTorch reference step is run
    "default": "torch eager, Adam (default: for-loop on CPU)",
    "foreach": "torch eager, Adam(foreach=True)",
    "fused": "torch eager, Adam(fused=True)",
    "compile": "torch.compile(model), Adam(fused=True)",
}
JAX_LABEL = "JAX jit"
PMAP_DEVICES = 4
SCHEMA = "jax-transformer-benchmark/1"


# =============================================================================================================
# Settings
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class Settings:
    presets: tuple[str, ...]  # model sizes for the train, flops and first-step sections
    aux_presets: tuple[str, ...]  # model sizes for the decode and pmap sections
    sections: tuple[str, ...]
    batch_size: int  # rows per training batch
    length: int  # source and target width of the training batch, in tokens (rows are padded to it)
    vocab: int  # source and target vocabulary size (shared)
    repeats: dict[str, int]  # timed steps per preset
    warmup: int  # untimed steps per variant before timing (the first includes compilation)
    first_step_runs: int  # fresh processes per preset and framework in the first-step section
    torch_variants: tuple[str, ...]
    decode_batch_sizes: tuple[int, ...]
    decode_new_tokens: int
    peak_size: int  # n of the n x n float32 matmuls that measure the peak
    peak_repeats: int
    torch_threads: int
    quick: bool

    def repeats_for(self, preset_name: str) -> int:
        return self.repeats.get(preset_name, min(self.repeats.values()))


# Timed repeats per preset. The base model takes seconds per step on a 2-core CPU, so it gets fewer.
FULL_REPEATS = {"tiny": 10, "small": 6, "base": 3}
QUICK_REPEATS = {"tiny": 3, "small": 3, "base": 2}


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--quick", action="store_true",
                   help="batch 16 x 32 instead of 64 x 32, fewer repeats, no torch.compile, one fresh process "
                        "per first-step figure, decoding 64 new tokens with beam search at batch 1 only: a few "
                        "minutes on a quiet machine")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (for README)")
    p.add_argument("--presets", default="small,base", help="model presets for train/flops/first-step "
                   f"(comma-separated, from {sorted(PRESETS)}; default small,base)")
    p.add_argument("--aux-presets", default="small",
                   help="presets for the decode and pmap sections (default small: the base model's re-run-the-"
                        "prefix decoding alone takes many minutes on CPU)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--batch-size", type=int, help="training batch rows (default 64, 16 with --quick)")
    p.add_argument("--length", type=int, default=32, help="training source/target width in tokens (default 32)")
    p.add_argument("--vocab", type=int, default=8000, help="shared vocabulary size (default 8000)")
    p.add_argument("--repeats", type=int, help="timed steps per figure, for every preset (default: per preset, "
                   f"{FULL_REPEATS}, with --quick {QUICK_REPEATS})")
    p.add_argument("--warmup", type=int, help="untimed steps before timing (default 2, 1 with --quick)")
    p.add_argument("--torch-variants", help=f"comma-separated subset of {list(TORCH_VARIANTS)} (default all; "
                   "with --quick default,fused: torch.compile alone takes minutes to compile on 2 cores)")
    p.add_argument("--decode-batch-sizes", default="16,1", help="decode section batch sizes (default 16,1)")
    p.add_argument("--decode-new-tokens", type=int,
                   help="tokens each decoded sentence gets (default 64, as the speed goal is stated)")
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n matmul peak (default 2048)")
    p.add_argument("--child", choices=("first-step", "pmap"), help=argparse.SUPPRESS)  # internal: subprocesses
    p.add_argument("--framework", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def listed(text: str, allowed, what: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"{what}: unknown {bad or 'empty list'}; choose from {sorted(allowed)}")
        return items

    def positive_ints(text: str, what: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            p.error(f"{what}: expected comma-separated integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"{what}: expected positive integers, got {text!r}")
        return values

    quick = args.quick
    repeats = dict(QUICK_REPEATS if quick else FULL_REPEATS)
    if args.repeats is not None:
        if args.repeats < 1:
            p.error(f"--repeats must be >= 1, got {args.repeats}")
        repeats = {name: args.repeats for name in PRESETS}
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    if warmup < 1:
        p.error(f"--warmup must be >= 1 (the first step compiles), got {warmup}")
    batch_size = args.batch_size or (16 if quick else 64)
    new_tokens = args.decode_new_tokens or 64
    for name, value in (("--batch-size", batch_size), ("--length", args.length), ("--vocab", args.vocab),
                        ("--peak-size", args.peak_size), ("--decode-new-tokens", new_tokens)):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if args.vocab < 5:
        p.error(f"--vocab must be >= 5 (ids 0-3 are pad/bos/eos/unk), got {args.vocab}")
    if args.length < 2:
        p.error(f"--length must be >= 2, got {args.length}")
    variants = args.torch_variants or ("default,fused" if quick else ",".join(TORCH_VARIANTS))
    settings = Settings(
        presets=listed(args.presets, PRESETS, "--presets"),
        aux_presets=listed(args.aux_presets, PRESETS, "--aux-presets"),
        sections=listed(args.sections, SECTIONS, "--sections"),
        batch_size=batch_size, length=args.length, vocab=args.vocab, repeats=repeats, warmup=warmup,
        first_step_runs=1 if quick or args.repeats == 1 else 2,
        torch_variants=listed(variants, TORCH_VARIANTS, "--torch-variants"),
        decode_batch_sizes=positive_ints(args.decode_batch_sizes, "--decode-batch-sizes"),
        decode_new_tokens=new_tokens, peak_size=args.peak_size,
        peak_repeats=1 if args.repeats == 1 else max(3, min(repeats.values())),
        torch_threads=core_count(), quick=quick)
    return args, settings


def isolate_caches() -> None:
    """Compilation is measured from scratch: no persistent XLA compilation cache, and a fresh, empty Inductor
    cache directory for torch.compile (removed at exit). Must run before jax and torch are imported."""
    if "jax" in sys.modules or "torch" in sys.modules:
        raise RuntimeError("isolate_caches() must run before jax and torch are imported")
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    inductor_dir = tempfile.mkdtemp(prefix="benchmark-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    atexit.register(shutil.rmtree, inductor_dir, ignore_errors=True)


def model_config(name: str, vocab: int) -> TransformerConfig:
    """A preset with the benchmark's shared vocabulary; dropout 0.1 and label smoothing 0.1 are the defaults."""
    return preset(name, src_vocab_size=vocab, tgt_vocab_size=vocab)


def set_torch_threads(n: int) -> None:
    """torch gets one intra-op thread per core, as XLA's CPU client uses all cores by default."""
    import torch

    torch.set_num_threads(n)


# =============================================================================================================
# Measurements and figures
# =============================================================================================================


def figure(name: str, unit: str, seconds: Sequence[float], to_unit: Callable[[float], float] = lambda t: t, *,
           section: str, preset_name: str | None = None, note: str | None = None) -> dict[str, Any]:
    """One line of the results from the timed repeats' durations (seconds). `min` is the figure at the fastest
    repeat and `median` at the median duration, both in `unit`: for a time that is the minimum and the median,
    for a rate (tokens/s, GFLOP/s) the fastest repeat gives the highest value. Ratios (of medians) are added
    later with add_ratio."""
    fastest, median = float(min(seconds)), float(statistics.median(seconds))
    return {"name": name, "section": section, "preset": preset_name, "unit": unit,
            "min": to_unit(fastest), "median": to_unit(median), "n": len(seconds),
            "seconds": {"min": fastest, "median": median, "max": float(max(seconds))},
            "higher_is_better": unit.endswith("/s"),  # a rate (tokens/s, GFLOP/s), not a time (ms/step, s)
            "ratios": {}, "note": note}


def figure_from_summary(name: str, unit: str, fastest: float, median: float, n: int,
                        to_unit: Callable[[float], float], **kw) -> dict[str, Any]:
    """A figure from a fastest and a median duration measured elsewhere (benchmarks/decoding.py)."""
    fig = figure(name, unit, [fastest, median], to_unit, **kw)
    fig.update(median=to_unit(median), n=n, seconds={"min": fastest, "median": median, "max": None})
    return fig


def ratio(a: dict | None, b: dict | None) -> float | None:
    """Median of figure a over median of figure b, or None where one is missing."""
    if a is None or b is None or not b["median"]:
        return None
    return a["median"] / b["median"]


def add_ratio(fig: dict, key: str, value: float | None) -> None:
    if value is not None and value > 0:
        fig["ratios"][key] = value


def interleaved(runners: Mapping[str, Callable[[], Any]], repeats: int, *, desc: str,
                failures: list[dict], context: str) -> dict[str, list[float]]:
    """Runs every runner once per round, `repeats` rounds, rotating the order each round so that no runner
    always follows the same one; returns {name: [seconds, ...]}. A runner that raises is reported in
    `failures` and dropped; the others go on."""
    from tqdm.auto import tqdm

    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in tqdm(range(repeats), desc=desc, unit="round", leave=False, dynamic_ncols=True):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        for name in order:
            if name not in runners:
                continue
            start = time.perf_counter()
            try:
                runners[name]()
            except Exception as e:  # one broken variant must not cost the whole benchmark
                failures.append({"name": f"{context}: {name}", "error": f"{type(e).__name__}: {e}"})
                runners = {k: v for k, v in runners.items() if k != name}
                times.pop(name)
                continue
            times[name].append(time.perf_counter() - start)
    return times


# =============================================================================================================
# The training batch
# =============================================================================================================


def make_batch(config: TransformerConfig, batch_size: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One padded batch of random token ids, as the data pipeline makes them: src (B, L), tgt_in (B, L) =
    BOS + words, tgt_out (B, L) = words + EOS, padded with 0. Each row's source and target lengths are drawn
    in [L/2, L], so some positions are padding and `target_tokens` (non-pad tgt_out) is less than B * L."""
    rng = np.random.default_rng(seed)
    first_word = max(config.pad_id, config.bos_id, config.eos_id) + 2  # past the specials (and unk)
    src = np.full((batch_size, length), config.pad_id, np.int32)
    tgt_in, tgt_out = src.copy(), src.copy()
    for row in range(batch_size):
        n_src = rng.integers(length // 2, length + 1)
        src[row, :n_src] = rng.integers(first_word, config.src_vocab_size, n_src)
        n_tgt = rng.integers(max(1, length // 2), length + 1)  # tokens predicted, EOS included
        words = rng.integers(first_word, config.tgt_vocab_size, n_tgt - 1)
        tgt_in[row, :n_tgt] = np.concatenate([[config.bos_id], words])
        tgt_out[row, :n_tgt] = np.concatenate([words, [config.eos_id]])
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def target_tokens(batch: Mapping[str, np.ndarray], pad_id: int) -> int:
    return int((np.asarray(batch["tgt_out"]) != pad_id).sum())


# =============================================================================================================
# The training steps being compared
# =============================================================================================================


class JaxTrain:
    """The project's compiled step (jax_transformer.training.make_train_step), state donated from call to call."""

    def __init__(self, config: TransformerConfig, batch: Mapping[str, np.ndarray], params, n_devices: int = 1):
        import jax

        from jax_transformer.training import OptimConfig, create_train_state, make_train_step, replicate, \
            shard_batch

        opt = OptimConfig()  # the paper's Adam and schedule, label smoothing 0.1
        self.n_devices = n_devices
        self.state = replicate(create_train_state(config, opt, params=params), n_devices)
        self.step_fn = make_train_step(config, opt, n_devices=n_devices)
        # Placed on the device(s) once, as the torch batch is built once: the step is timed, not the transfer.
        batch = shard_batch({k: np.asarray(v) for k, v in batch.items()}, n_devices)
        if n_devices == 1:
            self.batch = jax.device_put(batch)
        else:  # an identity pmap leaves row block i on device i (jax.device_put_sharded is gone)
            self.batch = jax.pmap(lambda x: x, devices=jax.local_devices()[:n_devices])(batch)

    def __call__(self):
        import jax

        self.state, sums = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, sums))  # dispatch is asynchronous: wait for the result
        return sums

    def cost_analysis(self) -> dict[str, float]:
        """XLA's own count for the compiled step (the compilation is cached by now, so this is cheap)."""
        analysis = self.step_fn.lower(self.state, self.batch).compile().cost_analysis()
        if isinstance(analysis, (list, tuple)):  # older jax: one dict per device program
            analysis = analysis[0]
        return dict(analysis or {})


class TorchTrain:
    """The PyTorch reference step (torch_reference.training.train_step) with one Adam implementation, eager or
    with the model under torch.compile. Same weights, batch, loss, schedule and dropout rate as the JAX step."""

    def __init__(self, config: TransformerConfig, batch: Mapping[str, np.ndarray], numpy_params, variant: str):
        """numpy_params: a PyTorch state dict of numpy arrays (the JAX model's weights), or None for torch's
        own initialisation."""
        import torch

        from jax_transformer.training import OptimConfig
        from torch_reference import Transformer, load_numpy_state_dict
        from torch_reference.training import make_optimizer, noam_lambda

        opt = OptimConfig()
        model = Transformer(config)
        if numpy_params is not None:
            load_numpy_state_dict(model, numpy_params)
        model.train()  # dropout on, as in the JAX step
        if variant == "default":
            self.optimizer, self.scheduler = make_optimizer(model, d_model=config.d_model,
                                                            warmup_steps=opt.warmup_steps, lr_scale=opt.lr_scale,
                                                            b1=opt.b1, b2=opt.b2, eps=opt.eps)
        else:  # the same optimiser and schedule as make_optimizer, with the implementation chosen explicitly
            kind = {"foreach": {"foreach": True}, "fused": {"fused": True}, "compile": {"fused": True}}[variant]
            self.optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(opt.b1, opt.b2), eps=opt.eps,
                                              **kind)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, noam_lambda(config.d_model, opt.warmup_steps, opt.lr_scale))
        # torch.compile compiles lazily, at the first call; the forward, the loss's backward (AOTAutograd) and
        # later calls all run compiled code. The optimiser step stays eager (fused).
        self.model = torch.compile(model) if variant == "compile" else model
        self.batch = {k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in batch.items()}
        self.pad_id, self.label_smoothing = config.pad_id, opt.label_smoothing

    def __call__(self):
        from torch_reference.training import train_step

        # Returns Python floats, so the step has finished when this returns (CPU torch is synchronous anyway).
        return train_step(self.model, self.optimizer, self.scheduler, self.batch, pad_id=self.pad_id,
                          label_smoothing=self.label_smoothing)


def initial_params(config: TransformerConfig):
    """Flax parameters (seed 0) and the same weights as a PyTorch state dict of numpy arrays."""
    from jax_transformer.model import init_params
    from jax_transformer.port import flax_to_torch

    params = init_params(config, 0)
    return params, flax_to_torch(params)


# =============================================================================================================
# Section 1: training step
# =============================================================================================================


def section_train(s: Settings, figures: list, failures: list, state: dict) -> None:
    """JAX jit vs each torch variant on the same batch: ms/step, target tokens/s, compile time of the first call."""
    for name in s.presets:
        config = model_config(name, s.vocab)
        batch = make_batch(config, s.batch_size, s.length)
        tokens = target_tokens(batch, config.pad_id)
        params, numpy_params = initial_params(config)
        runners: dict[str, Callable] = {}
        first_call: dict[str, float] = {}
        builders = {JAX_LABEL: lambda: JaxTrain(config, batch, params)}
        for variant in s.torch_variants:
            builders[TORCH_VARIANTS[variant]] = lambda v=variant: TorchTrain(config, batch, numpy_params, v)
        for label, build in builders.items():
            print(f"  [{name}] {label}: building and warming up ({s.warmup} step(s))", flush=True)
            try:
                runner = build()
                for i in range(s.warmup):
                    start = time.perf_counter()
                    runner()
                    if i == 0:
                        first_call[label] = time.perf_counter() - start
            except Exception as e:  # e.g. torch.compile without a working C++ toolchain
                failures.append({"name": f"train/{name}: {label}", "error": f"{type(e).__name__}: {e}"})
                print(f"    failed: {type(e).__name__}: {e}", flush=True)
                continue
            runners[label] = runner
        times = interleaved(runners, s.repeats_for(name), desc=f"train {name}", failures=failures,
                            context=f"train/{name}")
        state.setdefault("train", {})[name] = {"times": times, "tokens": tokens, "runners": runners,
                                               "batch": batch, "config": config}
        note = (f"batch {s.batch_size} x {s.length} tokens (src and tgt), {tokens} real target tokens, "
                f"vocab {s.vocab}, dropout 0.1, label smoothing 0.1")
        step_figs, tok_figs = {}, {}
        for label, seconds in times.items():
            step_figs[label] = figure(f"train step {name}: {label}", "ms/step", seconds, lambda t: 1e3 * t,
                                      section="train", preset_name=name, note=note)
            tok_figs[label] = figure(f"train throughput {name}: {label}", "target tokens/s", seconds,
                                     lambda t: tokens / t, section="train", preset_name=name, note=note)
        for figs in (step_figs, tok_figs):
            for label, fig in figs.items():
                if label != JAX_LABEL:
                    add_ratio(figs.get(JAX_LABEL, {"ratios": {}}), f"JAX/{label}", ratio(figs.get(JAX_LABEL), fig))
            figures.extend(figs.values())
        # The first call of a jitted / torch.compiled function compiles: reported apart from the step time.
        compiled = {label: t for label, t in first_call.items() if label == JAX_LABEL or "compile" in label}
        compile_figs = {label: figure(f"first call (compile + step) {name}: {label}", "s", [t],
                                      section="train", preset_name=name,
                                      note="in the benchmark process (imports and other models already loaded)")
                        for label, t in compiled.items()}
        for label, fig in compile_figs.items():
            if label != JAX_LABEL:
                add_ratio(compile_figs.get(JAX_LABEL, {"ratios": {}}), f"JAX/{label}",
                          ratio(compile_figs.get(JAX_LABEL), fig))
        figures.extend(compile_figs.values())


# =============================================================================================================
# Section 2: achieved FLOP/s
# =============================================================================================================


def train_step_matmul_flops(config: TransformerConfig, batch_size: int, src_len: int, tgt_len: int
                            ) -> dict[str, float]:
    """Matmul FLOPs of one training step (forward + backward), counted from the shapes.

    A (m, k) @ (k, n) matmul costs 2*m*k*n FLOPs (one multiply and one add per term). Padding positions are
    counted: the dense computation does not skip them. With B rows, S source and T target positions,
    d = d_model, f = d_ff, V = target vocabulary, one forward pass costs:
      each encoder layer: Q, K, V and output projections 4 * 2BSd^2; scores Q K^T 2BS^2d (all heads together:
                          H * head_dim = d); probabilities @ V 2BS^2d; feed-forward 2 * 2BSdf
      each decoder layer: self-attention as above with T; cross-attention Q and output projections 2 * 2BTd^2,
                          K and V of the encoder output 2 * 2BSd^2, scores and values 2 * 2BTSd;
                          feed-forward 2 * 2BTdf
      output projection:  2BTdV
    The backward pass needs two matmuls for each forward one (the gradient with respect to each operand), so a
    training step is 3x the forward. Embedding lookups, softmax, LayerNorm, dropout, the loss and the Adam
    update are not matmuls and are not counted.
    """
    B, S, T, d, f, V = batch_size, src_len, tgt_len, config.d_model, config.d_ff, config.tgt_vocab_size
    encoder_layer = 4 * 2 * B * S * d * d + 2 * (2 * B * S * S * d) + 2 * (2 * B * S * d * f)
    decoder_layer = (4 * 2 * B * T * d * d + 2 * (2 * B * T * T * d)  # masked self-attention
                     + 2 * 2 * B * T * d * d + 2 * 2 * B * S * d * d + 2 * (2 * B * T * S * d)  # cross-attention
                     + 2 * (2 * B * T * d * f))  # feed-forward
    output = 2 * B * T * d * V
    forward = config.num_encoder_layers * encoder_layer + config.num_decoder_layers * decoder_layer + output
    return {"encoder": float(config.num_encoder_layers * encoder_layer),
            "decoder": float(config.num_decoder_layers * decoder_layer), "output_projection": float(output),
            "forward": float(forward), "train_step": float(3 * forward)}


def jaxpr_matmul_flops(jaxpr) -> float:
    """Matmul FLOPs of a traced program: 2 * (product of the lhs dims) * (product of the rhs's free dims) for
    every dot_general, recursing into nested programs (jit, custom_jvp/vjp, remat) and multiplying a scan's
    body by its length. An exact count of what the program asks for, independent of the formula above."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    total = 0.0
    for eqn in inner.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            rhs_free = [n for d, n in enumerate(rhs) if d not in rhs_contract and d not in rhs_batch]
            total += 2.0 * float(np.prod(lhs)) * float(np.prod(rhs_free))
            continue
        repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        subs = []
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (ClosedJaxpr, Jaxpr)):
                    subs.append(jaxpr_matmul_flops(item))
        if subs:  # a cond runs one of its branches: count the largest
            total += repeat * (max(subs) if eqn.primitive.name == "cond" else sum(subs))
    return total


def traced_train_step_matmul_flops(config: TransformerConfig, batch_size: int, src_len: int, tgt_len: int
                                   ) -> float:
    """jaxpr_matmul_flops of make_train_step's step, traced on shapes only (nothing is computed)."""
    import jax
    import jax.numpy as jnp

    from jax_transformer.training import OptimConfig, abstract_train_state, make_train_step

    opt = OptimConfig()
    shapes = {"src": (batch_size, src_len), "tgt_in": (batch_size, tgt_len), "tgt_out": (batch_size, tgt_len)}
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k, shape in shapes.items()}
    return jaxpr_matmul_flops(jax.make_jaxpr(make_train_step(config, opt))(abstract_train_state(config, opt), batch))


def matmul_peak(n: int, repeats: int, failures: list) -> dict[str, list[float]]:
    """Seconds per n x n float32 matmul, jnp.dot (jitted) and torch.mm interleaved: the machine's practical
    peak for each library."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    ja, jb = jax.device_put(a), jax.device_put(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    dot = jax.jit(jnp.dot)
    runners = {"jnp.dot": lambda: dot(ja, jb).block_until_ready(), "torch.mm": lambda: torch.mm(ta, tb)}
    for run in runners.values():  # warm-up: compile jnp.dot, let torch/MKL set up its threads
        run()
    return interleaved(runners, repeats, desc="matmul peak", failures=failures, context="flops")


def section_flops(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Achieved GFLOP/s of each measured training step, and its share of the measured matmul peak."""
    peak_times = matmul_peak(s.peak_size, s.peak_repeats, failures)
    flop = 2.0 * s.peak_size ** 3
    peaks = {lib: figure(f"matmul peak: {lib} {s.peak_size}x{s.peak_size} float32", "GFLOP/s", times,
                         lambda t: flop / t / 1e9, section="flops")
             for lib, times in peak_times.items()}
    if len(peaks) == 2:
        add_ratio(peaks["jnp.dot"], "jnp.dot/torch.mm", ratio(peaks["jnp.dot"], peaks["torch.mm"]))
    figures.extend(peaks.values())
    trained = state.get("train", {})
    for name in s.presets:
        if name not in trained:  # the train section was not selected: time the JAX step alone
            config = model_config(name, s.vocab)
            batch = make_batch(config, s.batch_size, s.length)
            runner = JaxTrain(config, batch, initial_params(config)[0])
            for _ in range(s.warmup):
                runner()
            times = interleaved({JAX_LABEL: runner}, s.repeats_for(name), desc=f"flops {name}",
                                failures=failures, context=f"flops/{name}")
            trained[name] = {"times": times, "runners": {JAX_LABEL: runner}, "config": config, "batch": batch}
        entry = trained[name]
        config = entry["config"]
        counts = train_step_matmul_flops(config, s.batch_size, s.length, s.length)
        # Two cross-checks of the formula: the dot_general ops of the traced step (should agree exactly) and
        # XLA's cost analysis of the compiled step (counts every op, elementwise ones too, so it is higher).
        xla = traced = None
        jax_runner = entry["runners"].get(JAX_LABEL)
        if jax_runner is not None:
            try:
                traced = traced_train_step_matmul_flops(config, s.batch_size, s.length, s.length)
                xla = jax_runner.cost_analysis().get("flops")
            except Exception as e:  # a cross-check's absence is reported, not fatal
                failures.append({"name": f"flops/{name}: cross-check", "error": f"{type(e).__name__}: {e}"})
        note = (f"{name}: analytic matmul FLOPs per step {counts['train_step'] / 1e9:.2f} G (3 x forward "
                f"{counts['forward'] / 1e9:.2f} G)"
                + (f"; dot_general in the traced step {traced / 1e9:.2f} G" if traced else "")
                + (f"; XLA cost analysis (all ops) {xla / 1e9:.2f} G" if xla else ""))
        for label, seconds in entry["times"].items():
            if not seconds:
                continue
            fig = figure(f"achieved {name}: {label}", "GFLOP/s", seconds, lambda t: counts["train_step"] / t / 1e9,
                         section="flops", preset_name=name, note=note)
            peak = peaks.get("jnp.dot" if label == JAX_LABEL else "torch.mm")
            if peak is not None:  # utilisation against the same library's own matmul peak
                add_ratio(fig, f"% of {'jnp.dot' if label == JAX_LABEL else 'torch.mm'} peak",
                          100.0 * ratio(fig, peak))
            if label == JAX_LABEL:
                if "torch.mm" in peaks:
                    add_ratio(fig, "% of torch.mm peak", 100.0 * ratio(fig, peaks["torch.mm"]))
                if traced:
                    add_ratio(fig, "traced matmul/analytic", traced / counts["train_step"])
                if xla:
                    add_ratio(fig, "XLA flops/analytic", xla / counts["train_step"])
            figures.append(fig)


# =============================================================================================================
# Section 3: time to the first step, in fresh processes
# =============================================================================================================


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh benchmark subprocess: persistent caches off (see the top of this file), a
    fresh Inductor directory, the repository importable."""
    env = dict(os.environ)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the child makes its own empty one
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra)
    return env


def run_child(args: list[str], env: Mapping[str, str], timeout: float = 1800) -> dict:
    """Runs this script with --child ... and returns the JSON object its last stdout line holds."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], env=dict(env),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"child {' '.join(args)} exited with {proc.returncode}: " + " | ".join(tail))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_args(s: Settings, name: str) -> list[str]:
    return ["--presets", name, "--batch-size", str(s.batch_size), "--length", str(s.length),
            "--vocab", str(s.vocab)]


def child_first_step(framework: str, s: Settings) -> dict:
    """In a fresh process: import, build the state, then time the first step (JAX: trace + compile + run)."""
    t0 = time.perf_counter()
    config = model_config(s.presets[0], s.vocab)
    batch = make_batch(config, s.batch_size, s.length)
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
        t_import = time.perf_counter()
        params, _ = initial_params(config)
        runner = JaxTrain(config, batch, params)
    else:
        import torch

        set_torch_threads(s.torch_threads)
        t_import = time.perf_counter()
        runner = TorchTrain(config, batch, None, "default")  # torch's own init: no jax in this process
    t_setup = time.perf_counter()
    runner()
    t_first = time.perf_counter()
    runner()
    t_second = time.perf_counter()
    return {"import_s": t_import - t0, "setup_s": t_setup - t_import, "first_step_s": t_first - t_setup,
            "second_step_s": t_second - t_first}


def section_first_step(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Time to the first finished step in a fresh process: JAX (trace + compile + run) vs torch eager."""
    from tqdm.auto import tqdm

    labels = {"jax": JAX_LABEL, "torch": TORCH_VARIANTS["default"]}
    for name in s.presets:
        results: dict[str, list[dict]] = {fw: [] for fw in labels}
        for _ in tqdm(range(s.first_step_runs), desc=f"first step {name}", unit="run", leave=False):
            for fw in labels:  # interleaved, as everywhere
                try:
                    results[fw].append(run_child(["--child", "first-step", "--framework", fw,
                                                  *child_args(s, name)], child_env()))
                except Exception as e:
                    failures.append({"name": f"first-step/{name}: {labels[fw]}",
                                     "error": f"{type(e).__name__}: {e}"})
        figs = {}
        for fw, runs in results.items():
            if not runs:
                continue
            imports = statistics.median(r["import_s"] for r in runs)
            setup = statistics.median(r["setup_s"] for r in runs)
            later = statistics.median(r["second_step_s"] for r in runs)
            figs[fw] = figure(f"first step {name}: {labels[fw]}", "s", [r["first_step_s"] for r in runs],
                              section="first-step", preset_name=name,
                              note=f"{labels[fw]}, {name}: fresh process; not counted: import {imports:.1f} s, "
                                   f"model/optimiser setup {setup:.1f} s; the second step took {later:.2f} s")
        if "jax" in figs and "torch" in figs:
            add_ratio(figs["jax"], f"JAX/{labels['torch']}", ratio(figs["jax"], figs["torch"]))
        figures.extend(figs.values())


# =============================================================================================================
# Section 4: decoding
# =============================================================================================================


DECODE_LABELS = {  # benchmarks/decoding.py's implementation names -> what they are
    "flax-cached": "Flax, key/value cache (jit)",
    "torch-tutorial": "torch, tutorial loop (re-runs the prefix)",
    "torch-reference": "torch reference decoder (re-runs the prefix)",
    "torch-reference-cached": "torch reference decoder, its key/value cache",
}


def section_decode(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Greedy and beam 4 at batch 16 and 1: the cached Flax decoder against the tutorial-style PyTorch loop and
    the PyTorch reference's decoder, all measured by benchmarks/decoding.py's benchmark_decoding (which
    interleaves them, warms each up once, and produces exactly `new_tokens` tokens per sentence)."""
    try:
        from benchmarks.decoding import IMPLEMENTATIONS, benchmark_decoding
    except ImportError as e:
        failures.append({"name": "decode", "error": f"benchmarks/decoding.py is not available: {e}"})
        print(f"  skipped: benchmarks/decoding.py is not available ({e})", flush=True)
        return
    # --quick leaves out the reference's cached decoder: the brief's three are Flax, tutorial and reference.
    implementations = [i for i in IMPLEMENTATIONS if not (s.quick and i == "torch-reference-cached")]
    # The reference's beam search re-runs the prefix for one sentence at a time: minutes per call at batch 16
    # on 2 cores. So at most 3 timed calls, and --quick times one (after the warm-up one) and runs beam search
    # at batch 1 only.
    plan = [((1,), s.decode_batch_sizes), ((4,), s.decode_batch_sizes)]
    if s.quick:
        plan = [((1,), s.decode_batch_sizes), ((4,), tuple(b for b in s.decode_batch_sizes if b == 1) or
                                                     (min(s.decode_batch_sizes),))]
    for name in s.aux_presets:
        repeats = 1 if s.quick else min(3, s.repeats_for(name))
        reports = []
        for beam_sizes, batch_sizes in plan:
            try:
                reports.append(benchmark_decoding(name, batch_sizes=batch_sizes, beam_sizes=beam_sizes,
                                                  new_tokens=s.decode_new_tokens, vocab=s.vocab, repeats=repeats,
                                                  torch_threads=s.torch_threads,
                                                  implementations=implementations,
                                                  log=lambda line: print(f"  [{name}] {line}", flush=True)))
            except Exception as e:  # reported with the other failures; the remaining sections still run
                failures.append({"name": f"decode/{name} beam {beam_sizes[0]}",
                                 "error": f"{type(e).__name__}: {e}"})
                print(f"  failed: {type(e).__name__}: {e}", flush=True)
        if not reports:
            continue
        report = {"settings": reports[0]["settings"], "results": [r for rep in reports for r in rep["results"]]}
        settings = report["settings"]
        # Random weights have near-ties, so an implementation may pick other tokens than Flax: say where.
        differ = [f"{r['search']} batch {r['batch']} {r['implementation']} {100 * r['agreement']:.0f}%"
                  for r in report["results"] if r["agreement"] is not None and r["agreement"] < 1.0]
        note = (f"decode {name}: {settings['new_tokens']} new tokens per sentence from {settings['src_len']} "
                f"source tokens; tokens/s counts output tokens and a call includes encoding the sources; "
                f"tokens equal to Flax's: " + ("all" if not differ else "all but " + ", ".join(differ)))
        groups: dict[tuple[str, int], dict[str, dict]] = {}
        for row in report["results"]:
            search, batch, impl = row["search"], row["batch"], row["implementation"]
            produced = batch * settings["new_tokens"]
            fig = figure_from_summary(f"decode {name} {search} batch {batch}: {DECODE_LABELS.get(impl, impl)}",
                                      "tokens/s", row["seconds_min"], row["seconds_median"], repeats,
                                      lambda t, n=produced: n / t, section="decode", preset_name=name, note=note)
            fig["agreement_with_flax"] = row["agreement"]
            groups.setdefault((search, batch), {})[impl] = fig
        for figs in groups.values():
            flax = figs.get("flax-cached")
            for impl, fig in figs.items():
                if flax is not None and impl != "flax-cached":
                    add_ratio(flax, f"Flax/{impl}", ratio(flax, fig))
            figures.extend(figs.values())


# =============================================================================================================
# Section 5: pmap over simulated devices
# =============================================================================================================


def child_pmap(s: Settings) -> dict:
    """In a process that sees PMAP_DEVICES CPU devices: single-device jit and pmap over all of them, on the
    same global batch, interleaved."""
    import jax

    devices = jax.local_device_count()
    if devices < PMAP_DEVICES:
        raise RuntimeError(f"expected {PMAP_DEVICES} CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}), "
                           f"jax sees {devices}")
    config = model_config(s.presets[0], s.vocab)
    batch = make_batch(config, s.batch_size, s.length)
    params, _ = initial_params(config)
    failures: list[dict] = []
    runners, warmup_s = {}, {}
    for label, n in (("jit", 1), ("pmap", PMAP_DEVICES)):
        runner = JaxTrain(config, batch, params, n_devices=n)
        # At least two warm-up calls: pmap compiles a second time on its second call when the replicated input
        # state's sharding (from flax's replicate) differs from the sharding of the state it returns.
        warmup_s[label] = []
        for _ in range(max(2, s.warmup)):
            start = time.perf_counter()
            runner()
            warmup_s[label].append(time.perf_counter() - start)
        runners[label] = runner
    times = interleaved(runners, s.repeats_for(s.presets[0]), desc="pmap", failures=failures, context="pmap")
    return {"times": times, "warmup_s": warmup_s, "devices": devices, "failures": failures}


def section_pmap(s: Settings, figures: list, failures: list, state: dict) -> None:
    """pmap over simulated CPU devices vs jit on one, the same global batch (rows split over devices)."""
    if s.batch_size % PMAP_DEVICES:
        failures.append({"name": "pmap", "error": f"--batch-size {s.batch_size} is not divisible by "
                                                  f"{PMAP_DEVICES} devices"})
        return
    flags = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={PMAP_DEVICES}").strip()
    for name in s.aux_presets:
        print(f"  [{name}] jit vs pmap over {PMAP_DEVICES} simulated devices (subprocess)", flush=True)
        try:
            result = run_child(["--child", "pmap", *child_args(s, name), "--repeats", str(s.repeats_for(name)),
                                "--warmup", str(s.warmup)], child_env(XLA_FLAGS=flags))
        except Exception as e:
            failures.append({"name": f"pmap/{name}", "error": f"{type(e).__name__}: {e}"})
            continue
        failures.extend(result["failures"])
        figs = {}
        for label, times in result["times"].items():
            if not times:
                continue
            calls = ", ".join(f"{t:.1f}" for t in result["warmup_s"][label])
            note = (f"{label} {name}: global batch {s.batch_size} x {s.length} tokens; {PMAP_DEVICES} simulated CPU "
                    f"devices share the machine's {s.torch_threads} cores; untimed warm-up calls took {calls} s")
            devices = "1 device" if label == "jit" else f"{PMAP_DEVICES} devices"
            figs[label] = figure(f"{label} {name}: {devices}", "ms/step", times, lambda t: 1e3 * t,
                                 section="pmap", preset_name=name, note=note)
        if "jit" in figs and "pmap" in figs:
            add_ratio(figs["pmap"], "pmap/jit", ratio(figs["pmap"], figs["jit"]))
        figures.extend(figs.values())


# =============================================================================================================
# Output
# =============================================================================================================


def _number(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _ratios(fig: dict) -> str:
    return "; ".join(f"{k} {_number(v)}" for k, v in fig["ratios"].items())


SECTION_TITLES = {"train": "1. Training step (JAX / other: ms/step < 1 and tokens/s > 1 mean JAX is faster)",
                  "flops": "2. Achieved matmul GFLOP/s", "first-step": "3. Time to the first step (fresh process)",
                  "decode": "4. Decoding", "pmap": "5. pmap over simulated CPU devices vs jit"}


def machine_lines(result: dict) -> list[str]:
    m, st = result["machine"], result["settings"]
    libs = ", ".join(f"{k} {v}" for k, v in m["libraries"].items())
    return [f"machine: {m['cpu_model']} ({', '.join(m['cpu_features'])}), {m['cores']} cores, "
            f"{m['memory_gib']} GiB, {m['os']}",
            f"libraries: {libs}",
            f"date: {m['date']}; load average at start {m['load_average']}, at end {result['load_average_end']}",
            f"threads: torch.set_num_threads({st['torch_threads']}); XLA: its default (all cores)",
            f"training batch: {st['batch_size']} rows x {st['length']} tokens (source and target), vocabulary "
            f"{st['vocab']}, dropout 0.1, label smoothing 0.1",
            f"each figure: 'best' at the fastest and 'median' at the median of its n timed repeats (after "
            f"{st['warmup']} untimed warm-up step(s)): for a time the minimum, for a rate the maximum; "
            f"ratios are of medians"]


def text_table(result: dict) -> str:
    lines = machine_lines(result)
    for section in SECTIONS:
        rows = [f for f in result["figures"] if f["section"] == section]
        if not rows:
            continue
        lines += ["", SECTION_TITLES[section]]
        width = max(len(f["name"]) for f in rows)
        for f in rows:
            lines.append(f"  {f['name']:<{width}}  {f['unit']:>15}  best {_number(f['min']):>9}  "
                         f"median {_number(f['median']):>9}  (n={f['n']})  {_ratios(f)}")
        notes = sorted({f["note"] for f in rows if f["note"]})
        lines += [f"  note: {n}" for n in notes]
    if result["failures"]:
        lines += ["", "failures:"] + [f"  {f['name']}: {f['error']}" for f in result["failures"]]
    return "\n".join(lines)


def markdown_table(result: dict) -> str:
    lines = ["## Benchmarks", ""] + [f"- {line}" for line in machine_lines(result)]
    for section in SECTIONS:
        rows = [f for f in result["figures"] if f["section"] == section]
        if not rows:
            continue
        lines += ["", f"### {SECTION_TITLES[section]}", "", "| figure | unit | best | median | n | ratios |",
                  "|---|---|---:|---:|---:|---|"]
        for f in rows:
            lines.append(f"| {f['name']} | {f['unit']} | {_number(f['min'])} | {_number(f['median'])} | {f['n']} | "
                         f"{_ratios(f)} |")
        notes = sorted({f["note"] for f in rows if f["note"]})
        if notes:
            lines += [""] + [f"Note: {n}." for n in notes]
    if result["failures"]:
        lines += ["", "### Failures", ""] + [f"- {f['name']}: `{f['error']}`" for f in result["failures"]]
    return "\n".join(lines) + "\n"


# =============================================================================================================
# Main
# =============================================================================================================


SECTION_FUNCTIONS = {"train": section_train, "flops": section_flops, "first-step": section_first_step,
                     "decode": section_decode, "pmap": section_pmap}


def main(argv: Sequence[str] | None = None) -> int:
    args, s = parse_args(argv)
    isolate_caches()
    if args.child == "first-step":
        print(json.dumps(child_first_step(args.framework, s)))
        return 0
    if args.child == "pmap":
        print(json.dumps(child_pmap(s)))
        return 0

    machine = machine_info()
    set_torch_threads(s.torch_threads)
    figures: list[dict] = []
    failures: list[dict] = []
    state: dict = {}
    started = time.perf_counter()
    for section in SECTIONS:
        if section not in s.sections:
            continue
        print(f"== {SECTION_TITLES[section]}", flush=True)
        section_start = time.perf_counter()
        SECTION_FUNCTIONS[section](s, figures, failures, state)
        print(f"   ({time.perf_counter() - section_start:.0f} s)", flush=True)
    result = {
        "schema": SCHEMA,
        "machine": machine,
        "load_average_end": machine_info()["load_average"],
        "settings": {**dataclasses.asdict(s), "torch_variants": {v: TORCH_VARIANTS[v] for v in s.torch_variants}},
        "definitions": {
            "min": "the figure at the fastest timed repeat (for a time, ms or s, its minimum; for a rate, "
                   "tokens/s or GFLOP/s, its maximum: higher_is_better says which)",
            "median": "the figure at the median duration of the timed repeats",
            "seconds": "the durations themselves: min, median, max over the n timed repeats",
            "ratios": "each ratio is this figure's median over the named other figure's median (x 100 for %)"},
        "figures": figures,
        "failures": failures,
        "wall_time_s": time.perf_counter() - started,
    }
    print()
    print(text_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(result), encoding="utf-8")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
