"""What the benchmark's sections share with its command line (benchmarks/run.py) without importing it back: the
settings of one benchmark run."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Settings:
    presets: tuple[str, ...]  # model sizes for the train, flops and first-step sections
    aux_presets: tuple[str, ...]  # model sizes for the decode, pmap, accumulate and multihost sections
    sections: tuple[str, ...]
    gpu_parts: tuple[str, ...]  # of the gpu section: train, decode, compile
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
    gpu_variants: tuple[str, ...] | None = None  # the gpu section's training-step variants (None: every one)
    freed_memory_kept: bool = (
        False  # glibc keeps what the process frees (jax_transformer.training.host_memory), as in training
    )

    def repeats_for(self, preset_name: str) -> int:
        return self.repeats.get(preset_name, min(self.repeats.values()))
