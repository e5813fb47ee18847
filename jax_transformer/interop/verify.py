"""A trained Flax checkpoint against its PyTorch twin on real data (`train.py verify`): the weights exported as
`train.py export` writes them, teacher-forced logits of both (and each one's distance from a float64
evaluation), identical tokens of greedy and beam search, and the BLEU of each. docs/internals.md#verify."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jax_transformer import compilation
from jax_transformer.checkpoint.manager import Checkpoint
from jax_transformer.data.batching import bucket_lengths
from jax_transformer.decoding.decoders import beam_search, greedy_search
from jax_transformer.decoding.evaluation import score_translations
from jax_transformer.decoding.translation import encode_sources
from jax_transformer.interop.export import export_weights, import_weights
from jax_transformer.model import quantization
from jax_transformer.model.transformer import Transformer
from jax_transformer.settings.config import DecodeConfig


@dataclasses.dataclass
class DecodingComparison:
    """One search (greedy or beam) run in both frameworks over the same sentences."""

    name: str  # "greedy" or "beam 4 (alpha 0.6)"
    identical: int  # sentences whose token sequences are identical
    sentences: int
    scores: dict[str, dict[str, float]]  # {"flax": {"bleu", "chrf"}, "torch": {...}}
    mismatches: list[dict[str, Any]]  # {"sentence", "position", "flax_token", "torch_token", "gap"} (gap: greedy)
    bleu_signature: str = ""

    @property
    def share(self) -> float:
        return self.identical / max(self.sentences, 1)


@dataclasses.dataclass
class VerifyReport:
    step: int
    sentences: int
    target_tokens: int  # teacher-forced target positions compared
    logit_max_abs_diff: float
    logit_max_abs: float  # the largest |logit|, for scale
    flax_vs_float64: float  # largest |logit_flax - logit_float64|
    torch_vs_float64: float  # largest |logit_torch - logit_float64|
    decodings: list[DecodingComparison]
    torch_device: str
    jax_device: str
    bleu_signature: str
    quantize: str = "none"  # the Flax side's weights: float, or int8 (`config.quantize`) against the float twin

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for entry, comparison in zip(out["decodings"], self.decodings):
            entry["share"] = comparison.share
        return out

    def table(self) -> str:
        """The report as text: one line for the logits, a table for the searches."""
        lines = [
            f"checkpoint step {self.step}; {self.sentences} sentences; PyTorch on {self.torch_device}, JAX on "
            f"{self.jax_device}" + ("" if self.quantize == "none" else f"; Flax quantized ({self.quantize})"),
            f"teacher forcing: largest |logit difference| {self.logit_max_abs_diff:.3e} over {self.target_tokens:,} "
            f"target positions (largest |logit| {self.logit_max_abs:.2f}); from a float64 evaluation: Flax "
            f"{self.flax_vs_float64:.3e}, PyTorch {self.torch_vs_float64:.3e}",
            "",
            "| decoding | identical tokens | BLEU Flax | BLEU PyTorch | chrF Flax | chrF PyTorch |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d in self.decodings:
            f, t = d.scores["flax"], d.scores["torch"]
            lines.append(
                f"| {d.name} | {d.identical}/{d.sentences} ({100 * d.share:.1f}%) | {f['bleu']:.2f} | "
                f"{t['bleu']:.2f} | {f['chrf']:.2f} | {t['chrf']:.2f} |"
            )
        for d in self.decodings:
            for m in d.mismatches[:5]:
                gap = "" if m.get("gap") is None else f", log-prob gap {m['gap']:.2e} between the two choices"
                lines.append(
                    f"{d.name}: sentence {m['sentence']} first differs at token {m['position']} "
                    f"(Flax {m['flax_token']}, PyTorch {m['torch_token']}{gap})"
                )
        lines.append(f"sacreBLEU {self.bleu_signature}")
        return "\n".join(lines)


def torch_twin_from_export(loaded: Checkpoint, device: str = "cpu"):
    """The checkpoint's model in PyTorch, through the export path: export_weights to a temporary safetensors
    file, then torch_reference.Transformer.load_state_dict(strict=True) of that file, in eval mode on `device`."""
    import safetensors.torch

    import torch_reference

    with tempfile.TemporaryDirectory() as tmp:
        path = export_weights(Path(tmp) / "model.safetensors", loaded.params, loaded.config, loaded.tokenizer)
        _, config, _ = import_weights(path)  # the config the file carries must be the checkpoint's
        if config != loaded.config:
            raise AssertionError(f"the exported file's config differs: {sorted(config.diff(loaded.config))}")
        state = safetensors.torch.load_file(str(path))
    model = torch_reference.Transformer(loaded.config)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


def flax_logits_fn(config):
    """(params, src, tgt_in) -> teacher-forced logits of `config`'s model, compiled (`compilation.jit`)."""
    model = Transformer(config)
    return compilation.jit(lambda params, src, tgt_in: model.apply({"params": params}, src, tgt_in), config.dtype)


def compare_logits(loaded: Checkpoint, torch_model, batches, device: str, progress: bool) -> dict[str, float]:
    """Over the real target positions of `batches`: the largest |Flax - PyTorch| logit ("diff"), each one's
    largest distance from the float64 twin ("flax64", "torch64"), the largest |logit| ("largest") and the number
    of positions compared ("count")."""
    import copy

    import torch

    flax_logits = flax_logits_fn(loaded.config)
    reference = copy.deepcopy(torch_model).double()
    out = {"diff": 0.0, "flax64": 0.0, "torch64": 0.0, "largest": 0.0, "count": 0}
    for batch in tqdm(batches, desc="teacher forcing", unit="batch", disable=not progress):
        real = batch["tgt_out"] != loaded.config.pad_id  # (B, T)
        a = np.asarray(flax_logits(loaded.params, batch["src"], batch["tgt_in"]))  # (B, T, V)
        src, tgt_in = (torch.from_numpy(batch[k]).long().to(device) for k in ("src", "tgt_in"))
        with torch.no_grad():
            b = torch_model(src, tgt_in).float().cpu().numpy()
            exact = reference(src, tgt_in).cpu().numpy()  # float64
        for key, gap in (("diff", a - b), ("flax64", a - exact), ("torch64", b - exact)):
            out[key] = max(out[key], float(np.max(np.abs(gap)[real])))
        out["largest"] = max(out["largest"], float(np.max(np.abs(a[real]))))
        out["count"] += int(real.sum())
    return out


def _padded_chunks(sources: list[np.ndarray], config, batch_size: int):
    """(indices, src (rows, width)) per chunk of similar-length sources, widths from the data buckets."""
    order = np.argsort([len(s) for s in sources], kind="stable")
    widths = bucket_lengths(config.max_len)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        width = next(w for w in widths if w >= max(len(sources[i]) for i in chunk))
        src = np.full((len(chunk), width), config.pad_id, np.int32)
        for row, i in enumerate(chunk):
            src[row, : len(sources[i])] = sources[i]
        yield chunk, src


def _until_eos(tokens: np.ndarray, config) -> list[int]:
    """The output ids up to and including EOS (PAD after it is not part of the output)."""
    ids = []
    for token in tokens.tolist():
        ids.append(token)
        if token in (config.eos_id, config.pad_id):
            break
    return [t for t in ids if t != config.pad_id]


def _greedy_gap(torch_model, src_row: np.ndarray, prefix: list[int], a: int, b: int, config, device: str) -> float:
    """|log p(a) - log p(b)| after the shared prefix, from the PyTorch twin: how near a tie the flip was."""
    import torch

    tgt_in = torch.tensor([[config.start_id, *prefix]], dtype=torch.long, device=device)
    with torch.no_grad():
        log_probs = torch.log_softmax(torch_model(torch.from_numpy(src_row[None]).long().to(device), tgt_in), -1)
    last = log_probs[0, -1].float().cpu().numpy()
    return float(abs(last[a] - last[b]))


def compare_decoding(
    loaded: Checkpoint,
    torch_model,
    sources: Sequence[str],
    references: Sequence[str],
    *,
    beam_size: int,
    alpha: float,
    batch_size: int,
    device: str,
    progress: bool,
) -> DecodingComparison:
    """Decodes `sources` with both frameworks (greedy when beam_size is 1) and compares tokens and scores."""
    import torch

    from torch_reference import decoding as torch_decoding

    config, tokenizer = loaded.config, loaded.tokenizer
    encoded = encode_sources(tokenizer, list(sources), config)
    outputs = {"flax": [None] * len(encoded), "torch": [None] * len(encoded)}
    srcs: list[np.ndarray | None] = [None] * len(encoded)
    name = "greedy" if beam_size == 1 else f"beam {beam_size} (alpha {alpha:g})"
    chunks = list(_padded_chunks(encoded, config, batch_size))
    for chunk, src in tqdm(chunks, desc=name, unit="batch", disable=not progress):
        src_t = torch.from_numpy(src).long().to(device)
        if beam_size == 1:
            flax_tokens, _ = greedy_search(loaded.params, config, src)
            torch_tokens, _ = torch_decoding.greedy_search(torch_model, src_t, use_cache=True)
        else:
            flax_tokens, _ = beam_search(loaded.params, config, src, beam_size=beam_size, alpha=alpha)
            torch_tokens, _ = torch_decoding.beam_search(
                torch_model, src_t, beam_size=beam_size, alpha=alpha, use_cache=True
            )
        torch_tokens = torch_tokens.cpu().numpy()
        for row, i in enumerate(chunk):
            outputs["flax"][i] = _until_eos(flax_tokens[row], config)
            outputs["torch"][i] = _until_eos(torch_tokens[row], config)
            srcs[i] = src[row]
    mismatches = []
    for i, (a, b) in enumerate(zip(outputs["flax"], outputs["torch"])):
        if a == b:
            continue
        t = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fa = a[t] if t < len(a) else None
        tb = b[t] if t < len(b) else None
        gap = None
        if beam_size == 1 and fa is not None and tb is not None:
            gap = _greedy_gap(torch_model, srcs[i], a[:t], fa, tb, config, device)
        mismatches.append({"sentence": i, "position": t, "flax_token": fa, "torch_token": tb, "gap": gap})
    scores, signature = {}, ""
    for framework, token_lists in outputs.items():
        hypotheses = [tokenizer.decode(ids) for ids in token_lists]
        scored = score_translations(hypotheses, references)
        scores[framework] = {"bleu": scored["bleu"], "chrf": scored["chrf"], "bleu_lc": scored["bleu_lc"]}
        signature = scored["bleu_signature"]
    return DecodingComparison(name, len(encoded) - len(mismatches), len(encoded), scores, mismatches, signature)


def verify(
    loaded: Checkpoint,
    batches: Sequence[dict[str, np.ndarray]],
    sources: Sequence[str],
    references: Sequence[str],
    decode: DecodeConfig | None = None,
    *,
    batch_size: int = 32,
    device: str = "cpu",
    progress: bool = True,
    print_fn: Callable[[str], None] = print,
) -> VerifyReport:
    """Steps 1-4 of the module docstring on a loaded checkpoint, its teacher-forcing `batches` (dicts of src,
    tgt_in, tgt_out) and the `sources` / `references` text of the same validation set. `decode`: its beam width and
    alpha (default DecodeConfig's); the frameworks are compared by this project's rules, which the twin has."""
    decode = decode or DecodeConfig()
    beam_size, alpha = decode.beam_size, decode.alpha
    import time

    import torch

    began = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    quantize = loaded.config.quantize
    twin = dataclasses.replace(loaded, config=loaded.config.replace(quantize="none"))  # the float weights
    if quantize != "none":  # the Flax side decodes its int8 ones
        loaded = loaded.with_params(quantization.quantize_params(loaded.params))
    with jax.default_matmul_precision("highest"):
        torch_model = torch_twin_from_export(twin, device)
        print_fn(f"exported step {loaded.step} to PyTorch (safetensors, torch_reference.Transformer, strict load)")
        logits = compare_logits(loaded, torch_model, batches, device, progress)
        print_fn(f"teacher forcing: largest |logit difference| {logits['diff']:.3e} ({time.time() - began:.0f} s)")
        decodings = []
        for beam in dict.fromkeys([1, beam_size]):  # greedy, then the beam (once if beam_size is 1)
            comparison = compare_decoding(
                loaded,
                torch_model,
                sources,
                references,
                beam_size=beam,
                alpha=alpha,
                batch_size=batch_size,
                device=device,
                progress=progress,
            )
            print_fn(
                f"{comparison.name}: {comparison.identical}/{comparison.sentences} sentences identical "
                f"({time.time() - began:.0f} s)"
            )
            decodings.append(comparison)
    return VerifyReport(
        step=loaded.step,
        sentences=len(sources),
        target_tokens=logits["count"],
        logit_max_abs_diff=logits["diff"],
        logit_max_abs=logits["largest"],
        flax_vs_float64=logits["flax64"],
        torch_vs_float64=logits["torch64"],
        decodings=decodings,
        torch_device=str(device),
        jax_device=str(jax.devices()[0]),
        bleu_signature=decodings[0].bleu_signature,
        quantize=quantize,
    )
