"""Every setting, in one module: the model, the optimiser, the data, the run loop and the devices.

Each group is a frozen dataclass whose fields are declared with `setting(default, help, ...)`: the help becomes the
`train.py` flag of the same name (`d_model` -> `--d-model`), and one validator checks every field on construction,
its type from the annotation and its choices and range from the field's metadata. One JSON round trip (`to_dict`,
`from_dict`) serves every group; checkpoints store them so. `resolve` decides, once and before a run starts, what
its settings are: a flag, else what a resumed checkpoint stored, else the recipe, else the default. No jax, no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import json
import math
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jax_transformer.errors import ConfigError, DataError, UsageError

__all__ = ["ConfigError", "DataError", "UsageError"]  # the errors settings raise, importable from here too

POSITIONS = ("sinusoidal", "learned")
SINUSOID_LAYOUTS = ("interleaved", "halves")
SINUSOID_FREQUENCIES = ("paper", "tensor2tensor")
ACTIVATIONS = ("relu", "gelu", "silu")
DTYPES = ("float32", "bfloat16")
ATTENTION_KERNELS = ("explicit", "xla", "cudnn")
# What a training step keeps of each layer's forward pass for the backward pass (`jax.checkpoint` policies): all
# (none recomputed), nothing (the layer recomputed), or the matmuls' outputs (the rest recomputed).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# Decoding with int8 weights (jax_transformer/model/quantization.py): int8 picks one of the other two for the backend.
QUANTIZE_MODES = ("none", "int8", "int8-dynamic", "int8-weights")
# How the model computes, not what it is: the same parameters serve every value, so checkpoints and weight files
# ignore these fields when they compare configs (a bfloat16 run evaluates or resumes in float32 and back).
COMPUTE_FIELDS = ("dtype", "attention_kernel", "remat", "quantize")
# The matrices LoRA adapters may go beside (`lora_targets`), by peft's module names: q_proj, k_proj, v_proj,
# out_proj, and fc1 + fc2.
LORA_TARGETS = ("q", "k", "v", "out", "ffn")
# The adapters' settings: a run that starts from another's weights (--init-from) may add or change them.
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
BATCHINGS = ("packed", "buckets")
PARALLEL_MODES = ("jit", "pmap", "sharded")
BEST_METRICS = ("bleu", "loss")
# Learning-rate schedules: the paper's (noam), and the fine-tuning ones people know from transformers' optimization
# module (each a linear warm-up from 0 to --lr, then constant, linear or cosine decay to 0, or 1/sqrt(step)).
SCHEDULES = ("noam", "constant", "linear", "cosine", "inverse_sqrt")
OFF = "off"  # the compilation cache setting that turns it off


# =============================================================================================================
# One way to declare, check and serialise a setting
# =============================================================================================================


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    at_least: float | None = None,
    above: float | None = None,
    below: float | None = None,
    why: str = "",
    metavar: str | None = None,
) -> Any:
    """A dataclass field with its help text (`train.py --help` shows it for the flag of the same name) and what
    `Settings` checks on construction: one of `choices`, or a number >= `at_least`, > `above`, < `below`; `why` is
    added to the message when the range is violated. `metavar`: what the flag's value is in its help (FILE, DIR,
    CODE, ...); a number's follows from its type (N, X), and a text field without one is TEXT."""
    limits = dict(choices=choices, at_least=at_least, above=above, below=below, why=why)
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar, **limits})


class Settings:
    """The base of every settings group: validation on construction (`check_fields`, then the group's own `check`
    for rules between fields), the JSON round trip, and `replace`. `kind` names the group in messages; `error` is
    the exception a bad value raises."""

    kind = "settings"
    error: type[ValueError] = ConfigError

    def __post_init__(self) -> None:
        check_fields(self)
        self.check()

    def check(self) -> None:
        """Rules between fields (a group overrides it)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str | None = None):
        """`cls(**values)`; unknown keys are a ConfigError that lists them, the known ones and `source`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            where = source or f"{cls.kind} settings"
            raise ConfigError(f"{where}: unknown {cls.__name__} field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**dict(values))

    def replace(self, **changes: Any):
        """A copy with some fields changed (validated again); unknown names are an error."""
        return type(self).from_dict({**self.to_dict(), **changes}, source="replace()")

    def diff(self, other) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ, as {name: (self's, other's)}."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


@functools.cache
def _type_hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Settings) -> None:
    """Every field of a settings dataclass against its annotation (int, float, bool, str, each possibly None) and
    its metadata (choices, range). A float field takes an int (JSON and flags write 2 for 2.0); nothing takes a
    bool for a number. The message names the group, the field and its flag."""
    for field in dataclasses.fields(obj):
        check_field(type(obj), field, getattr(obj, field.name))


def check_field(cls: type[Settings], field: dataclasses.Field, value: Any) -> None:
    """One field's value against its annotation and metadata (`check_fields`): `cls.error` naming it otherwise."""
    hints, meta = _type_hints(cls), field.metadata
    name, flag = f"{cls.kind} field {field.name!r}", f" (--{field.name.replace('_', '-')})"
    kinds = [k for k in typing.get_args(hints[field.name]) if k is not type(None)] or [hints[field.name]]
    optional = type(None) in typing.get_args(hints[field.name])
    if value is None and optional:
        return
    kind = kinds[0]
    low, above, high = meta.get("at_least"), meta.get("above"), meta.get("below")
    if low is not None and high is not None:
        rule, fits = f"in [{low:g}, {high:g})", lambda v: low <= v < high
    elif low is not None:
        rule, fits = f">= {low:g}", lambda v: v >= low
    elif above is not None:
        rule, fits = f"> {above:g}", lambda v: v > above
    else:
        rule, fits = "", lambda v: True
    expected = {bool: "true or false", int: "an int", float: "a number", str: "a string"}[kind]
    if kind is int and rule:
        expected = f"an int {rule}"
    elif rule:
        expected = rule if kind is float else expected
    expected += f" {meta['why']}" if meta.get("why") and rule else ""
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[kind]
    if not ok:
        if kind is float and rule:
            expected = f"a number {rule}"
        raise cls.error(f"{name} must be {expected}{' (or none)' if optional else ''}, got {value!r}{flag}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise cls.error(f"{name} must be one of {meta['choices']}, got {value!r}{flag}")
    if kind is float and not math.isfinite(value):  # an infinite length penalty or learning rate is no setting
        raise cls.error(f"{name} must be a finite number{f' {rule}' if rule else ''}, got {value!r}{flag}")
    if not fits(value):
        raise cls.error(f"{name} must be {expected}, got {value!r}{flag}")


# =============================================================================================================
# The model (the paper's base model by default) and the optimiser
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class TransformerConfig(Settings):
    """The architecture, read by the Flax model and its PyTorch twin alike; hashable, so a static jit argument."""

    kind = "config"
    # --- vocabulary -------------------------------------------------------------------------------
    src_vocab_size: int = setting(32000, "source token ids are in [0, src_vocab_size)", at_least=1)
    tgt_vocab_size: int = setting(32000, "target token ids are in [0, tgt_vocab_size)", at_least=1)
    pad_id: int = setting(0, "padding id in both vocabularies; masked out of attention and of the loss", at_least=0)
    bos_id: int | None = setting(
        1,
        "beginning of sentence: the decoder's first input (unless decoder_start_id says otherwise), never produced by "
        "decoding; none: the vocabulary has no such token (Marian)",
        at_least=0,
    )
    eos_id: int = setting(2, "end of sentence; decoding stops when every sequence has emitted it", at_least=0)
    decoder_start_id: int | None = setting(
        None, "the decoder's first input, if not bos_id: the pad id for Marian, eos for fairseq and FSMT", at_least=0
    )
    # --- sizes (defaults: the paper's base model, Table 3) ------------------------------------------
    d_model: int = setting(512, "width of every residual stream", at_least=1)
    num_heads: int = setting(8, "attention heads; d_model must be divisible by it", at_least=1)
    d_ff: int = setting(2048, "inner width of the position-wise feed-forward network", at_least=1)
    num_encoder_layers: int = setting(6, "encoder layers", at_least=0)
    num_decoder_layers: int = setting(6, "decoder layers", at_least=0)
    max_len: int = setting(
        256, "longest source or target sequence in tokens, BOS/EOS included (positions table)", at_least=1
    )
    # --- regularisation (all off in eval / deterministic mode) --------------------------------------
    dropout: float = setting(
        0.1, "residual dropout on each sub-layer output before the residual add (paper 5.4)", at_least=0, below=1
    )
    attention_dropout: float = setting(
        0.0, "dropout on attention probabilities (the Annotated Transformer: 0.1)", at_least=0, below=1
    )
    activation_dropout: float = setting(
        0.0, "dropout inside the feed-forward net, after the activation", at_least=0, below=1
    )
    embedding_dropout: float = setting(
        0.1, "dropout on token embedding + position encoding (paper 5.4)", at_least=0, below=1
    )
    # --- architecture switches -----------------------------------------------------------------------
    norm_first: bool = setting(False, "pre-norm x + f(LN(x)) instead of the paper's post-norm x = LN(x + f(x))")
    final_norm: bool = setting(False, "a LayerNorm after the last encoder and decoder layer (usual with pre-norm)")
    embedding_norm: bool = setting(
        False, "a LayerNorm on embedded tokens + positions, before the first layer (mBART's layernorm_embedding)"
    )
    layer_norm_eps: float = setting(1e-5, "LayerNorm epsilon (torch's default)", above=0)
    positions: str = setting("sinusoidal", "position encoding: a fixed sinusoid table, or learned", choices=POSITIONS)
    sinusoid_layout: str = setting(
        "interleaved",
        "the sinusoid table's columns: interleaved sin/cos (the paper, the Annotated Transformer) or halves, all "
        "sines then all cosines (Marian, fairseq)",
        choices=SINUSOID_LAYOUTS,
    )
    sinusoid_frequencies: str = setting(
        "paper",
        "the sinusoids' frequencies: the paper's 10000^(-2i/d) or tensor2tensor's exp(-i ln(10000) / (d/2 - 1)), "
        "computed in float32 as fairseq does (fairseq, FSMT)",
        choices=SINUSOID_FREQUENCIES,
    )
    position_offset: int = setting(0, "the position of the first token (fairseq counts from pad_id + 1)", at_least=0)
    scale_embeddings: bool = setting(True, "multiply token embeddings by sqrt(d_model) (paper 3.4)")
    share_embeddings: bool = setting(False, "one embedding table for source and target (needs equal vocab sizes)")
    tie_output: bool = setting(True, "output projection = target embedding transposed, no bias (paper 3.4)")
    activation: str = setting(
        "relu",
        "feed-forward activation: relu (the paper), exact (erf) gelu, or silu (swish, Marian)",
        choices=ACTIVATIONS,
    )
    qkv_bias: bool = setting(True, "bias on the query/key/value/output projections of attention")
    ffn_bias: bool = setting(True, "bias on the feed-forward layers linear1 and linear2")
    norm_bias: bool = setting(True, "bias (beta) of every LayerNorm, the final norms included")
    output_bias: bool = setting(True, "bias of the untied output projection (a tied output never has one)")
    logits_bias: bool = setting(False, "a bias added to the logits of the tied output (Marian's final_logits_bias)")
    # --- LoRA adapters (jax_transformer/model/lora.py): low-rank terms beside the frozen matrices ------------------
    lora_rank: int = setting(
        0, "rank r of LoRA adapters x A B (alpha / r) added to the --lora-targets matrices; 0: none", at_least=0
    )
    lora_alpha: float = setting(8.0, "LoRA's alpha: the adapters' product is scaled by alpha / r (peft's)", above=0)
    lora_dropout: float = setting(
        0.0, "dropout on the adapters' input, in training (peft's lora_dropout)", at_least=0, below=1
    )
    lora_targets: str = setting(
        "q,v",
        "the matrices that get adapters, comma-separated: q, k, v, out (every attention's projections, self and "
        "cross), ffn (both feed-forward matrices) (peft's target_modules q_proj, v_proj by default)",
        metavar="TARGETS",
    )
    # --- how to compute (COMPUTE_FIELDS: run settings, not architecture) -------------------------------
    dtype: str = setting(
        "float32",
        "compute dtype of every matmul: float32, or bfloat16 mixed precision (parameters, residual stream, "
        "LayerNorm, softmax, loss and optimiser stay float32; docs/gpu-tpu.md)",
        choices=DTYPES,
    )
    attention_kernel: str = setting(
        "explicit",
        "attention where its probabilities are not asked for: explicit (softmax(QK^T/sqrt(d))V written out), "
        "xla or cudnn (jax.nn.dot_product_attention; cudnn: a CUDA GPU, bfloat16, head_dim a multiple of 8)",
        choices=ATTENTION_KERNELS,
    )
    remat: str = setting(
        "none",
        "recompute each layer's activations in the backward pass instead of keeping them (jax.checkpoint per "
        "layer): none; full (keep only the layer's input); dots (keep the matmuls' outputs, jax's dots_saveable); "
        "dots_no_batch (those without a batch dimension: the weights' products). Less memory, more step time "
        "(docs/scaling.md)",
        choices=REMAT_POLICIES,
    )
    quantize: str = setting(
        "none",
        "decode with int8 weights, quantized at load per output channel with qwix (never written back): "
        "int8-dynamic (activations quantized per row at run time, int8 x int8 products), int8-weights (weights "
        "converted inside float products), int8 (the one measured faster on this backend); in training only "
        "int8-weights with --lora-rank: QLoRA's frozen base (docs/decoding.md#int8)",
        choices=QUANTIZE_MODES,
    )

    def check(self) -> None:
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"config field 'd_model' ({self.d_model}) must be divisible by 'num_heads' ({self.num_heads})"
            )
        if self.attention_kernel == "cudnn" and (self.dtype != "bfloat16" or self.head_dim % 8):
            raise ConfigError(
                f"config field 'attention_kernel' 'cudnn' needs dtype 'bfloat16' and a head_dim (d_model / "
                f"num_heads) that is a multiple of 8, got dtype {self.dtype!r} and head_dim {self.head_dim}"
            )
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(
                f"config field 'share_embeddings' needs src_vocab_size == tgt_vocab_size, "
                f"got {self.src_vocab_size} and {self.tgt_vocab_size}"
            )
        special = {"pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id}
        special = {name: value for name, value in special.items() if value is not None}
        limits = {
            **dict.fromkeys(special, min(self.src_vocab_size, self.tgt_vocab_size)),
            "decoder_start_id": self.tgt_vocab_size,
        }
        for name, value in {**special, "decoder_start_id": self.decoder_start_id}.items():
            if value is not None and value >= limits[name]:
                raise ConfigError(
                    f"config field {name!r} ({value}) must be a valid id in both vocabularies (< {limits[name]})"
                )
        if len(set(special.values())) != len(special):
            raise ConfigError(f"config fields pad_id, bos_id, eos_id must differ, got {special}")
        if self.bos_id is None and self.decoder_start_id is None:
            raise ConfigError(
                "config field 'decoder_start_id' must be set when there is no bos_id: the decoder needs a first input"
            )
        if self.logits_bias and not self.tie_output:
            raise ConfigError("config field 'logits_bias' is for a tied output; an untied one has 'output_bias'")
        targets = self.lora_target_list
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ConfigError(
                f"config field 'lora_targets' ({self.lora_targets!r}): {unknown or 'nothing'} is not a list of "
                f"{', '.join(LORA_TARGETS)} (--lora-targets)"
            )
        if self.lora_rank:  # A (D_in, r) B (r, D_out) of rank above min(D_in, D_out) adds no expressiveness
            smallest = {t: self.d_model if t != "ffn" else min(self.d_model, self.d_ff) for t in targets}
            target = min(smallest, key=smallest.get)
            if self.lora_rank > smallest[target]:
                raise ConfigError(
                    f"config field 'lora_rank' ({self.lora_rank}) is larger than the {target} matrices' smaller "
                    f"dimension ({smallest[target]}) (--lora-rank)"
                )

    @property
    def lora_target_list(self) -> list[str]:
        """`lora_targets` as its entries ("q, v" and "q,,v" are ["q", "v"])."""
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def start_id(self) -> int:
        """The decoder's first input: decoder_start_id if set, else bos_id."""
        return self.bos_id if self.decoder_start_id is None else self.decoder_start_id

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "config JSON") -> TransformerConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
        return cls.from_dict(values, source=source)

    def compute_settings(self) -> dict[str, Any]:
        """The COMPUTE_FIELDS (dtype, attention kernel, remat, quantization): how to compute, which any parameters
        of the model serve."""
        return {name: getattr(self, name) for name in COMPUTE_FIELDS}


# The presets and recipes are configuration files (JSON) beside this module.
CONFIGS = Path(__file__).resolve().parent / "configs"


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read it as JSON: {e}") from None


# Model presets by name (configs/presets.json): TransformerConfig fields over the defaults, "about" aside.
# Vocabulary sizes are not in them: training takes the tokenizer's.
PRESETS: dict[str, dict[str, Any]] = {
    name: {k: v for k, v in fields.items() if k != "about"}
    for name, fields in _read_config(CONFIGS / "presets.json").items()
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A preset ("tiny", "small", "base") with field overrides applied."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return TransformerConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Settings):
    """Adam with the paper's schedule (section 5.3) and label smoothing (section 5.4), read by both frameworks'
    training code. The defaults are the paper's, except `lr_scale` (short runs of small models often want more)."""

    kind = "optimiser"
    schedule: str = setting(
        "noam",
        "learning-rate schedule: noam (the paper's, set by --lr-scale; for training from scratch); constant, "
        "linear, cosine, inverse_sqrt (fine-tuning: a linear warm-up from 0 to --lr over --warmup-steps, then "
        "constant, a linear or cosine decay to 0 at --decay-steps, or lr * sqrt(warmup / step), as transformers' "
        "get_*_schedule_with_warmup)",
        choices=SCHEDULES,
    )
    lr: float | None = setting(None, "the peak learning rate of the fine-tuning schedules (not noam's)", above=0)
    decay_steps: int | None = setting(
        None, "the step at which linear and cosine decay reach 0 (default: the run's --steps)", at_least=1
    )
    lr_scale: float = setting(
        1.0,
        "multiplies the learning rate lr_scale * d_model^-0.5 * min(step^-0.5, "
        "step * warmup_steps^-1.5) (the paper: 1.0)",
        above=0,
    )
    warmup_steps: int = setting(
        4000,
        "steps of linear learning-rate warm-up: before noam's step^-0.5 decay (the paper's 4000), or from 0 to --lr "
        "(the fine-tuning schedules: set it, a few percent of --steps is usual)",
        at_least=1,
    )
    b1: float = setting(0.9, "Adam beta1", at_least=0, below=1)
    b2: float = setting(0.98, "Adam beta2 (the paper's 0.98, not the usual 0.999)", at_least=0, below=1)
    eps: float = setting(1e-9, "Adam epsilon (the paper's 1e-9)", above=0)
    clip_norm: float | None = setting(None, "clip the global gradient norm to this (default: no clipping)", above=0)
    weight_decay: float = setting(0.0, "decoupled weight decay (AdamW) on weight matrices; 0 is plain Adam", at_least=0)
    label_smoothing: float = setting(
        0.1, "label smoothing epsilon_ls of the cross-entropy (paper 5.4)", at_least=0, below=1
    )
    freeze: str | None = setting(
        None,
        "parameters left as they are (no gradient, no optimiser state), comma-separated: embeddings (token tables "
        "and learned positions), encoder, decoder, or a glob over parameter paths such as 'decoder/layer_[01]/*' "
        "(default: all trained; with LoRA adapters, only they are)",
        metavar="PATTERNS",
    )

    def check(self) -> None:
        if self.schedule == "noam" and self.lr is not None:
            raise ConfigError(
                "optimiser field 'lr' is the peak of --schedule constant/linear/cosine/inverse_sqrt; noam's rate is "
                "set by --lr-scale (--lr)"
            )
        if self.schedule != "noam" and self.lr is None:
            raise ConfigError(f"optimiser field 'lr' is needed with --schedule {self.schedule} (--lr)")
        if self.schedule in ("linear", "cosine") and self.decay_steps is not None:
            if self.decay_steps <= self.warmup_steps:
                raise ConfigError(
                    f"optimiser field 'decay_steps' ({self.decay_steps}) must be after the warm-up "
                    f"(--warmup-steps {self.warmup_steps}) (--decay-steps; its default is the run's --steps)"
                )


# =============================================================================================================
# The data: which text, which tokenizer, which batches
# =============================================================================================================

PATH_FIELDS = ("src", "tgt", "tsv", "valid_src", "valid_tgt", "valid_tsv", "data_cache")


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    """Where a training run's text comes from and how it is cut into batches. No files at all means the built-in
    English -> French numbers task (`jax_transformer.data.default_task`). Paths are stored as given; `absolute()`
    makes them absolute before they go into a checkpoint, so a resume from another directory finds them."""

    kind = "data"
    error = DataError
    src: str | None = setting(None, "training source sentences, one per line (line-aligned with --tgt)", metavar="FILE")
    tgt: str | None = setting(None, "training target sentences, one per line", metavar="FILE")
    tsv: str | None = setting(
        None, "training pairs as source<TAB>target lines (instead of --src/--tgt)", metavar="FILE"
    )
    valid_src: str | None = setting(None, "validation source sentences (for loss, BLEU, chrF)", metavar="FILE")
    valid_tgt: str | None = setting(None, "validation target sentences", metavar="FILE")
    valid_tsv: str | None = setting(None, "validation pairs as source<TAB>target lines", metavar="FILE")
    vocab_size: int = setting(
        8000, "joint SentencePiece vocabulary size, an upper bound", at_least=4, why="(pad, bos, eos, unk)"
    )
    tokenizer_type: str = setting("unigram", "SentencePiece model type", choices=("unigram", "bpe"))
    src_lang: str | None = setting(
        None,
        "a multilingual model's source language code (NLLB's eng_Latn, M2M-100's en, mBART-50's en_XX)",
        metavar="CODE",
    )
    tgt_lang: str | None = setting(
        None, "a multilingual model's target language code, forced as its first token", metavar="CODE"
    )
    language_columns: bool = setting(
        False,
        "TSV lines are src_lang<TAB>tgt_lang<TAB>source<TAB>target: a multilingual model trained and evaluated on "
        "many language pairs in one run, each pair marked with its own codes (validation BLEU/chrF per pair)",
    )
    add_language: str | None = setting(
        None,
        "with --init-from: a new language code for a multilingual model (NLLB-200, mBART-50), added to its "
        "tokenizer as a special token with the next id and to its embedding table as a new row",
        metavar="CODE",
    )
    init_from_language: str | None = setting(
        None,
        "the existing code whose embedding row the new one starts as (default: the mean of every code's row)",
        metavar="CODE",
    )
    max_tokens: int = setting(
        4096,
        "token slots per batch (rows x padded length), all devices together; also of evaluation's loss batches",
        at_least=1,
    )
    row_multiple: int = setting(
        8,
        "rows of every batch are a multiple of this (rounded down, at least this many), so a batch splits evenly "
        "over that many devices x micro-batches; part of the batch plan, so a resume on another device count sees "
        "the same batches (8, as fairseq's --required-batch-size-multiple)",
        at_least=1,
    )
    batching: str = setting(
        "packed",
        "packed: several pairs per row, every batch one shape (one compilation); buckets: one pair per row, "
        "one batch shape (and compilation) per length bucket",
        choices=BATCHINGS,
    )
    pack_length: int | None = setting(
        None,
        "row length of packed batches (default: the longest pair rounded up to a multiple of 8, at most max_len)",
        at_least=2,
        why="(a token and EOS)",
    )
    on_empty: str = setting(
        "skip",
        "a pair with an empty side: skip and count it, or stop with an error naming the line",
        choices=("skip", "error"),
    )
    on_too_long: str = setting(
        "skip",
        "a pair longer than max_len tokens: skip and count it, or stop with an error naming the line",
        choices=("skip", "error"),
    )
    tokenizer_sample: int = setting(
        100_000,
        "the joint SentencePiece tokenizer trains on both sides of at most this many training pairs, drawn at random "
        "from the seed (SentencePiece's unigram trainer needs about 6 GB per million pairs)",
        at_least=1,
    )
    data_cache: str | None = setting(
        None,
        "folder where training files are encoded once into memory-mapped token arrays, read by every later start "
        "(default $JAX_TRANSFORMER_CACHE, else ~/.cache/jax_transformer/corpora)",
        metavar="DIR",
    )

    def check(self) -> None:
        for name in ("add_language", "init_from_language", "src_lang", "tgt_lang"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ConfigError(f"--{name.replace('_', '-')}: an empty language code")
        for split, (src, tgt, tsv) in (
            ("training", (self.src, self.tgt, self.tsv)),
            ("validation", (self.valid_src, self.valid_tgt, self.valid_tsv)),
        ):
            if tsv is not None and (src is not None or tgt is not None):
                raise DataError(f"{split} data: give either a TSV file or a source and a target file, not both")
            if (src is None) != (tgt is None):
                given, missing = ("source", "target") if tgt is None else ("target", "source")
                raise DataError(f"{split} data: a {given} file was given without its {missing} file")
        if self.uses_default_task and (self.valid_src or self.valid_tsv):
            raise DataError("validation files were given without training files (the built-in task has its own)")
        if self.language_columns:
            for split, src, tsv in (("training", self.src, self.tsv), ("validation", self.valid_src, self.valid_tsv)):
                if src is not None or (split == "training" and tsv is None):
                    flag = "--tsv" if split == "training" else "--valid-tsv"
                    raise DataError(
                        f"--language-columns: the {split} pairs must be a TSV file ({flag}) of "
                        f"src_lang<TAB>tgt_lang<TAB>source<TAB>target lines"
                    )
        if self.pack_length is not None and self.batching != "packed":
            raise DataError(
                f"data field 'pack_length' ({self.pack_length}) needs batching='packed', got {self.batching!r}"
            )

    @property
    def uses_default_task(self) -> bool:
        return self.src is None and self.tsv is None

    @property
    def has_validation(self) -> bool:
        return self.uses_default_task or self.valid_src is not None or self.valid_tsv is not None

    def absolute(self) -> DataConfig:
        """The same settings with every file path made absolute."""
        paths = {name: str(Path(getattr(self, name)).absolute()) for name in PATH_FIELDS if getattr(self, name)}
        return dataclasses.replace(self, **paths)


# =============================================================================================================
# The run loop: when to evaluate, save and stop; how to decode
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class LoopConfig(Settings):
    """When the loop evaluates, saves and stops, and what it prints (`samples` also for `evaluate`). How it decodes
    is DecodeConfig's."""

    kind = "loop"
    steps: int = setting(
        20000, "total optimiser steps (a resumed run counts the steps before the resume; 0: save and stop)", at_least=0
    )
    max_minutes: float | None = setting(
        None, "stop after this many minutes of wall time since the command started, then evaluate and save", above=0
    )
    eval_every: int = setting(
        2000, "validate (loss, BLEU, chrF) every this many steps and keep the best checkpoint", at_least=1
    )
    save_every: int = setting(1000, "checkpoint every this many steps (and at evaluations and at the end)", at_least=1)
    keep: int = setting(3, "keep the last this many checkpoints, plus the best", at_least=1)
    eval_beam_size: int = setting(1, "beam width of the BLEU evaluations during training (1: greedy, fast)", at_least=1)
    eval_sentences: int | None = setting(
        None,
        "BLEU/chrF of the evaluations during training on the first this many validation sentences; the final "
        "evaluation uses all (default: all; 0: no BLEU at all, loss only)",
        at_least=0,
    )
    samples: int = setting(5, "sample translations printed by the final evaluation (and by evaluate)", at_least=0)
    progress: bool = setting(True, "show a progress bar")
    tensorboard: bool | None = setting(
        None,
        "also write every metric of metrics.jsonl as TensorBoard events to <run>/tensorboard (tensorboardX, the "
        "tensorboard extra; default: when it is installed)",
    )
    best_metric: str = setting(
        "bleu",
        "what 'better' means for the best checkpoint (the one evaluate/translate/export use) and for --patience: "
        "bleu (validation BLEU of the evaluations during training; the validation loss when --eval-sentences 0 "
        "turns BLEU off) or loss (validation loss, lower is better)",
        choices=BEST_METRICS,
    )
    patience: int | None = setting(
        None,
        "stop when the validation score (--best-metric) has not improved for this many evaluations in a row, "
        "as fairseq's --patience; none: never stop early",
        at_least=1,
        why="(or unset: never stop early)",
    )
    compilation_cache: str | None = setting(
        None,
        "folder of JAX's persistent compilation cache (compiled programs and GPU autotuning reused by later "
        "runs; decoders are also kept as traced, in its programs/ subfolder), or "
        f"'{OFF}' (default: $JAX_COMPILATION_CACHE_DIR, else ~/.cache/jax_transformer/xla)",
        metavar="DIR",
    )
    compile_ahead: bool = setting(
        True, "compile the train step, eval step and decoders ahead in parallel threads, each waited for when needed"
    )
    profile: str | None = setting(
        None,
        "write a jax.profiler trace of steps START:STOP (e.g. 20:25) into <run>/profile (TensorBoard, Perfetto)",
        metavar="START:STOP",
    )

    def check(self) -> None:
        if self.compilation_cache is not None and not self.compilation_cache.strip():
            raise ConfigError(f"loop field 'compilation_cache' must be a folder or '{OFF}', got an empty string")
        self.profile_steps()  # checks the form

    def profile_steps(self) -> tuple[int, int] | None:
        """`profile` as (first step, last step), both counted from 1 and traced; None when not asked for."""
        if self.profile is None:
            return None
        try:
            start, stop = (int(part) for part in str(self.profile).split(":"))
        except ValueError:
            start = stop = 0
        if not 1 <= start <= stop:
            raise ConfigError(
                f"loop field 'profile' must be START:STOP with 1 <= START <= STOP (steps counted from 1), "
                f"got {self.profile!r}"
            )
        return start, stop


DECODE_RULES = ("gnmt", "transformers")
EARLY_STOPPING = ("false", "true", "never")


MAX_ALPHA = 10.0  # ((5 + 1024) / 6) ** 10 ~ 2e22: the scores of 1,024-token outputs stay apart in float32


@dataclasses.dataclass(frozen=True)
class DecodeConfig(Settings):
    """Every decoding choice, in one place: the rules, the search (beams or sampling), lengths, bans, what comes
    out (n-best). Resolved once per command (a flag, else the run's stored choice, else what an imported model's
    generation_config says, else the default) and stored with a run: a model imported from transformers decodes
    as its `generate` does. `decoding.decoder` turns it into a search. A target prefix is a sentence's, not a
    setting: `translation.translate(prefixes=...)`, or a second TSV column of `translate --input`."""

    kind = "decode"
    beam_size: int = setting(
        4,
        "beam width of decoding (the final evaluation; evaluate, translate, verify); 1 is greedy search",
        at_least=1,
    )
    alpha: float = setting(
        0.6,
        "length penalty exponent of beam search: gnmt rules ((5+len)/6)^alpha (GNMT), transformers rules "
        "len^alpha (its length_penalty)",
        at_least=0,
    )
    n_best: int = setting(
        1,
        "hypotheses returned per sentence, best first (at most --beam-size; with --do-sample, independent samples)",
        at_least=1,
    )
    max_len_a: float = setting(
        1.5, "gnmt rules: a sentence of n source tokens may produce max_len_a x n + max_len_b tokens", at_least=0
    )
    max_len_b: float = setting(10.0, "gnmt rules: see --max-len-a", at_least=0)
    do_sample: bool = setting(
        False,
        "draw each token at random from the model's distribution (warped by --temperature, --top-k, --top-p) "
        "instead of searching: one hypothesis per sample, --beam-size does not apply (transformers' do_sample)",
    )
    temperature: float = setting(1.0, "sampling: divide the scores by this (below 1: sharper)", above=0)
    top_k: int = setting(0, "sampling: draw from the this many most likely tokens only (0: all)", at_least=0)
    top_p: float = setting(
        1.0,
        "sampling: draw from the smallest set of most likely tokens whose probability exceeds this (nucleus; 1: all)",
        above=0,
    )
    sample_seed: int = setting(
        0,
        "sampling: the random seed; a sentence's sample depends on the seed and the sentence alone, not on its batch",
        at_least=0,
    )
    rules: str = setting(
        "gnmt",
        "gnmt: this project's beam search (log P / ((5+|y|)/6)^alpha, fairseq's finishing rule, outputs up to 1.5 x "
        "the source + 10 tokens, PAD and BOS never produced); transformers: transformers' generate (log P / "
        "|y|^alpha, its early stopping, max_length, banned ids and forced EOS), for imported models",
        choices=DECODE_RULES,
    )
    early_stopping: str = setting(
        "false", "transformers rules: true, false or never, as transformers' early_stopping", choices=EARLY_STOPPING
    )
    max_length: int | None = setting(
        None,
        "transformers rules: the longest output, the decoder's start token included (default: max_len)",
        at_least=2,
    )
    banned: str = setting(
        "", "transformers rules: ids never produced, comma-separated (its one-token bad_words_ids)", metavar="IDS"
    )
    forced_eos: bool = setting(
        False, "transformers rules: only EOS may come at the last position (forced_eos_token_id)"
    )
    min_length: int = setting(
        0,
        "no EOS before the output (the decoder's start token included, as transformers counts) is this long",
        at_least=0,
    )
    forced_bos: int | None = setting(
        None,
        "transformers rules: the first output token (forced_bos_token_id; a multilingual model's target language "
        "code, which --tgt-lang sets)",
        at_least=0,
    )
    repetition_penalty: float = setting(
        1.0,
        "transformers rules: the score of a token already in the output (start token included) is divided by this "
        "when positive, multiplied when negative (repetition_penalty; 1: off)",
        above=0,
    )
    no_repeat_ngram_size: int = setting(
        0,
        "transformers rules: no n-gram of this many tokens occurs twice in an output, start token included "
        "(no_repeat_ngram_size; 0: off)",
        at_least=0,
    )
    alignments: bool = setting(
        False,
        "word alignments of each hypothesis, source-target pairs i-j (Pharaoh format, 0-based, as fast_align and "
        "fairseq print): each target subword aligned to the source subword its --alignment-layer's cross-attention, "
        "averaged over heads, weighs most (translate's tsv and jsonl outputs, score, the service)",
    )
    alignment_layer: int = setting(
        -1,
        "the decoder layer whose cross-attention gives --alignments: 0 is the first, -1 the last (fairseq's default)",
    )
    constraint_order: str = setting(
        "unordered",
        "lexical constraints (translate --constraints, a jsonl line's 'constraints'): unordered, each phrase "
        "anywhere in the output; ordered, in the order given, one after another (fairseq's --constraints ordered)",
        choices=("unordered", "ordered"),
    )
    suppress: str = setting(
        "",
        "phrases that never appear in an output, separated by |, each tokenized as target text is (CTranslate2's "
        "suppress_sequences)",
        metavar="PHRASES",
    )
    constraint_size: str = setting(
        "",
        "PxM: every sentence's lexical constraints padded to P phrases of M tokens, one program for all (e.g. 2x8; "
        "serve compiles it before it says ready, and refuses more or longer phrases); none: the smallest of a few "
        "sizes that fits",
        metavar="PxM",
    )

    def check(self) -> None:
        self.banned_ids()  # checks the form
        self.phrase_size()
        if self.alpha > MAX_ALPHA:
            raise ConfigError(
                f"decode field 'alpha' must be at most {MAX_ALPHA:g}, got {self.alpha} (--alpha): a length penalty to "
                f"a larger power overflows float32 for long outputs, and every score becomes -0"
            )
        if self.top_p > 1:
            raise ConfigError(f"decode field 'top_p' must be in (0, 1], got {self.top_p} (--top-p)")
        if self.n_best > self.beams and not self.do_sample:
            raise ConfigError(
                f"--n-best {self.n_best}: more than the {self.beams} hypothes{'is' if self.beams == 1 else 'es'} "
                f"a beam search of --beam-size {self.beam_size} keeps; raise --beam-size or lower --n-best"
            )
        sampling = {"temperature": self.temperature != 1.0, "top_k": self.top_k, "top_p": self.top_p != 1.0}
        for name in (name for name, given in sampling.items() if given and not self.do_sample):
            raise ConfigError(
                f"--{name.replace('_', '-')} (decode field '{name}') applies to sampling: add --do-sample"
            )
        repeats = {
            "repetition_penalty": self.repetition_penalty != 1.0,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
        }
        for name in (name for name, given in repeats.items() if given):
            if self.rules != "transformers":
                raise ConfigError(
                    f"--{name.replace('_', '-')} (decode field '{name}') is one of transformers' rules: it needs "
                    f"--rules transformers; this decoding has rules={self.rules!r}"
                )

    def phrase_size(self) -> tuple[int, int] | None:
        """--constraint-size as (P, M) (None: none); a ConfigError for another form (its range: the decoder's)."""
        import re

        found = re.fullmatch(r"(\d+)x(\d+)", self.constraint_size)
        most = (8, 16)  # decoding.constraints' PHRASE_SIZES[-1] and TOKEN_SIZES[-1] (a test holds them equal)
        if self.constraint_size and (found is None or not all(1 <= int(found[i]) <= most[i - 1] for i in (1, 2))):
            raise ConfigError(
                f"decode field 'constraint_size' must be PxM, phrases per sentence x tokens per phrase, P in 1..8 and "
                f"M in 1..16 (e.g. 2x8), got {self.constraint_size!r} (--constraint-size)"
            )
        return (int(found[1]), int(found[2])) if found else None

    def banned_ids(self) -> tuple[int, ...]:
        try:
            return tuple(int(part) for part in self.banned.split(",") if part.strip())
        except ValueError:
            raise ConfigError(f"decode field 'banned' must be comma-separated ids, got {self.banned!r}") from None

    @property
    def beams(self) -> int:
        """Hypotheses a search keeps per sentence: --beam-size, or 1 when sampling."""
        return 1 if self.do_sample else self.beam_size

    def describe(self) -> str:
        """The decoding in words, for logs: what differs from the defaults of its rules."""
        if self.do_sample:
            how = f"sampling (temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, "
            how += f"seed {self.sample_seed})"
        else:
            how = "greedy search" if self.beam_size == 1 else f"beam search of {self.beam_size}, alpha {self.alpha:g}"
        default = DecodeConfig(rules=self.rules).to_dict()
        shown = ("n_best", "max_len_a", "max_len_b", "early_stopping", "max_length", "banned", "forced_eos",
                 "min_length", "forced_bos", "repetition_penalty", "no_repeat_ngram_size", "constraint_order",
                 "suppress", "constraint_size")  # fmt: skip
        rest = ", ".join(f"{k} {v}" for k, v in self.to_dict().items() if k in shown and v != default[k])
        return f"{self.rules} rules, {how}" + (f", {rest}" if rest else "")

    def aligned_layer(self, config: TransformerConfig) -> int | None:
        """The decoder layer (0-based) whose cross-attention gives `config`'s model's --alignments (None: none asked
        for); a ConfigError naming the field where the model has no such layer."""
        if not self.alignments:
            return None
        n, layer = config.num_decoder_layers, self.alignment_layer
        if not -n <= layer < n:
            raise ConfigError(
                f"decode field 'alignment_layer' is {layer} (--alignment-layer), but this model has {n} decoder "
                f"layers: give one of 0..{n - 1}, or -1..-{n} counted from the top"
            )
        return layer % n

    def output_limit(self, config: TransformerConfig) -> int:
        """transformers rules: the longest output of `config`'s model, its start token included: max_length, at
        most what the model's positions allow (max_len + 1; a stored setting above it decodes up to the limit)."""
        return min(self.max_length or config.max_len + 1, config.max_len + 1)


def decoding_in_one_group(stored: Mapping[str, Any]) -> dict[str, Any]:
    """Stored settings with the beam width and length penalty in the "decode" group: runs saved before every
    decoding choice was a DecodeConfig field kept them in "loop"."""
    loop, decode = dict(stored.get("loop", {})), dict(stored.get("decode", {}))
    for name in ("beam_size", "alpha"):
        if name in loop:
            decode.setdefault(name, loop.pop(name))
    return {**stored, "loop": loop, "decode": decode}


def beam_limit(vocab_size: int) -> int:
    """The widest beam a target vocabulary of `vocab_size` ids takes (2 x beam + 3 <= vocabulary): the first step
    takes the 2 x beam best extensions of one beam, and PAD, BOS and EOS may be banned."""
    return max(0, (vocab_size - 3) // 2)


def check_decoding(
    config: TransformerConfig, decode: DecodeConfig, beams: Mapping[str, Iterable[int]], given: Iterable[str] = ()
) -> None:
    """A decoding choice against the model it decodes, before anything compiles: every beam width (`beams`: flag
    -> widths, e.g. {"--beam-size": [1, 4]}) and the DecodeConfig's lengths and ids. A ConfigError names the flag
    and the model's limit. `given`: the DecodeConfig fields given as flags; a max_length above the model's limit
    is an error when asked for, and the limit when stored with an imported model."""
    vocab = config.tgt_vocab_size
    for flag, widths in beams.items():
        for width in widths:
            if width > beam_limit(vocab):
                raise ConfigError(
                    f"{flag} {width}: more than this model's target vocabulary of {vocab} ids allows ("
                    f"{beam_limit(vocab)}): the first step takes the 2 x beam best extensions of one "
                    f"beam, and PAD, BOS and EOS may be banned"
                )
    limit = config.max_len + 1  # output tokens and the decoder's start token: the model's positions
    if "max_length" in given and decode.max_length is not None and decode.max_length > limit:
        raise ConfigError(
            f"--max-length {decode.max_length}: more than this model produces (max_len {config.max_len} positions: "
            f"at most {limit}, the start token included)"
        )
    longest = decode.output_limit(config)
    if decode.min_length > longest:
        raise ConfigError(
            f"--min-length {decode.min_length}: more than the longest output, {longest} (--max-length, at most "
            f"the model's max_len + 1), so no output could end"
        )
    for flag, ids in (("--forced-bos", [] if decode.forced_bos is None else [decode.forced_bos]),
                      ("--banned", decode.banned_ids())):  # fmt: skip
        for i in ids:
            if not 0 <= i < vocab:
                raise ConfigError(f"{flag} {i}: not an id of this model's target vocabulary [0, {vocab})")
    decode.aligned_layer(config)  # a ConfigError where the model has no such layer


# =============================================================================================================
# The devices and processes
# =============================================================================================================

# Timeouts (seconds) when none are given: short on one machine (loopback), JAX's own defaults between machines.
LOOPBACK_TIMEOUTS = {"init": 30, "heartbeat": 10}
NETWORK_TIMEOUTS = {"init": 300, "heartbeat": 100}


@dataclasses.dataclass(frozen=True)
class ServeConfig(Settings):
    """How `train.py serve` listens, batches and refuses (`jax_transformer.serving.service`)."""

    kind = "serve"
    host: str = setting(
        "127.0.0.1", "address to listen on (0.0.0.0: every interface, reachable from other hosts)", metavar="HOST"
    )
    port: int = setting(5000, "TCP port (LibreTranslate's default; 0: any free port, printed at start)", at_least=0,
                        below=65536)  # fmt: skip
    max_tokens: int = setting(
        4096, "source tokens decoded together: requests that arrive within --batch-window-ms share a batch", at_least=1
    )
    batch_window_ms: float = setting(
        5.0, "how long the first request of a batch waits for others to join it (milliseconds)", at_least=0.0
    )
    max_queue: int = setting(
        1024, "sentences waiting to be decoded; a request that would exceed it is answered 503", at_least=1
    )
    max_request_bytes: int = setting(1_000_000, "largest request body; larger ones are answered 413", at_least=1)
    max_beam: int = setting(
        8, "largest beam_size and n_best (LibreTranslate's alternatives + 1) a request may ask for", at_least=1
    )
    max_connections: int = setting(
        256, "connections served at once; more are answered 503 (uvicorn's limit_concurrency)", at_least=1
    )
    api_key_file: str | None = setting(
        None,
        "a file holding the API key every request must carry (LibreTranslate's api_key); none: no key",
        metavar="FILE",
    )
    languages: str | None = setting(
        None,
        "SRC-TGT codes of a model without language codes, as LibreTranslate names them (e.g. de-en); default: "
        "the built-in task's en-fr, or an OPUS-MT name's pair",
        metavar="PAIRS",
    )
    shutdown_timeout_s: float = setting(
        60.0, "on SIGTERM, how long requests in flight may take to finish before the process exits", above=0.0
    )
    allow: str = setting(
        "",
        "decoding options a request may choose besides the service's own, as FIELD=V1,V2 (e.g. rules=transformers "
        "no_repeat_ngram_size=0,3 beam_size=1,4): every program they make is compiled at start; other values of "
        "such options are refused (alpha, temperature, top_p, sample_seed, min_length and repetition_penalty's value "
        "are arguments of a program: any is taken)",
        metavar="FIELD=VALUES",
    )
    header_timeout_s: float = setting(
        10.0, "a connection that sends no whole request head within this (after connecting or an answer) is closed",
        above=0.0,
    )  # fmt: skip
    body_timeout_s: float = setting(
        30.0, "a request whose body has not arrived within this after its head is answered 408", above=0.0
    )
    max_client_connections: int | None = setting(
        None, "connections one client address may hold at once; more are closed (default: a quarter of "
        "--max-connections)", at_least=1,
    )  # fmt: skip
    req_limit: int = setting(
        0, "requests per minute a client (its API key, else its address) may send; more are answered 429 (0: none)",
        at_least=0,
    )  # fmt: skip
    glossary: str | None = setting(
        None,
        "a glossary, lines of 'source term<TAB>target term' (as translate --glossary): in every sentence of every "
        "beam-search request, a source term's target term becomes a constraint; needs --constraint-size",
        metavar="FILE",
    )
    char_limit: int = setting(
        0, "characters a request may ask to translate; more are answered 400 (LibreTranslate's; 0: none)", at_least=0
    )
    models: str | None = setting(
        None,
        "a JSON file of the models to serve behind this one address, each with its name, checkpoint and pairs "
        "(docs/serving.md); instead of --checkpoint",
        metavar="FILE",
    )
    log_requests: bool = setting(
        False, "the access log (one JSON line per request on stderr) carries each request's text and translation"
    )


@dataclasses.dataclass(frozen=True)
class ParallelConfig(Settings):
    """How one run uses devices and processes (`jax_transformer.training.distributed`). It describes the machine, not
    the run: a resume may change every field. Every process of a multi-process run gets the same flags except
    --process-id."""

    kind = "parallel"
    parallel: str = setting(
        "auto",
        "how a step uses the devices: jit (one device), pmap (this process's devices), sharded (jax.jit over a "
        "mesh of all devices of all processes); auto: jit on one device, sharded on more",
        choices=("auto",) + PARALLEL_MODES,
    )
    accumulate: int = setting(
        1,
        "gradient accumulation: split each batch into this many micro-batches run one after the other in one "
        "compiled step (same update, about 1/K of the activation memory)",
        at_least=1,
    )
    mesh: str | None = setting(
        None,
        "the sharded step's mesh, e.g. data=2,fsdp=2,tensor=2: batch rows over data and fsdp, the state split over "
        "fsdp (each large array) and tensor (heads, feed-forward units); an axis left out is 1, data takes the "
        "devices the others leave; default: all devices on data (docs/scaling.md)",
        metavar="AXES",
    )
    coordinator: str | None = setting(
        None,
        "HOST:PORT where process 0 runs JAX's coordination service (multi-process runs; same on every process)",
        metavar="HOST:PORT",
    )
    num_processes: int | None = setting(None, "how many processes take part (with --coordinator)", at_least=1)
    process_id: int | None = setting(
        None, "this process's number, 0 .. num_processes - 1 (with --coordinator)", at_least=0
    )
    distributed: bool = setting(
        False,
        "call jax.distributed.initialize() and let it detect the cluster (TPU pods, Slurm, Open MPI); "
        "--coordinator/--num-processes/--process-id, if given, are passed on",
    )
    init_timeout: int | None = setting(
        None,
        f"seconds to wait for the coordinator and every process to join; none: {LOOPBACK_TIMEOUTS['init']} on "
        f"loopback, {NETWORK_TIMEOUTS['init']} otherwise",
        at_least=1,
    )
    heartbeat_timeout: int | None = setting(
        None,
        "seconds without a heartbeat after which a process counts as dead and the others stop; none: "
        f"{LOOPBACK_TIMEOUTS['heartbeat']} on loopback, {NETWORK_TIMEOUTS['heartbeat']} otherwise",
        at_least=1,
    )

    def check(self) -> None:
        if self.coordinator is not None:
            host_port(self.coordinator)  # a clear error for a malformed address
            missing = [
                flag
                for flag, v in (("--num-processes", self.num_processes), ("--process-id", self.process_id))
                if v is None
            ]
            if missing and not self.distributed:
                raise ConfigError(f"--coordinator {self.coordinator} needs {' and '.join(missing)} as well")
        elif not self.distributed and (self.num_processes is not None or self.process_id is not None):
            raise ConfigError("--num-processes and --process-id need --coordinator HOST:PORT (or --distributed)")
        if self.num_processes is not None and self.process_id is not None and self.process_id >= self.num_processes:
            raise ConfigError(
                f"--process-id {self.process_id} is out of range for --num-processes {self.num_processes} "
                f"(process ids are 0 .. {self.num_processes - 1})"
            )
        if self.multi_process and self.parallel in ("jit", "pmap"):
            raise ConfigError(
                f"--parallel {self.parallel} runs in one process; a multi-process run needs --parallel sharded "
                f"(or auto)"
            )

    @property
    def multi_process(self) -> bool:
        """True when this run joins other processes through jax.distributed."""
        return self.distributed or (self.coordinator is not None and (self.num_processes or 1) > 1)

    def timeouts(self) -> dict[str, int]:
        """{"init", "heartbeat"} in seconds: the given ones, else short on loopback, JAX's own otherwise."""
        loopback = self.coordinator is not None and is_loopback(host_port(self.coordinator)[0])
        defaults = LOOPBACK_TIMEOUTS if loopback else NETWORK_TIMEOUTS
        return {
            "init": self.init_timeout or defaults["init"],
            "heartbeat": self.heartbeat_timeout or defaults["heartbeat"],
        }


def host_port(address: str) -> tuple[str, int]:
    """ "HOST:PORT" (or "[IPv6]:PORT") -> (host, port); ConfigError naming the address when it is not one."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator {address!r}: expected HOST:PORT with a port in 1..65535, e.g. 10.0.0.1:8476")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# =============================================================================================================
# Recipes
# =============================================================================================================

# The settings groups a recipe (and a run) holds, by name.
GROUPS = {
    "model": TransformerConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "loop": LoopConfig,
    "decode": DecodeConfig,
}


# Named recipes (configs/recipes/NAME.json): the settings of a measured training command (`train.py train --recipe
# NAME`). A recipe fills each group below what is given; "preset" is the model preset it starts from. A JSON file of
# the same form is a recipe too (`--recipe my-recipe.json`: {"about": ..., "preset": ..., "model": {...}, "data":
# {...}, "optim": {...}, "loop": {...}}, every key optional). "numbers" is the built-in task's: sized to reach a
# useful model on 2 CPU cores in about two minutes. Measured results: docs/quality.md.
RECIPES: dict[str, dict[str, Any]] = {
    path.stem: _read_config(path) for path in sorted((CONFIGS / "recipes").glob("*.json"))
}


def load_recipe(name: str) -> dict[str, Any]:
    """RECIPES[name], or the recipe in the JSON file `name` (see RECIPES), checked: ConfigError naming the file
    and the group for unknown keys or fields, or values the settings refuse."""
    if name in RECIPES:
        return RECIPES[name]
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}: neither one of {sorted(RECIPES)} nor a recipe JSON file")
    try:
        recipe = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"recipe {path}: cannot read it as JSON: {e}") from None
    known = {"about", "preset", *GROUPS}
    if isinstance(recipe, dict):
        recipe = decoding_in_one_group(recipe)  # a recipe written when beam_size and alpha were loop settings
    if not isinstance(recipe, dict) or set(recipe) - known:
        unknown = sorted(set(recipe) - known) if isinstance(recipe, dict) else type(recipe).__name__
        raise ConfigError(f"recipe {path}: a JSON object with keys among {sorted(known)} expected, got {unknown}")
    if recipe.get("preset") is not None and recipe["preset"] not in PRESETS:
        raise ConfigError(f"recipe {path}: unknown preset {recipe['preset']!r}; choose one of {sorted(PRESETS)}")
    for group, cls in GROUPS.items():
        values = recipe.get(group, {})
        if not isinstance(values, dict):
            raise ConfigError(f"recipe {path}: {group!r} must be a JSON object of {cls.__name__} fields")
        cls.from_dict(values, source=f"recipe {path}, {group!r}")
    return recipe
