"""The files of pretrained models, in and out: a transformers `save_pretrained` directory of a Marian (OPUS-MT) or
FSMT model, or a fairseq checkpoint with its dictionaries, becomes a run directory that `translate`, `evaluate`,
`attention`, `export`, `verify` and `train --init-from` take (`import_model`); a transformers model may also be
named by its hub name (ORG/NAME at a revision), which huggingface_hub finds in its cache or downloads
(`resolve_source`). `export_transformers` writes a MarianMTModel or FSMTForConditionalGeneration directory back.
safetensors, torch, transformers and huggingface_hub are imported here only, by the functions that need them (the
`pretrained` extra)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from jax_transformer.data.tokenizer import (
    FsmtTokenizer,
    LanguageCodeTokenizer,
    M2M100Tokenizer,
    MarianTokenizer,
    Tokenizer,
    TokenizersJsonTokenizer,
)
from jax_transformer.errors import ConfigError, DataError, UsageError
from jax_transformer.files import replaced_folder, write_text
from jax_transformer.interop import pretrained
from jax_transformer.model.params import flatten, unflatten
from jax_transformer.settings.config import DecodeConfig, OptimConfig, TransformerConfig, decoding_in_one_group

MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")
FSMT_TOKENIZER_FILES = ("vocab-src.json", "vocab-tgt.json", "merges.txt")


@dataclasses.dataclass
class Pretrained:
    """A pretrained model in this project's terms."""

    family: str  # "marian", "fsmt" or "fairseq"
    config: TransformerConfig
    params: dict[str, Any]
    tokenizer: Any
    generation: dict[str, Any]  # how it decodes (`generation_settings`)
    source: str
    # config.json and generation_config.json as read (M2M-100 and mBART: an export writes them back, updated)
    original: dict[str, Any] = dataclasses.field(default_factory=dict)


# =============================================================================================================
# Reading
# =============================================================================================================


# The files an import reads from a hub repository: a model's config, weights and tokenizer files, or an adapter's.
HUB_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "*.spm",
    "vocab*.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "sentencepiece.bpe.model",
    "*.model",
    "adapter_config.json",
    "adapter_model.bin",
)
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

# The transformers class that loads each family's exported directory.
MODEL_CLASSES = {
    "marian": "MarianMTModel",
    "fsmt": "FSMTForConditionalGeneration",
    "m2m_100": "M2M100ForConditionalGeneration",
    "mbart": "MBartForConditionalGeneration",
}


def resolve_source(source: str | Path, revision: str | None = None) -> tuple[Path, dict[str, str]]:
    """(local path, {"name", "revision"}) of an import's SOURCE: a path that exists as it is ({}); else a hub name
    (ORG/NAME) through huggingface_hub's snapshot_download: its cache when HF_HUB_OFFLINE=1 (or no network), a
    download where a network exists. The revision is the snapshot's commit. A name found nowhere is a UsageError
    naming it, the revision and the cache searched."""
    path = Path(source)
    if path.exists() or not _HUB_NAME.fullmatch(str(source)):
        if revision is not None:
            raise UsageError(f"--revision {revision} is for a hub name; {source} is a local path")
        return path, {}
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise UsageError(
            f"{source}: no such local path; as a hub name it needs huggingface_hub (pip install huggingface_hub, or "
            f"the project's pretrained extra)"
        ) from None

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE  # read now: a test or a user may set it late
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        folder = huggingface_hub.snapshot_download(
            str(source), revision=revision, cache_dir=cache, local_files_only=offline, allow_patterns=list(HUB_FILES)
        )
    except errors.HFValidationError as e:  # "a--b", "org/name-": refused before any look-up
        raise UsageError(f"{source}: no such local path, and not a valid hub name (ORG/NAME): {e}") from None
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, OSError) as e:
        where = f"the cache {cache}" + (" (HF_HUB_OFFLINE=1: nothing is downloaded)" if offline else " or the hub")
        raise UsageError(
            f"{source} (revision {revision or 'main'}): no such local path, and not found in {where}: "
            f"{_hub_reason(e, offline)}"
        ) from None
    folder = Path(folder)
    return folder, {"name": str(source), "revision": folder.name}


def _hub_reason(error: Exception, offline: bool) -> str:
    """Why huggingface_hub found nothing, in a user's terms (its own messages speak of its API's arguments)."""
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return "a gated repository: accept its terms on the hub, then log in (hf auth login)"
    if isinstance(error, errors.RepositoryNotFoundError):
        return "no such repository on the hub (or a private one: log in with hf auth login)"
    if isinstance(error, errors.RevisionNotFoundError):
        return "the repository has no such revision"
    if isinstance(error, errors.LocalEntryNotFoundError):
        if offline:
            return "the cache has no snapshot of it at that revision"
        cause = str(error).splitlines()[0].removeprefix("Got: ") if str(error) else type(error).__name__
        return f"the hub could not be reached ({cause}) and the cache has no snapshot of it at that revision"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def read_pretrained(source: str | Path) -> Pretrained:
    """A transformers directory (config.json beside the weights) or a fairseq checkpoint (a .pt file)."""
    path = Path(source)
    if path.is_dir() and (path / "config.json").is_file():
        return read_transformers(path)
    if path.is_file():
        return read_fairseq(path)
    if not path.exists():
        raise UsageError(
            f"{path}: no such file or directory (give a transformers save_pretrained directory, e.g. a local copy "
            f"of Helsinki-NLP/opus-mt-en-de, or a fairseq checkpoint file)"
        )
    raise UsageError(
        f"{path}: neither a transformers save_pretrained directory (config.json and model.safetensors) nor a fairseq "
        f"checkpoint file"
    )


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read it as JSON: {e}") from None


def _weights(folder: Path) -> dict[str, np.ndarray]:
    """The state_dict of a save_pretrained directory: model.safetensors (or its index of shards), else
    pytorch_model.bin (read with torch, weights only)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(_json(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    missing = [name for name in files if not (folder / name).is_file()]
    if index.is_file() and missing:
        raise DataError(f"{index}: its shard(s) {missing} are missing from {folder}")
    if not missing:
        from safetensors import safe_open

        state = {}
        for name in files:
            try:  # a tensor at a time from the mapped file: one copy of the weights in memory, not two
                with safe_open(str(folder / name), framework="np") as f:
                    for key in f.keys():
                        state[key] = f.get_tensor(key)
            except Exception as e:  # noqa: BLE001 (safetensors raises its own SafetensorError, or OSError)
                size = (folder / name).stat().st_size
                raise DataError(f"{folder / name}: not a complete safetensors file ({size:,} bytes): {e}") from None
        return state
    if (folder / "pytorch_model.bin").is_file():
        import torch

        try:
            loaded = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 (torch raises many kinds for a damaged file)
            raise DataError(f"{folder / 'pytorch_model.bin'}: cannot read it: {type(e).__name__}: {e}") from None
        return {k: v.float().numpy() for k, v in loaded.items()}
    raise DataError(f"{folder}: no model.safetensors or pytorch_model.bin")


def generation_settings(config: dict, generation: dict | None) -> dict[str, Any]:
    """How a transformers model decodes by default (its generation_config.json, else what transformers derives from
    config.json): {"num_beams", "length_penalty", "early_stopping" ("true", "false", "never"), "max_length",
    "banned" (ids never produced: its bad_words_ids of one token), "forced_eos", "min_length", "forced_bos",
    "repetition_penalty", "no_repeat_ngram_size"}."""
    g = {
        **{
            k: config[k]
            for k in (
                "num_beams",
                "length_penalty",
                "early_stopping",
                "max_length",
                "bad_words_ids",
                "forced_eos_token_id",
                "forced_bos_token_id",
                "min_length",
                "repetition_penalty",
                "no_repeat_ngram_size",
            )
            if k in config
        },
        **(generation or {}),
    }
    bad = g.get("bad_words_ids") or []
    if any(len(words) != 1 for words in bad):
        raise ConfigError(f"bad_words_ids {bad}: only single-token bans are supported")
    early = g.get("early_stopping", False)
    return {
        "num_beams": int(g.get("num_beams", 1)),
        "length_penalty": float(g.get("length_penalty", 1.0)),
        "early_stopping": early if early == "never" else str(bool(early)).lower(),
        "max_length": int(g.get("max_length", 20)),
        "banned": [int(words[0]) for words in bad],
        "forced_eos": g.get("forced_eos_token_id") is not None,
        "min_length": int(g.get("min_length", 0)),
        "forced_bos": g.get("forced_bos_token_id"),  # (a multilingual tokenizer's --tgt-lang sets it per call)
        "repetition_penalty": float(g.get("repetition_penalty") or 1.0),
        "no_repeat_ngram_size": int(g.get("no_repeat_ngram_size") or 0),
    }


def read_transformers(folder: Path) -> Pretrained:
    """A MarianMTModel or FSMTForConditionalGeneration directory (config.json, weights, tokenizer files)."""
    hf = _json(folder / "config.json")
    kind = hf.get("model_type")
    generation = _json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else None
    where = str(folder)
    if kind == "marian":
        config = pretrained.marian_config(hf, f"{folder}/config.json")
        names = MARIAN_TOKENIZER_FILES + (("target_vocab.json",) if not config.share_embeddings else ())
        options = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        options = {
            "separate_vocabs": bool(options.get("separate_vocabs", False)),
            **{k: options[k] for k in ("source_lang", "target_lang") if k in options},
        }
        tokenizer = MarianTokenizer(_files(folder, names), options)
    elif kind == "fsmt":
        config = pretrained.fsmt_config(hf, f"{folder}/config.json")
        options = _json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        options = {"langs": options.get("langs", hf.get("langs")), "do_lower_case": options.get("do_lower_case", False)}
        tokenizer = FsmtTokenizer(_files(folder, FSMT_TOKENIZER_FILES), options)
    elif kind in ("m2m_100", "mbart"):
        read = pretrained.m2m100_config if kind == "m2m_100" else pretrained.mbart_config
        config = read(hf, f"{folder}/config.json")
        tokenizer = _language_code_tokenizer(folder, kind)
    else:
        raise ConfigError(
            f"{folder}/config.json: model_type {kind!r}; this project imports {', '.join(map(repr, MODEL_TYPES))}"
        )
    state = _weights(folder)
    if kind != "fsmt" and config.share_embeddings and "model.shared.weight" not in state:
        # the shared table saved under one of the names tied to it
        for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
            if name in state:
                state["model.shared.weight"] = state[name]
                break
    pretrained.check_copies(state, config, kind, where)
    params = pretrained.to_params(state, config, kind, where, consume=True)
    _check_vocabulary(config, tokenizer, where)
    original = {"config": hf, "generation_config": generation or {}} if kind in ("m2m_100", "mbart") else {}
    return Pretrained(kind, config, params, tokenizer, generation_settings(hf, generation), where, original)


MODEL_TYPES = ("marian", "fsmt", "m2m_100", "mbart")


def _language_code_tokenizer(folder: Path, kind: str) -> LanguageCodeTokenizer:
    """NLLB-200's or mBART-50's tokenizer.json (built from mBART's sentencepiece.bpe.model where there is none),
    else M2M-100's vocab.json and sentencepiece.bpe.model, with the options of tokenizer_config.json that change
    ids or text (the default languages, the code list, clean-up)."""
    config_file = folder / "tokenizer_config.json"
    settings = _json(config_file) if config_file.is_file() else {}
    if settings.get("legacy_behaviour"):
        raise ConfigError(
            f"{config_file}: legacy_behaviour=true (the language code after </s>) is not supported; NLLB's "
            f"current placement is [src_lang] ... </s>"
        )
    options = {k: settings[k] for k in ("src_lang", "tgt_lang", "clean_up_tokenization_spaces") if k in settings}
    extra = ("tokenizer_config.json", "special_tokens_map.json")
    if (folder / "tokenizer.json").is_file() or kind == "mbart":
        if (folder / "tokenizer.json").is_file():
            files = _files(folder, ("tokenizer.json",))
        else:
            files = {"tokenizer.json": _tokenizer_json_from_sentencepiece(folder)}
        files.update(_files(folder, [name for name in extra if (folder / name).is_file()]))
        return _named(folder, TokenizersJsonTokenizer, files, options)
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    codes = settings.get("language_codes", "m2m100")
    if codes not in FAIRSEQ_LANGUAGE_CODES:
        raise ConfigError(f"{config_file}: language_codes {codes!r} is not one of {sorted(FAIRSEQ_LANGUAGE_CODES)}")
    names = ["vocab.json", "sentencepiece.bpe.model"] + [name for name in extra if (folder / name).is_file()]
    options.update(language_codes=list(FAIRSEQ_LANGUAGE_CODES[codes]), language_code_set=codes)
    return _named(folder, M2M100Tokenizer, _files(folder, names), options)


def _tokenizer_json_from_sentencepiece(folder: Path) -> bytes:
    """The tokenizer.json transformers builds from an mBART directory's sentencepiece.bpe.model (its own converter,
    with the class tokenizer_config.json names: the code list and fairseq's id layout), as its save_pretrained
    would write it."""
    model = folder / "sentencepiece.bpe.model"
    if not model.is_file():
        raise DataError(f"{folder}: tokenizer file(s) ['tokenizer.json' or 'sentencepiece.bpe.model'] missing")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 (sentencepiece and transformers raise their own types for a bad file)
        raise DataError(f"{model}: not a SentencePiece model transformers reads: {type(e).__name__}: {e}") from None
    return tokenizer.backend_tokenizer.to_str().encode("utf-8")


def _named(folder: Path, kind, files: dict[str, bytes], options: dict):
    """`kind(files, options)`, its errors (which name the file) naming the folder too."""
    try:
        return kind(files, options)
    except DataError as e:
        raise DataError(f"{folder}/{e}") from None


def _files(folder: Path, names) -> dict[str, bytes]:
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{folder}: tokenizer file(s) {missing} missing")
    return {name: (folder / name).read_bytes() for name in names}


def _check_vocabulary(config: TransformerConfig, tokenizer, where: str) -> None:
    for side in ("src", "tgt"):
        if getattr(tokenizer, f"{side}_vocab_size") > getattr(config, f"{side}_vocab_size"):
            raise DataError(
                f"{where}: the tokenizer's {side} vocabulary ({getattr(tokenizer, f'{side}_vocab_size')} ids) is "
                f"larger than the model's ({getattr(config, f'{side}_vocab_size')})"
            )


def _fairseq_dictionary(path: Path) -> dict[str, int]:
    """fairseq's dict.<lang>.txt: "<symbol> <count>" lines after the four specials <s> <pad> </s> <unk>."""
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: fairseq dictionary not found (dict.<lang>.txt beside the checkpoint)") from None
    for number, line in enumerate(lines, start=1):
        parts = line.rstrip().rsplit(" ", 2)
        if len(parts) < 2:
            raise DataError(f"{path}, line {number}: expected '<symbol> <count>', got {line!r}")
        symbol = parts[0]
        if symbol not in vocab or "#fairseq:overwrite" in line:
            vocab[symbol] = len(vocab) if symbol not in vocab else vocab[symbol]
    return vocab


def read_fairseq(path: Path) -> Pretrained:
    """A fairseq transformer checkpoint (`checkpoint_best.pt` and kin: "args" or "cfg", and "model", the
    state_dict) with dict.<src>.txt and dict.<tgt>.txt beside it; bpecodes there (fastBPE) gives the Moses + BPE
    tokenizer, with the dictionaries' @@-continued pieces rewritten to </w>-ended words as FSMT's are."""
    import torch

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # fairseq pickles its argparse args
    except Exception as e:  # noqa: BLE001 (torch raises many kinds for a file that is not a checkpoint)
        raise DataError(f"{path}: cannot read it as a fairseq checkpoint: {type(e).__name__}: {e}") from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise DataError(f"{path}: a fairseq checkpoint holds a dict with 'model' (and 'args' or 'cfg')")
    args = checkpoint.get("args")
    args = vars(args) if args is not None and not isinstance(args, dict) else args
    if args is None:
        cfg = checkpoint.get("cfg") or {}
        args = {**dict(cfg.get("task", {})), **dict(cfg.get("model", {}))}
    src, tgt = args.get("source_lang"), args.get("target_lang")
    if not src or not tgt:
        raise DataError(f"{path}: its args name no source_lang / target_lang, so its dictionaries cannot be found")
    folder = path.parent
    vocabs = {side: _fairseq_dictionary(folder / f"dict.{lang}.txt") for side, lang in (("src", src), ("tgt", tgt))}
    config = pretrained.fairseq_config(args, len(vocabs["src"]), len(vocabs["tgt"]), str(path))
    state = {
        k: v.float().numpy() for k, v in checkpoint["model"].items() if hasattr(v, "numpy") and v.is_floating_point()
    }
    pretrained.check_copies(state, config, "fairseq", str(path))
    params = pretrained.to_params(state, config, "fairseq", str(path))
    tokenizer = None
    if (folder / "bpecodes").is_file():
        rewrite = (
            lambda vocab: {  # noqa: E731  fastBPE's "hel@@ lo" pieces as FSMT's "hel lo</w>"
                (k[:-2] if k.endswith("@@") else k if k in ("<s>", "<pad>", "</s>", "<unk>") else k + "</w>"): v
                for k, v in vocab.items()
            }
        )
        merges = "".join(" ".join(line.split()[:2]) + "\n" for line in (folder / "bpecodes").read_text().splitlines())
        files = {
            "vocab-src.json": json.dumps(rewrite(vocabs["src"])).encode(),
            "vocab-tgt.json": json.dumps(rewrite(vocabs["tgt"])).encode(),
            "merges.txt": merges.encode(),
        }
        tokenizer = FsmtTokenizer(files, {"langs": [src, tgt], "do_lower_case": False})
    generation = {
        "num_beams": 5,
        "length_penalty": 1.0,
        "early_stopping": "false",
        "max_length": 200,
        "banned": [],
        "forced_eos": True,
        "min_length": 0,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
    }  # (what transformers' FSMT conversion writes)
    return Pretrained("fairseq", config, params, tokenizer, generation, str(path))


# =============================================================================================================
# A run directory from a pretrained model
# =============================================================================================================


def import_model(
    source: str | Path,
    output: str | Path,
    print_fn=print,
    base: str | Path | None = None,
    revision: str | None = None,
) -> Path:
    """Writes `output` as a run directory (checkpoints/0 with the parameters, config, tokenizer and how the model
    decodes; config.json; tokenizer.model) from a pretrained model: a local path, or a hub name at `revision`
    (`resolve_source`). A peft LoRA adapter (`base`: its base model, default the one its adapter_config.json
    names) gives the base model with the adapters, which `train --init-from` goes on training and `export
    --format peft` writes back."""
    from jax_transformer.checkpoint.manager import CheckpointManager

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise UsageError(f"--output {output} already exists and is not empty; choose a new directory")
    folder, hub = resolve_source(source, revision)
    if is_peft_adapter(folder):
        named = _json(folder / "adapter_config.json").get("base_model_name_or_path")
        if base is None and not named:
            raise UsageError(f"{source}: its adapter_config.json names no base model; give --base")
        if base is not None and is_run_directory(base):  # what `import` wrote: its weights, read offline
            base_model = read_run(base)
            check_adapter_base(folder, named, base_model.source, f"{base} (imported from {base_model.source})")
        else:
            if base is not None:
                check_adapter_base(folder, named, str(base))
            base_folder, base_hub = resolve_source(base if base is not None else named)
            base_model = _named_source(read_pretrained(base_folder), base_hub)
        model = read_peft_adapter(folder, base_model)
        if hub:  # the adapter too by its hub name and commit, not by the cache's folder
            adapter = {**model.original["adapter"], "source": hub["name"], "revision": hub["revision"]}
            model = dataclasses.replace(model, original={**model.original, "adapter": adapter})
    elif base is not None:
        raise UsageError(f"--base is for a peft adapter directory; {source} is a model (no adapter_config.json)")
    else:
        model = _named_source(read_pretrained(folder), hub)
    if model.tokenizer is None:
        raise DataError(
            f"{source}: no tokenizer beside it (bpecodes for a fairseq checkpoint): nothing could translate"
        )
    generation = model.generation
    decode = {k: v for k, v in generation.items() if k not in ("num_beams", "length_penalty", "banned")}
    decode.update(beam_size=generation["num_beams"], alpha=generation["length_penalty"])
    run = {
        "imported_from": {"source": str(model.source), "family": model.family, **model.original},
        "decode": {"rules": "transformers", "banned": ",".join(map(str, generation["banned"])), **decode},
    }
    DecodeConfig.from_dict(run["decode"], source=f"{source} generation settings")  # checked before anything is written
    # The weights alone, as `average` writes them: what translate, export and train --init-from read; no optimizer
    # moments (zeros, twice the weights' size) held in memory or written.
    state = {"step": np.asarray(0, np.int32), "params": model.params}
    manager = CheckpointManager(output / "checkpoints", keep=1, async_save=False)
    try:
        manager.save(0, state, config=model.config, optim=OptimConfig().to_dict(), tokenizer=model.tokenizer, run=run)
    finally:
        manager.close()
    model.tokenizer.save(output / "tokenizer.model")
    write_text(output / "config.json", model.config.to_json() + "\n")
    n = sum(np.asarray(x).size for x in flatten(model.params).values())
    print_fn(
        f"imported {model.family} model {source}: {n:,} parameters, vocabulary {model.config.src_vocab_size}/"
        f"{model.config.tgt_vocab_size}; decodes as transformers' generate ({generation})"
        + (f"; with the LoRA adapters of {source} (rank {model.config.lora_rank})" if model.config.lora_rank else "")
    )
    return output


def _named_source(model: Pretrained, hub: dict[str, str]) -> Pretrained:
    """A model read from the hub's cache known by its hub name and commit (what a peft adapter names as its
    base), not by the cache's folder."""
    if not hub:
        return model
    return dataclasses.replace(model, source=hub["name"], original={**model.original, "revision": hub["revision"]})


# =============================================================================================================
# Writing a transformers directory
# =============================================================================================================


def export_transformers(
    params, config: TransformerConfig, tokenizer, run: dict, output: str | Path
) -> tuple[Path, str]:
    """Writes `output` for transformers: an imported FSMT (or fairseq) model as FSMTForConditionalGeneration, an
    imported Marian model and this project's own (its model dimension permuted so its interleaved sinusoids become
    Marian's halves) as MarianMTModel, each with its tokenizer files and generation_config.json. What Marian cannot
    represent is a UsageError naming the setting."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise UsageError(f"--output {output} already exists and is not empty; choose a new directory")
    family = (run.get("imported_from") or {}).get("family")
    decode = decoding_in_one_group(run)["decode"]
    if family in ("fsmt", "fairseq"):
        hf, state, tokenizer_files = _fsmt_files(params, config, tokenizer, decode)
        kind = "fsmt"
    elif family in ("m2m_100", "mbart"):
        hf, state, tokenizer_files = _multilingual_files(params, config, tokenizer, decode, run["imported_from"])
        kind = family
    else:
        hf, state, tokenizer_files = _marian_files(params, config, tokenizer, decode, own=family is None)
        kind = "marian"
    with replaced_folder(output, errors=(SafetensorError,)) as folder:
        state = {k: np.ascontiguousarray(v) for k, v in state.items()}
        save_file(state, str(folder / "model.safetensors"), {"format": "pt"})
        (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name, data in tokenizer_files.items():
            (folder / name).write_bytes(data)
    return output, kind


def _generation_json(config: TransformerConfig, decode: dict) -> dict:
    """generation_config.json: how the run decodes, in transformers' terms. A model decoding by this project's
    own rules (GNMT's length penalty, which transformers does not have) gets its alpha as length_penalty and the pad
    id banned, as its beam search bans it."""
    banned = [int(i) for i in decode["banned"].split(",")] if decode.get("banned") else []
    if decode.get("rules", "gnmt") == "gnmt" and config.pad_id not in banned:
        banned.append(config.pad_id)
    return {
        "decoder_start_token_id": config.start_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "num_beams": int(decode.get("beam_size", 4)),
        "length_penalty": float(decode.get("alpha", 1.0)),
        "max_length": int(decode.get("max_length") or config.max_len + 1),  # (counting the start token)
        "early_stopping": {"true": True, "false": False}.get(decode.get("early_stopping", "false"), "never"),
        **({"forced_eos_token_id": config.eos_id} if decode.get("forced_eos", True) else {}),
        **({"bad_words_ids": [[i] for i in banned]} if banned else {}),
        **{key: decode[key] for key, off in _REPEAT_OFF.items() if decode.get(key, off) != off},
    }


# transformers' repetition controls and their "off" values: written only when on (its defaults are unset).
_REPEAT_OFF = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
# What `_generation_json` leaves out when it is off: an imported model's own value of it must not survive either.
_OMITTED_WHEN_OFF = ("forced_eos_token_id", *_REPEAT_OFF)


def _marian_files(params, config: TransformerConfig, tokenizer, decode, own: bool):
    if own:  # this project's own model, in Marian's shape: the same function
        problems = pretrained.marian_refusals(config)
        if problems:
            raise UsageError("this model cannot be written as a MarianMTModel:\n  " + "\n  ".join(problems))
        if not isinstance(tokenizer, Tokenizer):
            raise UsageError(f"this model's tokenizer ({tokenizer.kind}) is not one MarianTokenizer reads")
        if config.sinusoid_layout == "interleaved":
            params = pretrained.permute_model_dimension(params, config, pretrained.interleaved_to_halves(config))
        config = config.replace(
            sinusoid_layout="halves",
            qkv_bias=True,
            ffn_bias=True,
            norm_bias=True,
            logits_bias=config.tie_output,
            output_bias=not config.tie_output,
        )
        params = _complete(params, config)  # the biases the model was built without, as zeros
    state = pretrained.from_params(params, config, "marian")
    activation = {"silu": "swish"}.get(config.activation, config.activation)
    hf = {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": config.src_vocab_size,
        "decoder_vocab_size": config.tgt_vocab_size,
        "share_encoder_decoder_embeddings": config.share_embeddings,
        "tie_word_embeddings": config.tie_output,
        **_shared_fields(config),
        "activation_function": activation,
        "scale_embedding": config.scale_embeddings,
        "pad_token_id": config.pad_id,
        "eos_token_id": config.eos_id,
        "bos_token_id": config.bos_id,
        "decoder_start_token_id": config.start_id,
        "forced_eos_token_id": config.eos_id,
    }
    files = {"generation_config.json": json.dumps(_generation_json(config, decode), indent=2).encode()}
    if isinstance(tokenizer, MarianTokenizer):
        files.update({name: data for name, data in tokenizer.files.items()})
        options = tokenizer.options
    else:  # this project's joint SentencePiece model: the same model on both sides, its pieces as the vocabulary
        model = tokenizer.to_bytes()
        pieces = {tokenizer.piece(i): i for i in range(tokenizer.vocab_size)}  # <pad> 0, <s> 1, </s> 2, <unk> 3
        files.update({"source.spm": model, "target.spm": model, "vocab.json": json.dumps(pieces).encode()})
        options = {"separate_vocabs": False}
    tokenizer_config = {
        "tokenizer_class": "MarianTokenizer",
        "separate_vocabs": bool(options.get("separate_vocabs")),
        **{k: v for k, v in options.items() if k in ("source_lang", "target_lang")},
    }
    files["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=2).encode()
    return hf, state, files


def _multilingual_files(params, config: TransformerConfig, tokenizer, decode, origin: dict):
    """An M2M100ForConditionalGeneration (NLLB-200, M2M-100) or MBartForConditionalGeneration directory: the
    config.json and generation_config.json read at import with this model's values written over theirs (every
    other field, tokenizer_class and the like, kept), the weights, and the tokenizer's own files with its
    languages in tokenizer_config.json."""
    family = origin["family"]
    if not isinstance(tokenizer, LanguageCodeTokenizer):
        raise UsageError(f"a model imported as {family} exports with its multilingual tokenizer, not {tokenizer.kind}")
    state = pretrained.from_params(params, config, family)
    hf = {
        **origin.get("config", {}),
        "vocab_size": config.src_vocab_size,
        **_shared_fields(config),
        "activation_function": config.activation,
        "scale_embedding": config.scale_embeddings,
        "tie_word_embeddings": True,
        "pad_token_id": config.pad_id,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.decoder_start_id,
    }
    ours = _generation_json(config, decode)
    imported = {k: v for k, v in origin.get("generation_config", {}).items() if k in ours or k not in _OMITTED_WHEN_OFF}
    generation = {**imported, **ours}
    files = dict(tokenizer.files)
    settings = json.loads(files.get("tokenizer_config.json", b"{}"))
    if family == "mbart":  # BART's fields for what mBART always does, as released configs state them (CTranslate2
        # reads them), and the tokenizer's class (which tells it the decoder starts from </s>, not a language code)
        hf = {"normalize_before": True, "normalize_embedding": True, "add_final_layer_norm": True, **hf}
    if "tokenizer_class" in settings:
        hf.setdefault("tokenizer_class", settings["tokenizer_class"])
    settings.update({k: v for k, v in (("src_lang", tokenizer.src_lang), ("tgt_lang", tokenizer.tgt_lang)) if v})
    files["tokenizer_config.json"] = json.dumps(settings, indent=2).encode()
    files["generation_config.json"] = json.dumps(generation, indent=2).encode()
    return hf, state, files


def _shared_fields(config: TransformerConfig) -> dict:
    """The config.json fields that transformers' translation models name alike: widths, depths, positions, dropouts."""
    return {
        "d_model": config.d_model,
        "encoder_layers": config.num_encoder_layers,
        "decoder_layers": config.num_decoder_layers,
        "encoder_attention_heads": config.num_heads,
        "decoder_attention_heads": config.num_heads,
        "encoder_ffn_dim": config.d_ff,
        "decoder_ffn_dim": config.d_ff,
        "max_position_embeddings": config.max_len,
        "dropout": config.dropout,
        "attention_dropout": config.attention_dropout,
        "activation_dropout": config.activation_dropout,
    }


def _complete(params, config: TransformerConfig):
    """Params for `config` with any parameter the source model did not have (biases it was built without, a zero
    logits bias) filled in with zeros: the same function, in Marian's shape."""
    from jax_transformer.model.params import expected_param_shapes

    flat = flatten(params)
    for path, shape in expected_param_shapes(config).items():
        flat.setdefault(path, np.ones(shape, np.float32) if path[-1] == "scale" else np.zeros(shape, np.float32))
    return unflatten(flat)


def _fsmt_files(params, config: TransformerConfig, tokenizer, decode):
    if not isinstance(tokenizer, FsmtTokenizer):
        raise UsageError("only models imported from FSMT or fairseq are written as FSMT")
    state = pretrained.from_params(params, config, "fsmt")
    hf = {
        "architectures": ["FSMTForConditionalGeneration"],
        "model_type": "fsmt",
        "langs": tokenizer.langs,
        "src_vocab_size": config.src_vocab_size,
        "tgt_vocab_size": config.tgt_vocab_size,
        **_shared_fields(config),
        "activation_function": config.activation,
        "scale_embedding": config.scale_embeddings,
        "tie_word_embeddings": config.tie_output,
        "pad_token_id": config.pad_id,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "decoder_start_token_id": config.start_id,
        "forced_eos_token_id": config.eos_id,
        **{
            k: v
            for k, v in _generation_json(config, decode).items()
            if k in ("num_beams", "length_penalty", "early_stopping", "max_length")
        },
    }
    files = {name: data for name, data in tokenizer.files.items()}
    files["tokenizer_config.json"] = json.dumps(
        {"tokenizer_class": "FSMTTokenizer", "langs": tokenizer.langs, "do_lower_case": tokenizer.lower}
    ).encode()
    files["generation_config.json"] = json.dumps(_generation_json(config, decode), indent=2).encode()
    return hf, state, files


# =============================================================================================================
# LoRA adapters as peft writes and reads them
# =============================================================================================================


def export_peft(params, config: TransformerConfig, run: dict, output: str | Path) -> Path:
    """Writes `output` as a peft adapter directory (adapter_config.json, adapter_model.safetensors) that
    `peft.PeftModel.from_pretrained` loads on the transformers model the run was imported from."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    from jax_transformer.interop import peft

    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise UsageError(f"--output {output} already exists and is not empty; choose a new directory")
    if not config.lora_rank:
        raise UsageError("--format peft writes LoRA adapters; this run has none (it was not trained with --lora-rank)")
    origin = run.get("imported_from") or {}
    family = origin.get("family")
    if family not in ("marian", "fsmt", "m2m_100", "mbart"):
        raise UsageError(
            "--format peft needs a run that started from a model imported from transformers (peft adapts that "
            "model); this one was trained here from scratch: export --format transformers --merge-lora instead"
        )
    base = origin.get("name") or origin.get("source")
    state = peft.peft_state(params, config, family)
    with replaced_folder(output, errors=(SafetensorError,)) as folder:
        save_file(state, str(folder / "adapter_model.safetensors"), {"format": "pt"})
        text = json.dumps(peft.peft_config(config, base), indent=2, sort_keys=True) + "\n"
        (folder / "adapter_config.json").write_text(text, encoding="utf-8")
    return output


def is_run_directory(source: str | Path) -> bool:
    """A run directory of this project's (its checkpoints/ folder), or that folder itself (step folders named by
    their numbers), not a transformers one."""
    path = Path(source)
    if (path / "checkpoints").is_dir():
        return True
    return path.is_dir() and any(child.name.isdigit() and child.is_dir() for child in path.iterdir())


def read_run(directory: str | Path) -> Pretrained:
    """The pretrained model a run directory holds (`train.py import` wrote it, or a run started from one): its
    best checkpoint's weights, config and tokenizer, known by the name it was imported from (what a peft adapter
    names as its base) and decoding as the run stored it. Read from disk alone: nothing is downloaded."""
    from jax_transformer.checkpoint.manager import load
    from jax_transformer.checkpoint.settings import stored_settings

    loaded = load(directory, "best", weights_only=True)
    settings = stored_settings(loaded)
    origin = dict(settings.get("imported_from") or {})
    if origin.get("family") not in ("marian", "fsmt", "fairseq", "m2m_100", "mbart"):
        raise UsageError(
            f"--base {directory}: a run trained here from scratch; a peft adapter adapts a transformers model: give "
            f"the run `import` wrote from that model, its directory, or its hub name"
        )
    if loaded.config.lora_rank:
        raise UsageError(f"--base {directory}: its model has LoRA adapters already; give the run they adapt")
    decode = dict(settings.get("decode", {}))
    generation = {k: v for k, v in decode.items() if k not in ("rules", "banned", "beam_size", "alpha")}
    generation.update(
        num_beams=decode.get("beam_size", 1),
        length_penalty=decode.get("alpha", 1.0),
        banned=[int(i) for i in str(decode.get("banned", "")).split(",") if i.strip()],
    )
    return Pretrained(
        family=origin.pop("family"),
        config=loaded.config,
        params=loaded.params,
        tokenizer=loaded.tokenizer,
        generation=generation,
        source=str(origin.pop("source", directory)),
        original=origin,
    )


def is_peft_adapter(source: str | Path) -> bool:
    return (Path(source) / "adapter_config.json").is_file()


def read_peft_adapter(folder: str | Path, base: Pretrained) -> Pretrained:
    """`base` with the LoRA adapters of the peft directory `folder` (adapter_config.json and
    adapter_model.safetensors, or adapter_model.bin): its config gains the adapters' settings, its parameters the
    adapters. An adapter of another base (other shapes or modules) is a ConfigError naming what does not fit."""
    from jax_transformer.interop import peft
    from jax_transformer.settings.resolve import requested_model

    folder = Path(folder)
    adapter = _json(folder / "adapter_config.json")
    where = str(folder / "adapter_config.json")
    config = requested_model(base.config, None, peft.lora_settings(adapter, where))  # the adapters on the base
    weights = folder / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors.numpy import load_file

        try:
            state = load_file(str(weights))
        except Exception as e:  # noqa: BLE001 (safetensors raises its own SafetensorError, or OSError)
            raise DataError(f"{weights}: not a complete safetensors file: {e}") from None
    elif (folder / "adapter_model.bin").is_file():
        import torch

        loaded = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
        state = {k: v.float().numpy() for k, v in loaded.items()}
    else:
        raise DataError(f"{folder}: no adapter_model.safetensors or adapter_model.bin beside adapter_config.json")
    family = "fsmt" if base.family == "fairseq" else base.family
    adapters = peft.adapters_from_peft(state, config, family, str(weights))
    params = unflatten({**flatten(base.params), **adapters})
    original = {**base.original, "adapter": {"source": str(folder), "config": adapter}}
    return dataclasses.replace(base, config=config, params=params, original=original)


def check_adapter_base(adapter_folder: str | Path, named: str | None, base: str, shown: str | None = None) -> None:
    """An adapter names the model it was trained on (`named`: its base_model_name_or_path); `base`, given instead,
    must be that model: the same name, or a local folder of that name (a download of it). `shown`: how the
    message names what was given (a run directory and the model it was imported from)."""
    if named and Path(str(named).rstrip("/")).name != Path(str(base).rstrip("/")).name:
        raise UsageError(
            f"{adapter_folder}: the adapter was trained on {named}, not on --base {shown or base}; an adapter of "
            f"another base does not fit (give --base {named}, or a local copy of it)"
        )
