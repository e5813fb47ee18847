"""Train a model, or continue one (`train`, the default sub-command)."""

from __future__ import annotations

import argparse
import time

from jax_transformer.cli import flags, output


def add(sub) -> None:
    from jax_transformer.settings.config import (
        RECIPES,
        DataConfig,
        DecodeConfig,
        LoopConfig,
        OptimConfig,
        ParallelConfig,
        TransformerConfig,
    )

    t = sub.add_parser(
        "train",
        help="train a model (the default sub-command)",
        description="Train a model. Without data files: the built-in English->French numbers task (tiny model, "
        "~2 minutes on 2 CPU cores, with its own defaults: the recipe "
        "jax_transformer/settings/configs/recipes/numbers.json).",
    )
    g = t.add_argument_group("run")
    g.add_argument(
        "--run-dir",
        metavar="DIR",
        help="where checkpoints, metrics.jsonl, loss_curve.png and tokenizer.model go (default runs/<date-time>)",
    )
    g.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the run in DIR from its newest intact checkpoint, exactly (damaged newer ones are moved to "
        "DIR/checkpoints-damaged with a warning)",
    )
    g.add_argument(
        "--strict-resume",
        action="store_true",
        help="with --resume: stop with an error if the newest checkpoint is damaged, instead of falling back",
    )
    g.add_argument(
        "--init-from-torch",
        metavar="FILE",
        help="start from the weights of a PyTorch file, torch.save or safetensors (from `train.py export`, or a "
        "bare torch_reference state_dict described by the model flags)",
    )
    g.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the best checkpoint of a run directory (e.g. one `train.py import` wrote from a pretrained "
        "model): its weights, config, tokenizer and decoding; the data is encoded with its tokenizer",
    )
    g.add_argument(
        "--preset",
        choices=("tiny", "small", "base"),
        help="model size: tiny (2+2 layers, d_model 32), small (3+3, 256), base (6+6, 512, the paper's); model "
        "flags override its fields (default: the recipe's, else tiny for the numbers task, small for files)",
    )
    g.add_argument(
        "--recipe",
        metavar="NAME",
        help="a named set of settings (jax_transformer/settings/configs/recipes/NAME.json) under the flags given: "
        + "; ".join(f"{name}: {recipe['about']}" for name, recipe in sorted(RECIPES.items()))
        + "; or a recipe JSON file of the same form (default: numbers without data files, none with them)",
    )
    g.add_argument(
        "--seed",
        type=flags.number(int, 0, 2**32),
        metavar="N",
        help="seed of initialisation, dropout and data order, a 32-bit number (default 0)",
    )
    g.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="where JAX computes on the CPU: keep the memory a training step frees for the next step (glibc's "
        "malloc: one arena, no mmap, no trimming) instead of returning it to the system and faulting it back in "
        "every step, a tenth of a small step (jax_transformer.training.host_memory). The process's resident memory "
        "then stays near its peak: turn it off where memory is tight or several processes share the machine "
        "(default on)",
    )
    flags.add_settings(t, DataConfig, "data", "data (UTF-8 text, one sentence per line; or source<TAB>target lines)")
    flags.add_settings(
        t,
        TransformerConfig,
        "model",
        "model (TransformerConfig; defaults: the preset's)",
        skip=("src_vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id"),  # the tokenizer's
    )
    flags.add_settings(t, OptimConfig, "optim", "optimiser (Adam, the paper's schedule, label smoothing)")
    flags.add_settings(t, LoopConfig, "loop", "run loop: steps, evaluation, checkpoints")
    flags.add_settings(t, DecodeConfig, "decode", "decoding rules of the evaluations")
    flags.add_settings(
        t,
        ParallelConfig,
        "parallel",
        "devices and processes (docs/scaling.md): every process of a multi-process run gets the same flags "
        "except --process-id, and sees the same data files and run directory",
    )
    t.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.training import host_memory

    if args.keep_freed_memory:  # before JAX starts its threads; only where JAX computes on the CPU
        host_memory.keep_freed_memory()
    from jax_transformer.training import run

    result = run.train(
        run_dir=args.run_dir,
        resume=args.resume,
        strict_resume=args.strict_resume,
        init_from_torch=args.init_from_torch,
        preset_name=args.preset,
        seed=args.seed,
        recipe=args.recipe,
        init_from=args.init_from,
        start_time=start_time,
        print_fn=output.say,
        **{group: flags.given(args, group) for group in ("model", "data", "optim", "loop", "parallel", "decode")},
    )
    output.say(
        f"done: step {result.step} ({result.stopped_by}), {(time.time() - start_time) / 60:.1f} minutes; "
        f"checkpoints in {result.checkpoint_dir}; best step {result.best_step} ({result.best_by}), the one evaluate, "
        f"translate and export use by default"
    )
    if result.curve is not None:
        output.say(f"loss curve: {result.curve}")
    if result.stopped_by.startswith("SIG"):
        import signal

        return 128 + int(getattr(signal, result.stopped_by))
    return 0
