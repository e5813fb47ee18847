"""Section "gpu" of the benchmark (`benchmarks/run.py --sections gpu`): the training step in every precision, JAX
beside the PyTorch twin on the same device, as tokens/s and as a share of the device's matmul peak; decoding in
float32 and bfloat16; the attention-kernel A/B; compilation cold and warm. Written for a GPU (benchmarks/gpu.sh
runs it there, docs/gpu-tpu.md); it runs on a CPU too (the smoke test), where there is no TF32, no cuDNN and
no known peak.

Parts (--gpu-parts):
  train    one training step of each variant, interleaved as in section 1 (same weights, batch, loss, dropout):
             JAX float32               XLA's default matmul precision: TF32 on an Ampere or Hopper GPU
             JAX float32 highest       jax.default_matmul_precision("highest"): true float32 matmuls (GPU only)
             JAX bfloat16              config.dtype="bfloat16" (docs/gpu-tpu.md's policy), explicit attention
             JAX bfloat16 + cudnn      the same with attention_kernel="cudnn" ("xla" on a CPU, not with --quick)
             torch float32             the twin on the same device, eager, TF32 off
             torch TF32                the twin, eager, TF32 matmuls (GPU only)
             torch bf16 autocast       the float32 twin under torch.autocast(bfloat16): torch's usual way
             torch bf16 twin           the twin with config.dtype="bfloat16": JAX's policy, explicit casts
             torch.compile bf16 autocast   the model under torch.compile with autocast (not with --quick)
           every torch variant with fused Adam; --gpu-variants picks some. The batch fills every position (no
           padding, as packed rows). Figures: ms/step, target tokens/s, matmul TFLOP/s (counted from the shapes:
           flops.train_step_matmul_flops), its share of the device's dense bf16 peak (MFU) and, for the other
           precisions, of that precision's peak (machine.KNOWN_PEAKS: TF32 for JAX's default float32 on a GPU and
           torch TF32, FP32 for "highest" and torch float32). Ratios: bfloat16 over JAX's default float32
           (the goal: >= 2x on the GPU), JAX over the twin's fastest mode of the same precision (goal
           1.5x), each attention kernel over the explicit path (keep a kernel only where this is > 1).
  decode   greedy and beam 4 search (greedy only with --quick) in float32 and bfloat16: JAX's cached jitted search,
           and the twin's cached greedy decoder on the same device; exactly --decode-new-tokens tokens per
           sentence (as section 4).
  compile  the training step's trace and compilation in fresh processes (child_compile), float32 and bfloat16
           (bfloat16 only with --quick): cold (an empty persistent compilation cache) and warm (a second process
           reading the cache the first wrote), with the number of cache files.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from benchmarks.children import child_args, child_env, run_child
from benchmarks.flops import train_step_matmul_flops
from benchmarks.machine import known_peak
from benchmarks.report import add_ratio, figure, ratio
from benchmarks.train_step import JaxTrain, TorchTrain, interleaved, training_batch
from tests.helpers.batches import target_tokens
from tests.helpers.configs import preset_config
from tests.helpers.twins import ported_params

if TYPE_CHECKING:
    from benchmarks.common import Settings

GPU_PARTS = ("train", "decode", "compile")
BEAM = 4


def _devices() -> tuple[str, str, bool]:
    """(JAX's device kind, e.g. "NVIDIA H100 80GB HBM3" or "cpu"; torch's device; whether JAX runs on a GPU)."""
    import jax
    import torch

    device = jax.devices()[0]
    return device.device_kind, "cuda" if torch.cuda.is_available() else "cpu", device.platform == "gpu"


@contextlib.contextmanager
def _no_context():
    yield


# --gpu-variants: the training step's variants by key, each with its label in the figures (default: every one that
# applies, as listed above).
GPU_VARIANTS = {
    "jax-float32": "JAX float32",
    "jax-highest": "JAX float32 highest",
    "jax-bfloat16": "JAX bfloat16",
    "jax-kernel": "JAX bfloat16 + {kernel}",  # the fused attention kernel: cudnn on a GPU, xla elsewhere
    "torch-float32": "torch float32",
    "torch-tf32": "torch TF32",
    "torch-autocast": "torch bf16 autocast",
    "torch-bfloat16": "torch bf16 twin",
    "torch-compile": "torch.compile bf16 autocast",
}


def _labelled(variants: dict, wanted: tuple[str, ...] | None, kernel: str = "") -> dict:
    """{GPU_VARIANTS key: value} -> {label: value}, keeping the keys in `wanted` (None: all of them)."""
    return {GPU_VARIANTS[k].format(kernel=kernel): v for k, v in variants.items() if wanted is None or k in wanted}


def _jax_variants(config, on_gpu: bool, quick: bool, wanted=None) -> dict[str, tuple]:
    """label -> (config, matmul precision context or None, peak key)."""
    bf16 = config.replace(dtype="bfloat16")
    kernel = "cudnn" if on_gpu and config.head_dim % 8 == 0 else "xla"  # cuDNN needs a multiple of 8
    variants = {"jax-float32": (config, None, "tf32" if on_gpu else "float32")}
    # On a CPU float32 matmuls are full float32 already: "highest" would time the same program again; on a GPU its
    # compilation alone takes over a minute on an H100, so --quick leaves it out.
    if on_gpu and (not quick or wanted):
        variants["jax-highest"] = (config, "highest", "float32")
    variants["jax-bfloat16"] = (bf16, None, "bfloat16")
    if not quick or wanted:  # the A/B that decides the default kernel, not a smoke test's: cuDNN's fails on CUDA 13
        variants["jax-kernel"] = (bf16.replace(attention_kernel=kernel), None, "bfloat16")
    return _labelled(variants, wanted, kernel)


def _torch_variants(config, on_gpu: bool, quick: bool, wanted=None) -> dict[str, tuple]:
    """label -> (config, TorchTrain variant, autocast dtype or None, TF32 on?, peak key)."""
    import torch

    variants = {"torch-float32": (config, "fused", None, False, "float32")}
    if on_gpu:
        variants["torch-tf32"] = (config, "fused", None, True, "tf32")
    variants["torch-autocast"] = (config, "fused", torch.bfloat16, False, "bfloat16")
    variants["torch-bfloat16"] = (config.replace(dtype="bfloat16"), "fused", None, False, "bfloat16")
    if not quick or wanted:
        variants["torch-compile"] = (config, "compile", torch.bfloat16, False, "bfloat16")
    return _labelled(variants, wanted)


def _with_precision(runner: Callable, precision: str | None) -> Callable:
    """The runner called under jax.default_matmul_precision(precision) (part of jit's cache key: its own program)."""
    import jax

    def run():
        with jax.default_matmul_precision(precision) if precision else _no_context():
            return runner()

    return run


def section_gpu(s: Settings, figures: list, failures: list, state: dict) -> None:
    kind, torch_device, on_gpu = _devices()
    peak = known_peak(kind)
    print(f"  JAX on {kind}; the twin on {torch_device}; known peak: {peak[0] if peak else 'none'}", flush=True)
    parts = {"train": _train, "decode": _decode, "compile": _compile}
    for part in s.gpu_parts:
        try:
            parts[part](s, figures, failures, kind, torch_device, on_gpu, peak)
        except Exception as e:  # one part's failure must not cost the others
            failures.append({"name": f"gpu/{part}", "error": f"{type(e).__name__}: {e}"})
            print(f"    failed: {type(e).__name__}: {e}", flush=True)


# =============================================================================================================
# train
# =============================================================================================================


def _train(s, figures, failures, kind, torch_device, on_gpu, peak) -> None:
    for name in s.presets:
        config = preset_config(name, s.vocab)
        # Every position a real token, as packed batches are: the counted FLOPs are all useful work.
        batch = training_batch(config, s.batch_size, s.length, layout="full")
        tokens = target_tokens(batch, config.pad_id)
        flops = train_step_matmul_flops(config, s.batch_size, s.length, s.length)["train_step"]
        params, numpy_params = ported_params(config)
        builders, peak_keys = {}, {}
        for label, (cfg, precision, key) in _jax_variants(config, on_gpu, s.quick, s.gpu_variants).items():
            builders[label] = lambda cfg=cfg, precision=precision: _with_precision(
                JaxTrain(cfg, batch, params), precision
            )
            peak_keys[label] = key
        for label, (cfg, variant, autocast, tf32, key) in _torch_variants(
            config, on_gpu, s.quick, s.gpu_variants
        ).items():
            builders[label] = lambda cfg=cfg, variant=variant, autocast=autocast, tf32=tf32: TorchTrain(
                cfg, batch, numpy_params, variant, device=torch_device, autocast=autocast, tf32=tf32
            )
            peak_keys[label] = key
        runners, first_call = {}, {}
        for label, build in builders.items():
            print(f"  [{name}] {label}: building and warming up ({s.warmup} step(s))", flush=True)
            try:
                runner = build()
                for i in range(s.warmup):
                    start = time.perf_counter()
                    runner()
                    if i == 0:
                        first_call[label] = time.perf_counter() - start
            except Exception as e:  # e.g. cuDNN refusing a shape, torch.compile without a toolchain
                failures.append({"name": f"gpu/train/{name}: {label}", "error": f"{type(e).__name__}: {e}"})
                print(f"    failed: {type(e).__name__}: {e}", flush=True)
                continue
            runners[label] = runner
        times = interleaved(runners, s.repeats_for(name), desc=f"gpu {name}", failures=failures, context="gpu")
        note = (
            f"gpu {name}: batch {s.batch_size} x {s.length} tokens (src and tgt), {tokens} real target tokens, vocab "
            f"{s.vocab}, dropout 0.1; JAX on {kind}, the twin on {torch_device}; matmul FLOPs per step "
            f"{flops / 1e12:.3f} T (counted from the shapes); peaks: "
            + (
                f"{peak[0]} dense bf16/TF32/FP32 {', '.join(f'{v / 1e12:g}' for v in peak[1].values())} TFLOP/s"
                if peak
                else "none known for this device"
            )
        )
        step, rate, tflops = {}, {}, {}
        for label, seconds in times.items():
            common = dict(section="gpu", preset_name=name, note=note)
            step[label] = figure(f"gpu {name} step: {label}", "ms/step", seconds, lambda t: 1e3 * t, **common)
            rate[label] = figure(
                f"gpu {name} throughput: {label}", "target tokens/s", seconds, lambda t: tokens / t, **common
            )
            tflops[label] = figure(
                f"gpu {name} matmul: {label}", "TFLOP/s", seconds, lambda t: flops / t / 1e12, **common
            )
            if peak is not None:  # model FLOP utilisation: against the dense bf16 peak, whatever the precision
                add_ratio(tflops[label], "MFU %", 100 * tflops[label]["median"] * 1e12 / peak[1]["bfloat16"])
                if peak_keys[label] != "bfloat16":  # and against the peak of the variant's own matmul precision
                    add_ratio(
                        tflops[label],
                        f"% of {peak[0]} {peak_keys[label]} peak",
                        100 * tflops[label]["median"] * 1e12 / peak[1][peak_keys[label]],
                    )
        _train_ratios(rate, peak_keys)
        for label, seconds in first_call.items():
            if label.startswith("JAX") or "compile" in label:
                figures.append(
                    figure(
                        f"gpu {name} first call (compile + step): {label}",
                        "s",
                        [seconds],
                        section="gpu",
                        preset_name=name,
                        note="in the benchmark process, persistent compilation cache off",
                    )
                )
        for figs in (step, rate, tflops):
            figures.extend(figs.values())


def _train_ratios(rate: dict, peak_keys: dict) -> None:
    """bfloat16 over float32, JAX over the twin's fastest mode of the same matmul precision, kernels over explicit."""
    jax_f32, jax_bf16 = rate.get("JAX float32"), rate.get("JAX bfloat16")
    if jax_bf16 is not None:
        add_ratio(jax_bf16, "JAX bfloat16/JAX float32", ratio(jax_bf16, jax_f32))
    for label, fig in rate.items():
        if not label.startswith("JAX"):
            continue
        same = [f for other, f in rate.items() if not other.startswith("JAX") and peak_keys[other] == peak_keys[label]]
        if same:
            fastest = max(same, key=lambda f: f["median"])
            add_ratio(fig, f"JAX/{fastest['name'].split(': ', 1)[1]}", ratio(fig, fastest))
        if label.startswith("JAX bfloat16 + "):
            add_ratio(fig, "kernel/explicit attention", ratio(fig, jax_bf16))


# =============================================================================================================
# decode
# =============================================================================================================


def _decode(s, figures, failures, kind, torch_device, on_gpu, peak) -> None:
    import torch

    from jax_transformer.decoding import decoders
    from tests.helpers.twins import torch_twin
    from torch_reference import decoding as torch_decoding

    new_tokens, src_len = s.decode_new_tokens, 24
    fixed = dict(max_len_a=0, max_len_b=new_tokens, min_len=new_tokens)  # exactly new_tokens tokens per sentence
    for name in s.aux_presets:
        base = preset_config(name, s.vocab)
        base = base.replace(max_len=max(base.max_len, new_tokens, src_len))
        params, _ = ported_params(base)
        for batch in s.decode_batch_sizes:
            src = np.random.default_rng(0).integers(3, s.vocab, (batch, src_len)).astype(np.int32)
            src_t = torch.from_numpy(src).long().to(torch_device)
            runners = {}
            for dtype in ("float32", "bfloat16"):
                config = base.replace(dtype=dtype)
                model = torch_twin(config, params, device=torch_device)
                runners[f"JAX greedy {dtype}"] = lambda c=config: decoders.greedy_search(params, c, src, **fixed)
                if not s.quick:
                    runners[f"JAX beam {BEAM} {dtype}"] = lambda c=config: decoders.beam_search(
                        params, c, src, beam_size=BEAM, alpha=0.6, **fixed
                    )
                runners[f"torch greedy {dtype} (cached)"] = lambda m=model: torch_decoding.greedy_search(
                    m, src_t, use_cache=True, **fixed
                )[0].cpu()
            for label, run in runners.items():  # untimed: compiles JAX's searches
                print(f"  [{name}] decode batch {batch}: {label}: warming up", flush=True)
                run()
            times = interleaved(
                runners, s.repeats_for(name), desc=f"gpu decode {name}", failures=failures, context="gpu/decode"
            )
            note = (
                f"gpu decode {name}: {new_tokens} new tokens per sentence from {src_len} source tokens, tokens/s "
                f"counts output tokens (a call includes encoding); JAX on {kind}, the twin on {torch_device}"
            )
            figs = {
                label: figure(
                    f"gpu decode {name} batch {batch}: {label}",
                    "tokens/s",
                    seconds,
                    lambda t: batch * new_tokens / t,
                    section="gpu",
                    preset_name=name,
                    note=note,
                )
                for label, seconds in times.items()
            }
            for dtype in ("float32", "bfloat16"):
                greedy = figs.get(f"JAX greedy {dtype}")
                if greedy is not None:
                    add_ratio(
                        greedy, f"JAX/torch greedy {dtype}", ratio(greedy, figs.get(f"torch greedy {dtype} (cached)"))
                    )
            for search in ("greedy", f"beam {BEAM}"):
                fig = figs.get(f"JAX {search} bfloat16")
                if fig is not None:
                    add_ratio(fig, "bfloat16/float32", ratio(fig, figs.get(f"JAX {search} float32")))
            figures.extend(figs.values())


# =============================================================================================================
# compile
# =============================================================================================================


def child_compile(s: Settings, dtype: str, cache_dir: str) -> dict:
    """In a fresh process, with JAX's persistent compilation cache in `cache_dir` (every program cached, however
    quickly it compiled): trace and compile the training step of the first preset in `dtype`."""
    import jax

    from jax_transformer.training.trainer import OptimConfig, abstract_train_state, make_train_step

    jax.config.update("jax_enable_compilation_cache", True)  # run.py's isolate_caches turned it off
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    config = preset_config(s.presets[0], s.vocab).replace(dtype=dtype)
    batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in training_batch(config, s.batch_size, s.length).items()
    }
    opt = OptimConfig()
    start = time.perf_counter()
    lowered = make_train_step(config, opt).lower(abstract_train_state(config, opt), batch)
    traced = time.perf_counter()
    lowered.compile()
    compiled = time.perf_counter()
    return {
        "trace_s": traced - start,
        "compile_s": compiled - traced,
        "cache_files": sum(1 for p in Path(cache_dir).rglob("*") if p.is_file()),
    }


def _compile(s, figures, failures, kind, torch_device, on_gpu, peak) -> None:
    for name in s.presets:
        for dtype in ("bfloat16",) if s.quick else ("float32", "bfloat16"):
            cache = tempfile.mkdtemp(prefix="benchmark-jax-cache-")
            try:
                runs = {}
                for when in ("cold", "warm"):  # the warm process reads what the cold one wrote
                    print(f"  [{name}] compile {dtype}, {when} cache (fresh process)", flush=True)
                    args = ["--child", "compile", "--dtype", dtype, "--compile-cache", cache, *child_args(s, name)]
                    runs[when] = run_child(args, child_env())
            except Exception as e:
                failures.append({"name": f"gpu/compile/{name} {dtype}", "error": f"{type(e).__name__}: {e}"})
                continue
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            figs = {
                when: figure(
                    f"gpu {name} compile train step {dtype}: {when} cache",
                    "s",
                    [r["compile_s"]],
                    section="gpu",
                    preset_name=name,
                    note=f"gpu {name} compile: a fresh process each, JAX on {kind}; trace time apart "
                    f"(cold {runs['cold']['trace_s']:.1f} s, warm {runs['warm']['trace_s']:.1f} s); "
                    f"persistent cache files after the cold run: {runs['cold']['cache_files']}",
                )
                for when, r in runs.items()
            }
            add_ratio(figs["cold"], "cold/warm", ratio(figs["cold"], figs["warm"]))
            figures.extend(figs.values())
