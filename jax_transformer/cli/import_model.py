"""A pretrained model as a run directory (`import`)."""

from __future__ import annotations

from jax_transformer.cli import output


def add(sub) -> None:
    i = sub.add_parser(
        "import",
        help="a pretrained model (a hub name, a transformers directory, a fairseq checkpoint, a peft adapter) as a "
        "run directory",
        description="Reads a transformers save_pretrained directory (MarianMTModel, FSMTForConditionalGeneration, "
        "M2M100ForConditionalGeneration for NLLB-200 and M2M-100, MBartForConditionalGeneration), by path or by its "
        "hub name, a fairseq transformer checkpoint (.pt with dict.<lang>.txt and bpecodes beside it), or a peft "
        "LoRA adapter with its base model, and writes a run directory that translate, evaluate, attention, export, "
        "verify and train --init-from take: its weights, config, tokenizer and how it decodes (transformers' "
        "generate rules).",
    )
    i.add_argument(
        "source",
        metavar="SOURCE",
        help="a transformers save_pretrained directory, a fairseq .pt file, a peft adapter directory, or a hub name "
        "(ORG/NAME, e.g. facebook/nllb-200-distilled-600M) read through huggingface_hub: its local cache with "
        "HF_HUB_OFFLINE=1, a download where there is a network",
    )
    i.add_argument("--revision", metavar="REV", help="of a hub name: a branch, tag or commit (default main)")
    i.add_argument("--output", required=True, metavar="DIR", help="the run directory to write (new or empty)")
    i.add_argument(
        "--base",
        metavar="MODEL",
        help="for a peft LoRA adapter directory as SOURCE: the model it adapts (default: its adapter_config.json's "
        "base_model_name_or_path); the run holds both, and train --init-from goes on training the adapters",
    )
    i.set_defaults(func=run)


def run(args, start_time: float) -> int:
    from jax_transformer.interop import hub

    path = hub.import_model(args.source, args.output, print_fn=output.say, base=args.base, revision=args.revision)
    output.say(f"wrote {path}: translate, evaluate, export and train --init-from take it")
    return 0
