"""bfloat16 decoding against float32, Flax beside the PyTorch twin, on saved trained models: the table of
docs/gpu-tpu.md ("Decoding in bfloat16, every path").

For every decoding path (greedy at batch 64 and 1, with and without a key/value cache; beam 1, 4 and 6; translate,
evaluate and verify) it counts the sentences whose output is identical:
- Flax bf16 vs Flax f32: what decoding in bfloat16 changes in Flax;
- twin bf16 vs twin f32: the same for the PyTorch twin (the reference for how much bfloat16 may change);
- Flax bf16 vs twin bf16: whether the two frameworks' bfloat16 agree.

    python -m benchmarks.bf16_decoding                       # the models of tests/data, Markdown on stdout
    python -m benchmarks.bf16_decoding --models trained_tiny --json out.json

The models (tests/data, see tests/data/make_trained_tiny.py): `trained_tiny`, the tiny preset trained on the
built-in task until it translates its validation sentences; `bf16_beam_case`, a barely trained tiny model whose
beam search parted bfloat16 from float32 on most sentences before the fixes (it has no tokenizer: the text rows
are left out for it).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.machine import machine_info

MODELS = ("trained_tiny", "bf16_beam_case")
DTYPES = ("float32", "bfloat16")


def _until_eos(tokens: np.ndarray, eos: int, pad: int) -> tuple[int, ...]:
    row = [int(x) for x in tokens if x != pad]
    return tuple(row[: row.index(eos) + 1] if eos in row else row)


def _same(a, b) -> int:
    return sum(x == y for x, y in zip(a, b))


def flax_uncached_greedy(params, config, src: np.ndarray) -> list[tuple[int, ...]]:
    """Greedy search without a cache: the Flax model re-run over the whole prefix at every step (teacher forcing
    on what it produced so far), with decoders.greedy_search's rules (PAD and BOS banned, the same length limit)."""
    import jax
    import jax.numpy as jnp

    from jax_transformer import compilation
    from jax_transformer.decoding import decoders
    from jax_transformer.model.transformer import Transformer

    model = Transformer(config)
    forward = compilation.jit(lambda p, s, t: model.apply({"params": p}, s, t)[:, -1], config.dtype)
    limits = decoders.max_new_tokens(src, config)
    prefix = np.full((len(src), 1), config.bos_id, np.int32)
    done = np.zeros(len(src), bool)
    for step in range(int(limits.max())):
        log_probs = np.array(jax.nn.log_softmax(forward(params, jnp.asarray(src), jnp.asarray(prefix)), -1))
        log_probs[:, [config.pad_id, config.bos_id]] = -np.inf
        token = np.where(done, config.pad_id, np.argmax(log_probs, -1)).astype(np.int32)
        prefix = np.concatenate([prefix, token[:, None]], 1)
        done |= (token == config.eos_id) | (step + 1 >= limits)
        if done.all():
            break
    return [_until_eos(row, config.eos_id, config.pad_id) for row in prefix[:, 1:]]


def token_outputs(saved, dtype: str, path: str) -> dict[str, list[tuple[int, ...]]]:
    """{"flax": [...], "twin": [...]}: each framework's output tokens (up to EOS) for every source, in `dtype`."""
    import torch

    from jax_transformer.decoding import decoders
    from tests.helpers.twins import t, torch_twin
    from torch_reference import decoding as torch_decoding

    config, src = saved.config.replace(dtype=dtype), saved.sources
    twin = torch_twin(config, saved.params, device="cpu")
    cut = lambda rows: [_until_eos(np.asarray(row), config.eos_id, config.pad_id) for row in rows]
    kind, _, rest = path.partition(" ")
    if kind == "greedy":
        use_cache = "without" not in rest
        if "batch 1" in rest:
            flax = [decoders.greedy_search(saved.params, config, row[None])[0][0] for row in src]
            twin_out = [torch_decoding.greedy_search(twin, t(row[None]), use_cache=True)[0][0] for row in src]
            return {"flax": cut(flax), "twin": cut(x.numpy() for x in twin_out)}
        flax = (
            cut(decoders.greedy_search(saved.params, config, src)[0])
            if use_cache
            else flax_uncached_greedy(saved.params, config, src)
        )
        return {"flax": flax, "twin": cut(torch_decoding.greedy_search(twin, t(src), use_cache=use_cache)[0].numpy())}
    beam = int(rest.split()[0])
    use_cache = "without" not in rest
    flax = decoders.beam_search(saved.params, config, src, beam_size=beam, alpha=0.6)[0]
    with torch.no_grad():
        twin_tokens = torch_decoding.beam_search(twin, t(src), beam_size=beam, alpha=0.6, use_cache=use_cache)[0]
    return {"flax": cut(flax), "twin": cut(twin_tokens.numpy())}


def text_outputs(saved, dtype: str, path: str) -> dict[str, list[str]]:
    """translate / evaluate / verify on the saved model's sentences: each framework's translations as text, and
    for evaluate the BLEU of each."""
    import torch

    from jax_transformer.decoding import evaluation, translation
    from tests.helpers.batches import pad_rows
    from tests.helpers.twins import t, torch_twin
    from torch_reference import decoding as torch_decoding

    config, tok = saved.config.replace(dtype=dtype), saved.tokenizer
    twin = torch_twin(config, saved.params, device="cpu")
    src = pad_rows(translation.encode_sources(tok, list(saved.source_texts), config))
    with torch.no_grad():
        twin_tokens = torch_decoding.beam_search(twin, t(src), beam_size=4, alpha=0.6, use_cache=True)[0].numpy()
    twin_text = [tok.decode(_until_eos(row, config.eos_id, config.pad_id)) for row in twin_tokens]
    if path == "translate (beam 4, text)":
        flax_text = translation.translate(saved.params, config, tok, list(saved.source_texts), progress=False)
        return {"flax": flax_text, "twin": twin_text}
    if path == "evaluate (beam 4, BLEU)":
        scores, flax_text = evaluation.evaluate_translations(
            saved.params, config, tok, saved.source_texts, saved.target_texts, progress=False
        )
        twin_bleu = evaluation.score_translations(twin_text, list(saved.target_texts))["bleu"]
        return {"flax": flax_text, "twin": twin_text, "bleu": {"flax": scores["bleu"], "twin": twin_bleu}}
    raise ValueError(path)


TOKEN_PATHS = (
    "greedy batch 64",
    "greedy batch 1",
    "greedy batch 64 without cache",
    "beam 1",
    "beam 4",
    "beam 6",
    "beam 4 without cache",
)
TEXT_PATHS = ("translate (beam 4, text)", "evaluate (beam 4, BLEU)")


def verify_counts(saved) -> dict[str, dict[str, int]]:
    """`train.py verify`'s decoding comparison (jax_transformer.interop.verify.compare_decoding: Flax vs the twin
    rebuilt from an exported weight file, greedy and beam 4) in each dtype: {dtype: {search: identical sentences}}."""
    from pathlib import Path

    from jax_transformer.checkpoint.manager import Checkpoint
    from jax_transformer.interop.verify import compare_decoding, torch_twin_from_export

    out = {}
    for dtype in DTYPES:
        config = saved.config.replace(dtype=dtype)
        loaded = Checkpoint(Path("."), 0, {"params": saved.params}, config, {}, saved.tokenizer, None, {})
        twin = torch_twin_from_export(loaded)
        out[dtype] = {}
        for beam in (1, 4):
            comparison = compare_decoding(
                loaded,
                twin,
                saved.source_texts,
                saved.target_texts,
                beam_size=beam,
                alpha=0.6,
                batch_size=32,
                device="cpu",
                progress=False,
            )
            out[dtype]["greedy" if beam == 1 else "beam 4"] = comparison.identical
    return out


def compare(saved, paths: tuple[str, ...] | None = None, with_verify: bool = True) -> list[dict]:
    """One row per decoding path (default: every path the model allows): sentences, and the counts of identical
    outputs; then, with `with_verify` and a tokenizer, verify's counts."""
    rows = []
    if paths is None:
        paths = TOKEN_PATHS + (TEXT_PATHS if saved.tokenizer is not None else ())
    for path in paths:
        began = time.time()
        fn = token_outputs if path in TOKEN_PATHS else text_outputs
        out = {dtype: fn(saved, dtype, path) for dtype in DTYPES}
        f32, bf16 = out["float32"], out["bfloat16"]
        row = {
            "path": path,
            "sentences": len(f32["flax"]),
            "flax bf16 = flax f32": _same(bf16["flax"], f32["flax"]),
            "twin bf16 = twin f32": _same(bf16["twin"], f32["twin"]),
            "flax bf16 = twin bf16": _same(bf16["flax"], bf16["twin"]),
            "flax f32 = twin f32": _same(f32["flax"], f32["twin"]),
            "seconds": round(time.time() - began, 1),
        }
        if "bleu" in f32:
            row["BLEU f32 / bf16 (flax)"] = f"{f32['bleu']['flax']:.2f} / {bf16['bleu']['flax']:.2f}"
            row["BLEU f32 / bf16 (twin)"] = f"{f32['bleu']['twin']:.2f} / {bf16['bleu']['twin']:.2f}"
        rows.append(row)
        print(f"  {path}: {row}", flush=True)
    if with_verify and saved.tokenizer is not None:
        counts = verify_counts(saved)
        for search in ("greedy", "beam 4"):
            rows.append(
                {
                    "path": f"verify ({search}): Flax = twin, each dtype",
                    "sentences": len(saved.source_texts),
                    "flax f32 = twin f32": counts["float32"][search],
                    "flax bf16 = twin bf16": counts["bfloat16"][search],
                }
            )
    return rows


COLUMNS = ("flax bf16 = flax f32", "twin bf16 = twin f32", "flax bf16 = twin bf16", "flax f32 = twin f32")


def markdown(name: str, rows: list[dict]) -> str:
    lines = [
        f"**{name}** (identical sentences of {rows[0]['sentences']})",
        "",
        "| path | Flax bf16 = Flax f32 | twin bf16 = twin f32 | Flax bf16 = twin bf16 | Flax f32 = twin f32 |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [str(row.get(column, "-")) for column in COLUMNS]
        bleu = ""
        if "BLEU f32 / bf16 (flax)" in row:
            bleu = f" (BLEU f32/bf16: Flax {row['BLEU f32 / bf16 (flax)']}, twin {row['BLEU f32 / bf16 (twin)']})"
        lines.append(f"| {row['path']}{bleu} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    import torch

    from tests.helpers.saved import load_saved_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help="tests/data names or .npz paths")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is faster than two
    info = machine_info()
    print(f"machine: {info['cpu_model']} ({', '.join(info['cpu_features'])}), {info['date']}; {info['libraries']}")
    results = {}
    for name in args.models:
        print(f"{name}:", flush=True)
        results[name] = compare(load_saved_model(name))
    for name, rows in results.items():
        print("\n" + markdown(name, rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": info, "models": results}, f, indent=1)


if __name__ == "__main__":
    main()
