"""A checkpoint's weights for PyTorch, transformers or peft (`export`)."""

from __future__ import annotations

from jax_transformer.cli import flags, output


def add(sub) -> None:
    x = sub.add_parser("export", help="write a checkpoint's weights as a PyTorch file for torch_reference")
    flags.checkpoint_flags(x)
    x.add_argument(
        "--output",
        required=True,
        metavar="FILE",
        help="the file to write: torch.save of {format, config (JSON), state_dict, tokenizer}, or a "
        "safetensors file (no pickle) with the config and tokenizer in its metadata",
    )
    x.add_argument(
        "--format",
        choices=("torch", "safetensors", "transformers", "peft"),
        help="torch or safetensors: a weight file for torch_reference (default: safetensors for a .safetensors name, "
        "torch otherwise); transformers: a directory MarianMTModel (or, for a model imported from FSMT or fairseq, "
        "FSMTForConditionalGeneration; M2M-100/NLLB, mBART as imported) and its tokenizer load with from_pretrained; "
        "peft: a LoRA run's adapters alone, a directory peft.PeftModel.from_pretrained loads on the transformers "
        "model the run was imported from",
    )
    x.add_argument(
        "--merge-lora",
        action="store_true",
        help="a LoRA run's adapters folded into the weights (W + A B alpha / r, peft's merge_and_unload) for "
        "--format transformers, torch or safetensors",
    )
    x.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.errors import UsageError
    from jax_transformer.interop import export

    loaded = flags.load(args, merge_adapters=args.format != "peft" and args.merge_lora)
    if args.format == "peft":
        from jax_transformer.checkpoint.settings import stored_settings
        from jax_transformer.interop import hub

        path = hub.export_peft(loaded.params, loaded.config, stored_settings(loaded), args.output)
        output.say(
            f"wrote {path}: the LoRA adapters of step {loaded.step} (rank {loaded.config.lora_rank}) for "
            f"peft.PeftModel.from_pretrained"
        )
        return 0
    if loaded.config.lora_rank:
        raise UsageError(
            "this run has LoRA adapters: --merge-lora folds them into the weights, --format peft writes them alone"
        )
    if args.format == "transformers":
        from jax_transformer.checkpoint.settings import stored_settings
        from jax_transformer.interop import hub

        settings = stored_settings(loaded)
        path, kind = hub.export_transformers(loaded.params, loaded.config, loaded.tokenizer, settings, args.output)
        model = hub.MODEL_CLASSES[kind]
        output.say(f"wrote {path}: step {loaded.step} as a transformers {model} with its tokenizer (from_pretrained)")
        return 0
    path = export.export_weights(args.output, loaded.params, loaded.config, loaded.tokenizer, format=args.format)
    output.say(f"wrote {path}: the torch_reference state_dict of step {loaded.step} with its config and tokenizer")
    return 0
