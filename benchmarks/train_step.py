"""Section 1 of the benchmark: one training step, timed in every framework on the same batch and weights.

JaxTrain is the project's compiled step (jax_transformer.training.trainer.make_train_step: jit, pmap or sharded jit,
with or without gradient accumulation, placed by jax_transformer.training.distributed.DataParallel as a training run
places it). TorchTrain is the PyTorch reference step (torch_reference.training.train_step) with one of Adam's
implementations: the default (a for-loop over parameters on CPU), foreach and fused, run eagerly, or the model under
torch.compile with the fused Adam (TORCH_VARIANTS). All start from the same weights (the Flax initialisation, ported)
and use the same batch, loss, label smoothing, schedule and dropout rate, so they do the same work.

section_train reports ms/step and target tokens/s at the fastest and the median repeat, JAX's ratios to each
torch variant, and the first call of a jitted or torch.compiled step (tracing and compilation) apart from the
step time. The variants are timed by `interleaved`, which every timed section uses: one call of each per round,
the order rotating every round, so that load from other processes on a shared machine hits all of them alike.
torch runs with one intra-op thread per core (set_torch_threads), as XLA's CPU client uses all cores by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.report import add_ratio, figure, ratio
from jax_transformer.settings.config import TransformerConfig
from tests.helpers.batches import make_batch, target_tokens
from tests.helpers.configs import preset_config
from tests.helpers.twins import ported_params

if TYPE_CHECKING:
    from benchmarks.common import Settings

TORCH_VARIANTS = {  # variant -> how the PyTorch reference step is run
    "default": "torch eager, Adam (default: for-loop on CPU)",
    "foreach": "torch eager, Adam(foreach=True)",
    "fused": "torch eager, Adam(fused=True)",
    "compile": "torch.compile(model), Adam(fused=True)",
}
JAX_LABEL = "JAX jit"


def set_torch_threads(n: int) -> None:
    """torch gets one intra-op thread per core, as XLA's CPU client uses all cores by default."""
    import torch

    torch.set_num_threads(n)


def interleaved(
    runners: Mapping[str, Callable[[], Any]], repeats: int, *, desc: str, failures: list[dict], context: str
) -> dict[str, list[float]]:
    """Runs every runner once per round, `repeats` rounds, rotating the order each round so that no runner
    always follows the same one; returns {name: [seconds, ...]}. A runner that raises is reported in
    `failures` and dropped; the others go on."""
    from tqdm.auto import tqdm

    names = list(runners)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in tqdm(range(repeats), desc=desc, unit="round", leave=False, dynamic_ncols=True):
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
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


def training_batch(
    config: TransformerConfig, batch_size: int, length: int, layout: str = "drawn"
) -> dict[str, np.ndarray]:
    """The benchmark's batch (seed 0), as the data pipeline makes them: src (B, L) words, tgt_in (B, L) = BOS +
    words, tgt_out (B, L) = words + EOS, padded with 0. By default each row's source and target lengths are drawn in
    [L/2, L] (tests/helpers/batches.py's make_batch, layout "drawn"), so some positions are padding and
    `target_tokens` (non-pad tgt_out) is less than B * L; layout "full" fills every position, as packed rows do."""
    return make_batch(config, 0, batch_size, length, length, layout=layout, padding_row=False, src_eos=False)


class JaxTrain:
    """The project's compiled step (jax_transformer.training.trainer.make_train_step; its state donated from call to
    call off the CPU, `training.state_donation`).
    `parallel` ("jit", "pmap", "sharded") and `accumulate` as in `train.py train --parallel --accumulate`."""

    def __init__(
        self,
        config: TransformerConfig,
        batch: Mapping[str, np.ndarray],
        params,
        parallel: str = "jit",
        accumulate: int = 1,
    ):
        import jax

        from jax_transformer.training.distributed import DataParallel
        from jax_transformer.training.trainer import OptimConfig, create_train_state

        opt = OptimConfig()  # the paper's Adam and schedule, label smoothing 0.1
        devices = DataParallel(parallel, accumulate)
        self.n_devices = devices.n_devices
        self.state = devices.place_state(create_train_state(config, opt, params=params))
        self.step_fn = devices.make_step(config, opt)
        # Placed on the device(s) once, as the torch batch is built once: the step is timed, not the transfer.
        batch = devices.place_batch({k: np.asarray(v) for k, v in batch.items()})
        if parallel == "jit":
            self.batch = jax.device_put(batch)
        elif parallel == "pmap":  # an identity pmap leaves row block i on device i (jax.device_put_sharded is gone)
            self.batch = jax.pmap(lambda x: x)(batch)
        else:  # already a global array split by rows over the mesh
            self.batch = batch

    def __call__(self):
        import jax

        self.state, sums = self.step_fn(self.state, self.batch)
        jax.block_until_ready((self.state, sums))  # dispatch is asynchronous: wait for the result
        return sums

    def temp_memory(self) -> int:
        """Bytes of temporary buffers (activations, gradients) XLA allocates for one compiled step."""
        return int(self.step_fn.lower(self.state, self.batch).compile().memory_analysis().temp_size_in_bytes)

    def cost_analysis(self) -> dict[str, float]:
        """XLA's own count for the compiled step (the compilation is cached by now, so this is cheap)."""
        analysis = self.step_fn.lower(self.state, self.batch).compile().cost_analysis()
        if isinstance(analysis, (list, tuple)):  # older jax: one dict per device program
            analysis = analysis[0]
        return dict(analysis or {})


class TorchTrain:
    """The PyTorch reference step (torch_reference.training.train_step) with one Adam implementation, eager or
    with the model under torch.compile. Same weights, batch, loss, schedule and dropout rate as the JAX step."""

    def __init__(
        self,
        config: TransformerConfig,
        batch: Mapping[str, np.ndarray],
        numpy_params,
        variant: str,
        *,
        device: str = "cpu",
        autocast=None,
        tf32: bool | None = None,
    ):
        """numpy_params: a PyTorch state dict of numpy arrays (the JAX model's weights), or None for torch's
        own initialisation. device: where the twin runs; autocast: a dtype for torch.autocast around the forward
        pass (benchmarks/gpu.py); tf32: allow TF32 matmuls on CUDA during this step (None: leave the setting)."""
        import torch

        from jax_transformer.training.trainer import OptimConfig
        from torch_reference import Transformer, load_numpy_state_dict
        from torch_reference.training import make_optimizer

        opt = OptimConfig()
        model = Transformer(config).to(device)
        if numpy_params is not None:
            load_numpy_state_dict(model, numpy_params)
        model.train()  # dropout on, as in the JAX step
        # The same optimiser and schedule in every variant, with torch's Adam implementation chosen explicitly.
        kind = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}, "compile": {"fused": True}}
        self.optimizer, self.scheduler = make_optimizer(model, opt, **kind[variant])
        # torch.compile compiles lazily, at the first call; the forward, the loss's backward (AOTAutograd) and
        # later calls all run compiled code. The optimiser step stays eager (fused).
        self.model = torch.compile(model) if variant == "compile" else model
        self.batch = {k: torch.from_numpy(np.asarray(v, dtype=np.int64)).to(device) for k, v in batch.items()}
        self.opt, self.autocast, self.tf32 = opt, autocast, tf32

    def __call__(self):
        import torch

        from torch_reference.training import train_step

        if self.tf32 is not None:  # a process-wide switch: set for every call, as variants are interleaved
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.tf32
        # Returns Python floats, so the step has finished when this returns (on a GPU too: they are copied back).
        return train_step(self.model, self.optimizer, self.scheduler, self.batch, self.opt, autocast=self.autocast)


def section_train(s: Settings, figures: list, failures: list, state: dict) -> None:
    """JAX jit vs each torch variant on the same batch: ms/step, target tokens/s, compile time of the first call."""
    for name in s.presets:
        config = preset_config(name, s.vocab)
        batch = training_batch(config, s.batch_size, s.length)
        tokens = target_tokens(batch, config.pad_id)
        params, numpy_params = ported_params(config)
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
        times = interleaved(
            runners, s.repeats_for(name), desc=f"train {name}", failures=failures, context=f"train/{name}"
        )
        state.setdefault("train", {})[name] = {
            "times": times,
            "tokens": tokens,
            "runners": runners,
            "batch": batch,
            "config": config,
        }
        note = (
            f"batch {s.batch_size} x {s.length} tokens (src and tgt), {tokens} real target tokens, "
            f"vocab {s.vocab}, dropout 0.1, label smoothing 0.1"
        )
        step_figs, tok_figs = {}, {}
        for label, seconds in times.items():
            step_figs[label] = figure(
                f"train step {name}: {label}",
                "ms/step",
                seconds,
                lambda t: 1e3 * t,
                section="train",
                preset_name=name,
                note=note,
            )
            tok_figs[label] = figure(
                f"train throughput {name}: {label}",
                "target tokens/s",
                seconds,
                lambda t: tokens / t,
                section="train",
                preset_name=name,
                note=note,
            )
        for figs in (step_figs, tok_figs):
            for label, fig in figs.items():
                if label != JAX_LABEL:
                    add_ratio(figs.get(JAX_LABEL, {"ratios": {}}), f"JAX/{label}", ratio(figs.get(JAX_LABEL), fig))
            figures.extend(figs.values())
        # The first call of a jitted / torch.compiled function compiles: reported apart from the step time.
        compiled = {label: t for label, t in first_call.items() if label == JAX_LABEL or "compile" in label}
        compile_figs = {
            label: figure(
                f"first call (compile + step) {name}: {label}",
                "s",
                [t],
                section="train",
                preset_name=name,
                note="in the benchmark process (imports and other models already loaded)",
            )
            for label, t in compiled.items()
        }
        for label, fig in compile_figs.items():
            if label != JAX_LABEL:
                add_ratio(
                    compile_figs.get(JAX_LABEL, {"ratios": {}}), f"JAX/{label}", ratio(compile_figs.get(JAX_LABEL), fig)
                )
        figures.extend(compile_figs.values())
