"""Weight files for PyTorch, the one place that reads and writes them: `export_weights` writes Flax parameters as a
`torch_reference` state_dict with the config and tokenizer inside, as a torch.save file or a safetensors file (no
pickle: reading it runs no code from the file), and `import_weights` reads either back. docs/internals.md#export."""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_transformer.checkpoint.manager import check_config
from jax_transformer.data.tokenizer import Tokenizer, load_tokenizer
from jax_transformer.errors import CheckpointError, UsageError
from jax_transformer.files import replaced
from jax_transformer.settings.config import TransformerConfig

TORCH_FORMAT = "jax_transformer.torch_export.v1"
SAFETENSORS_FORMAT = "jax_transformer.safetensors_export.v1"
FORMATS = ("torch", "safetensors")

# A safetensors file: an 8-byte little-endian header length N, then N bytes of JSON starting with "{".
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024  # the limit the safetensors library itself enforces


# --- writing ---------------------------------------------------------------------------------------------


def export_weights(
    path: str | os.PathLike,
    params,
    config: TransformerConfig,
    tokenizer: Tokenizer | None = None,
    *,
    format: str | None = None,
) -> Path:
    """Writes Flax params as a torch_reference state_dict file with the config (and tokenizer) inside, whole or not
    at all (`files.replaced`); an existing file is a UsageError, as an existing folder is to the transformers export.

    `format`: "torch" (torch.save) or "safetensors"; None picks by suffix: `.safetensors` -> safetensors, anything
    else -> torch. Load a safetensors export in PyTorch with
    `torch_reference.Transformer(config).load_state_dict(safetensors.torch.load_file(path))`, the config being
    `TransformerConfig.from_json(safe_open(path, "pt").metadata()["config"])`."""
    from jax_transformer.interop.port import flax_to_torch

    path = Path(path)
    if format is None:
        format = "safetensors" if path.suffix == ".safetensors" else "torch"
    if format not in FORMATS:
        raise ValueError(f"export format must be one of {FORMATS}, got {format!r}")
    if path.exists():  # before the weights are converted
        raise UsageError(f"--output {path} already exists; choose a new name or remove it")
    # name -> contiguous float32 (out, in) arrays: the state_dict torch_reference loads. Copies, so writable:
    # jax's arrays come back read-only, and torch.from_numpy of one warns that writing it is undefined behaviour.
    state = {
        name: np.array(value, dtype=np.float32, order="C")
        for name, value in flax_to_torch(jax.device_get(params)).items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    if format == "safetensors":
        import safetensors.numpy
        from safetensors import SafetensorError

        metadata = {"format": SAFETENSORS_FORMAT, "config": config.to_json()}
        if tokenizer is not None:
            metadata["tokenizer"] = base64.b64encode(tokenizer.to_bytes()).decode("ascii")
        with replaced(path, errors=(SafetensorError,)) as temporary:
            safetensors.numpy.save_file(state, temporary, metadata=metadata)
    else:
        import torch

        payload = {
            "format": TORCH_FORMAT,
            "config": config.to_json(),
            "state_dict": {name: torch.from_numpy(array) for name, array in state.items()},
            "tokenizer": None if tokenizer is None else tokenizer.to_bytes(),
        }
        with replaced(path, errors=(RuntimeError,)) as temporary:  # torch's zip writer fails with RuntimeError
            torch.save(payload, temporary)
    return path


# --- reading ---------------------------------------------------------------------------------------------


def import_weights(path: str | os.PathLike, config: TransformerConfig | None = None, *, convert_dtypes: bool = False):
    """Reads a weight file -> (Flax params, config, tokenizer or None).

    The format comes from the content, not the suffix: a torch.save file (a zip, b"PK...", or the legacy pickle
    format) or a safetensors file. Accepts what `export_weights` writes (config and tokenizer inside) and bare
    torch_reference state_dicts (`torch.save(model.state_dict(), path)`, or a safetensors file of those names
    without this project's metadata), which need `config`. When both the file and `config` give a config they
    must agree (ConfigError naming the fields), except in how to compute (dtype, attention kernel): `config`'s
    choice is taken. Wrong names or shapes are a PortError naming the file; weights that are not float32 are
    refused unless `convert_dtypes` (floating point only, as in `port.torch_to_flax`)."""
    from jax_transformer.errors import PortError
    from jax_transformer.interop.port import torch_to_flax
    from jax_transformer.settings.resolve import computed

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: weight file not found")
    data = path.read_bytes()
    kind = detect_format(data)
    if kind == "safetensors":
        state_dict, saved, tokenizer = _read_safetensors(path, data, convert_dtypes)
    else:  # also an unrecognised file: torch.load has the last word, and its error is reported
        state_dict, saved, tokenizer = _read_torch(path, data, recognised=kind == "torch")
    if saved is not None:
        if config is not None:  # the file's model, computed as `config` asks (dtype, attention kernel)
            check_config(saved, config, where=f"weight file {path}")
            saved = computed(saved, config.compute_settings())
        config = saved
    elif config is None:
        raise CheckpointError(
            f"{path}: a bare state_dict has no config; give the model's config (train.py: --preset and size flags)"
        )
    try:
        params = torch_to_flax(state_dict, config, convert_dtypes=convert_dtypes)
    except PortError as e:
        raise PortError(f"{path}: {e}") from None
    return params, config, tokenizer


def detect_format(data: bytes) -> str | None:
    """ "torch", "safetensors" or None (neither) from a file's first bytes. A torch.save file is a zip (b"PK") or,
    written by old versions, a pickle (protocol opcode 0x80); a safetensors file is an 8-byte little-endian header
    length within the library's limit, then a JSON object. The safetensors test comes first: a header length's
    low byte may well be 0x80, while a legacy torch.save file starts with a fixed magic number that fails it."""
    if data[:2] != b"PK" and len(data) >= 9:
        (n,) = struct.unpack("<Q", data[:8])
        if 2 <= n <= _SAFETENSORS_MAX_HEADER and data[8:9] == b"{":
            return "safetensors"
    if data[:2] == b"PK" or data[:1] == b"\x80":
        return "torch"
    return None


def _read_safetensors(path: Path, data: bytes, convert_dtypes: bool):
    """(state_dict, config or None, tokenizer or None) from a safetensors file's bytes; loads no torch unless
    non-float32 weights are to be converted."""
    import safetensors

    from jax_transformer.errors import PortError

    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise CheckpointError(
            f"{path}: truncated safetensors file: the header alone is {n} bytes, the file has "
            f"{len(data) - 8} after the length"
        )
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    dtypes = {name: info.get("dtype") if isinstance(info, dict) else None for name, info in header.items()}
    not_float32 = sorted(f"{name} ({dtype})" for name, dtype in dtypes.items() if dtype != "F32")
    if not_float32 and not convert_dtypes:
        raise PortError(
            f"{path}: tensors that are not float32: {', '.join(not_float32)} "
            f"(pass convert_dtypes=True to convert floating-point weights)"
        )
    try:
        if not_float32:  # bfloat16 has no numpy dtype: read through torch, converted by the port
            import safetensors.torch

            state_dict: Mapping[str, Any] = safetensors.torch.load(data)
        else:
            import safetensors.numpy

            state_dict = safetensors.numpy.load(data)
    except (safetensors.SafetensorError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: cannot read as a safetensors file: {e}") from None
    if metadata.get("format") != SAFETENSORS_FORMAT:  # a plain state_dict, e.g. safetensors.torch.save_file
        return state_dict, None, None
    if "config" not in metadata:
        raise CheckpointError(f"{path}: safetensors metadata has no 'config'")
    config = TransformerConfig.from_json(metadata["config"], source=f"{path} config")
    tokenizer = None
    if "tokenizer" in metadata:
        try:
            model_bytes = base64.b64decode(metadata["tokenizer"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise CheckpointError(f"{path}: tokenizer in the safetensors metadata is not base64: {e}") from None
        tokenizer = load_tokenizer(model_bytes, source=f"{path} tokenizer")
    return state_dict, config, tokenizer


def _read_torch(path: Path, data: bytes, recognised: bool = True):
    """(state_dict, config or None, tokenizer or None) from a torch.save file's bytes: an export or a bare
    state_dict. Read with weights_only=True: the restricted unpickler, never arbitrary pickle."""
    import torch

    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        what = (
            "cannot read as a PyTorch (torch.save) file"
            if recognised
            else "neither a safetensors file nor a PyTorch (torch.save) file"
        )
        raise CheckpointError(f"{path}: {what}: {e}") from None
    if not isinstance(payload, Mapping):
        raise CheckpointError(f"{path}: expected a dict (a state_dict or an export), got {type(payload).__name__}")
    if payload.get("format") != TORCH_FORMAT:
        return payload, None, None
    missing = [key for key in ("config", "state_dict") if key not in payload]
    if missing:
        raise CheckpointError(f"{path}: export without {missing}")
    config = TransformerConfig.from_json(payload["config"], source=f"{path} config")
    tokenizer = None
    if payload.get("tokenizer") is not None:
        tokenizer = load_tokenizer(payload["tokenizer"], source=f"{path} tokenizer")
    return payload["state_dict"], config, tokenizer
