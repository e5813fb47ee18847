"""One framework-free description of the model and its optimiser, read by the Flax model and its PyTorch twin alike.

`TransformerConfig` (the architecture) and `OptimConfig` (Adam, the schedule, label smoothing) are frozen
dataclasses: hashable (so they can be static arguments under `jax.jit`), validated on construction, and
round-tripped through JSON. `train.py` makes one flag per field, named after it (`d_model` -> `--d-model`), with
the help text stored in the field's metadata (`setting(default, help)`), so a setting has one name from the
command line to the dataclass. Nothing here imports jax or torch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

POSITIONS = ("sinusoidal", "learned")
ACTIVATIONS = ("relu", "gelu")
DTYPES = ("float32", "bfloat16")
ATTENTION_KERNELS = ("explicit", "xla", "cudnn")
# How the model computes, not what it is: the same parameters serve every value, so checkpoints and weight files
# ignore these fields when they compare configs (a bfloat16 run evaluates or resumes in float32 and back).
COMPUTE_FIELDS = ("dtype", "attention_kernel")


class ConfigError(ValueError):
    """A config field has a value the model cannot use; the message names the field."""


def setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its help text (shown by `train.py --help` for the flag of the same name) and, for
    a string, the values it may take."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def settings_from_dict(cls, values: Mapping[str, Any], source: str):
    """`cls(**values)` for a settings dataclass; unknown keys are a ConfigError that lists them and the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown {cls.__name__} field(s) {unknown}; known fields are {sorted(known)}")
    return cls(**dict(values))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    # --- vocabulary -------------------------------------------------------------------------------
    src_vocab_size: int = setting(32000, "source token ids are in [0, src_vocab_size)")
    tgt_vocab_size: int = setting(32000, "target token ids are in [0, tgt_vocab_size)")
    pad_id: int = setting(0, "padding id in both vocabularies; masked out of attention and of the loss")
    bos_id: int = setting(1, "first decoder input token")
    eos_id: int = setting(2, "end of sentence; decoding stops when every sequence has emitted it")
    # --- sizes (defaults: the paper's base model, Table 3) ------------------------------------------
    d_model: int = setting(512, "width of every residual stream")
    num_heads: int = setting(8, "attention heads; d_model must be divisible by it")
    d_ff: int = setting(2048, "inner width of the position-wise feed-forward network")
    num_encoder_layers: int = setting(6, "encoder layers")
    num_decoder_layers: int = setting(6, "decoder layers")
    max_len: int = setting(256, "longest source or target sequence in tokens, BOS/EOS included (positions table)")
    # --- regularisation (all off in eval / deterministic mode) --------------------------------------
    dropout: float = setting(0.1, "residual dropout on each sub-layer output before the residual add (paper 5.4)")
    attention_dropout: float = setting(0.0, "dropout on attention probabilities (the Annotated Transformer: 0.1)")
    activation_dropout: float = setting(0.0, "dropout inside the feed-forward net, after the activation")
    embedding_dropout: float = setting(0.1, "dropout on token embedding + position encoding (paper 5.4)")
    # --- architecture switches -----------------------------------------------------------------------
    norm_first: bool = setting(False, "pre-norm x + f(LN(x)) instead of the paper's post-norm x = LN(x + f(x))")
    final_norm: bool = setting(False, "a LayerNorm after the last encoder and decoder layer (usual with pre-norm)")
    layer_norm_eps: float = setting(1e-5, "LayerNorm epsilon (torch's default)")
    positions: str = setting(
        "sinusoidal", "position encoding: the paper's interleaved sin/cos table, or learned", choices=POSITIONS
    )
    scale_embeddings: bool = setting(True, "multiply token embeddings by sqrt(d_model) (paper 3.4)")
    share_embeddings: bool = setting(False, "one embedding table for source and target (needs equal vocab sizes)")
    tie_output: bool = setting(True, "output projection = target embedding transposed, no bias (paper 3.4)")
    activation: str = setting(
        "relu", "feed-forward activation: relu (the paper) or exact (erf) gelu", choices=ACTIVATIONS
    )
    qkv_bias: bool = setting(True, "bias on the query/key/value/output projections of attention")
    ffn_bias: bool = setting(True, "bias on the feed-forward layers linear1 and linear2")
    norm_bias: bool = setting(True, "bias (beta) of every LayerNorm, the final norms included")
    output_bias: bool = setting(True, "bias of the untied output projection (a tied output never has one)")
    # --- how to compute (COMPUTE_FIELDS: run settings, not architecture) -------------------------------
    dtype: str = setting(
        "float32",
        "compute dtype of every matmul: float32, or bfloat16 mixed precision (parameters, residual stream, "
        "LayerNorm, softmax, loss and optimiser stay float32; README, 'GPU and TPU')",
        choices=DTYPES,
    )
    attention_kernel: str = setting(
        "explicit",
        "attention where its probabilities are not asked for: explicit (softmax(QK^T/sqrt(d))V written out), "
        "xla or cudnn (jax.nn.dot_product_attention; cudnn: a CUDA GPU, bfloat16, head_dim a multiple of 8)",
        choices=ATTENTION_KERNELS,
    )

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived -----------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    # --- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> TransformerConfig:
        """Builds a config from a mapping; unknown keys are an error that lists them (and `source`)."""
        return settings_from_dict(cls, values, source)

    @classmethod
    def from_json(cls, text: str, source: str = "config JSON") -> TransformerConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from e
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(values).__name__}")
        return cls.from_dict(values, source=source)

    def replace(self, **changes: Any) -> TransformerConfig:
        """A copy with some fields changed (validated again); unknown names are an error."""
        return TransformerConfig.from_dict({**self.to_dict(), **changes}, source="replace()")

    def diff(self, other: TransformerConfig) -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ, as {name: (self's, other's)}."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def compute_settings(self) -> dict[str, Any]:
        """The COMPUTE_FIELDS (dtype, attention kernel): how to compute, which any parameters of the model serve."""
        return {name: getattr(self, name) for name in COMPUTE_FIELDS}


_INT_FIELDS = (
    "src_vocab_size",
    "tgt_vocab_size",
    "pad_id",
    "bos_id",
    "eos_id",
    "d_model",
    "num_heads",
    "d_ff",
    "num_encoder_layers",
    "num_decoder_layers",
    "max_len",
)
_FLOAT_FIELDS = ("dropout", "attention_dropout", "activation_dropout", "embedding_dropout", "layer_norm_eps")
_CHOICE_FIELDS = {
    "positions": POSITIONS,
    "activation": ACTIVATIONS,
    "dtype": DTYPES,
    "attention_kernel": ATTENTION_KERNELS,
}
_BOOL_FIELDS = (
    "norm_first",
    "final_norm",
    "scale_embeddings",
    "share_embeddings",
    "tie_output",
    "qkv_bias",
    "ffn_bias",
    "norm_bias",
    "output_bias",
)


def _validate(c: TransformerConfig) -> None:
    for name in _INT_FIELDS:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"config field {name!r} must be an int, got {v!r}")
    for name in _FLOAT_FIELDS:
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"config field {name!r} must be a number, got {v!r}")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"config field {name!r} must be true or false, got {getattr(c, name)!r}")
    for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "max_len"):
        if getattr(c, name) < 1:
            raise ConfigError(f"config field {name!r} must be >= 1, got {getattr(c, name)}")
    for name in ("num_encoder_layers", "num_decoder_layers"):
        if getattr(c, name) < 0:
            raise ConfigError(f"config field {name!r} must be >= 0, got {getattr(c, name)}")
    if c.d_model % c.num_heads:
        raise ConfigError(f"config field 'd_model' ({c.d_model}) must be divisible by 'num_heads' ({c.num_heads})")
    for name in ("dropout", "attention_dropout", "activation_dropout", "embedding_dropout"):
        if not 0.0 <= getattr(c, name) < 1.0:
            raise ConfigError(f"config field {name!r} must be in [0, 1), got {getattr(c, name)}")
    if not c.layer_norm_eps > 0:
        raise ConfigError(f"config field 'layer_norm_eps' must be > 0, got {c.layer_norm_eps}")
    for name, choices in _CHOICE_FIELDS.items():
        if getattr(c, name) not in choices:
            raise ConfigError(f"config field {name!r} must be one of {choices}, got {getattr(c, name)!r}")
    if c.attention_kernel == "cudnn" and (c.dtype != "bfloat16" or c.head_dim % 8):
        raise ConfigError(
            f"config field 'attention_kernel' 'cudnn' needs dtype 'bfloat16' and a head_dim (d_model / num_heads) "
            f"that is a multiple of 8, got dtype {c.dtype!r} and head_dim {c.head_dim}"
        )
    if c.share_embeddings and c.src_vocab_size != c.tgt_vocab_size:
        raise ConfigError(
            f"config field 'share_embeddings' needs src_vocab_size == tgt_vocab_size, "
            f"got {c.src_vocab_size} and {c.tgt_vocab_size}"
        )
    special = {"pad_id": c.pad_id, "bos_id": c.bos_id, "eos_id": c.eos_id}
    for name, v in special.items():
        if not 0 <= v < min(c.src_vocab_size, c.tgt_vocab_size):
            raise ConfigError(
                f"config field {name!r} ({v}) must be a valid id in both vocabularies "
                f"(< {min(c.src_vocab_size, c.tgt_vocab_size)})"
            )
    if len(set(special.values())) != 3:
        raise ConfigError(f"config fields pad_id, bos_id, eos_id must differ, got {special}")


# Size presets. Vocabulary sizes are placeholders: training replaces them with the tokenizer's.
PRESETS: dict[str, dict[str, Any]] = {
    # a few thousand parameters: unit tests and smoke runs
    "tiny": dict(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, max_len=64),
    # the common "small Transformer" of Multi30k papers: 3+3 layers, d_model 256
    "small": dict(d_model=256, num_heads=4, d_ff=1024, num_encoder_layers=3, num_decoder_layers=3, max_len=128),
    # the paper's base model
    "base": dict(),
}


def preset(name: str, **overrides: Any) -> TransformerConfig:
    """A preset ("tiny", "small", "base") with field overrides applied."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return TransformerConfig.from_dict({**PRESETS[name], **overrides}, source=f"preset {name!r}")


# =============================================================================================================
# The optimiser: Adam with the paper's schedule (section 5.3) and label smoothing (section 5.4)
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimiser and loss settings, read by `jax_transformer.training` and `torch_reference.training` alike. The
    defaults are the paper's, except `lr_scale` (the paper's is 1.0; small models and short runs often want more)."""

    lr_scale: float = setting(
        1.0,
        "multiplies the learning rate lr_scale * d_model^-0.5 * min(step^-0.5, "
        "step * warmup_steps^-1.5) (the paper: 1.0)",
    )
    warmup_steps: int = setting(4000, "steps of linear learning-rate warm-up before the step^-0.5 decay")
    b1: float = setting(0.9, "Adam beta1")
    b2: float = setting(0.98, "Adam beta2 (the paper's 0.98, not the usual 0.999)")
    eps: float = setting(1e-9, "Adam epsilon (the paper's 1e-9)")
    clip_norm: float | None = setting(None, "clip the global gradient norm to this (default: no clipping)")
    weight_decay: float = setting(0.0, "decoupled weight decay (AdamW) on weight matrices; 0 is plain Adam")
    label_smoothing: float = setting(0.1, "label smoothing epsilon_ls of the cross-entropy (paper 5.4)")

    def __post_init__(self) -> None:
        _check_types(
            self,
            ints=("warmup_steps",),
            floats=("lr_scale", "b1", "b2", "eps", "weight_decay", "label_smoothing"),
            optional_floats=("clip_norm",),
        )
        if self.warmup_steps < 1:
            raise ConfigError(f"optimiser field 'warmup_steps' must be >= 1, got {self.warmup_steps}")
        if not self.lr_scale > 0:
            raise ConfigError(f"optimiser field 'lr_scale' must be > 0, got {self.lr_scale}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"optimiser field {name!r} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"optimiser field 'eps' must be > 0, got {self.eps}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ConfigError(
                f"optimiser field 'clip_norm' must be > 0 (or null for no clipping), got {self.clip_norm}"
            )
        if self.weight_decay < 0:
            raise ConfigError(f"optimiser field 'weight_decay' must be >= 0, got {self.weight_decay}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"optimiser field 'label_smoothing' must be in [0, 1), got {self.label_smoothing}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "optimiser settings") -> OptimConfig:
        return settings_from_dict(cls, values, source)


def _check_types(obj, *, ints=(), floats=(), optional_floats=()) -> None:
    """Type checks with the field's name in the message (JSON and flags give ints where floats are meant: fine)."""
    kind = type(obj).__name__
    for name in ints:
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{kind} field {name!r} must be an int, got {v!r}")
    for name in floats + optional_floats:
        v = getattr(obj, name)
        if v is None and name in optional_floats:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{kind} field {name!r} must be a number, got {v!r}")
