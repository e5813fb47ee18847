#!/usr/bin/env python3
"""The multilingual families at their real sizes, on random weights of the released models' shapes (nothing is
downloaded): `train.py import` (wall time, peak memory against the weights file), decoding against CTranslate2
(float32 and int8) on the same weights, where a decoding step's time goes (the output projection over the whole
vocabulary), and one `train --init-from` step (time, peak memory).

    python benchmarks/multilingual.py --model nllb-600m                  # NLLB-200-distilled-600M's shape
    python benchmarks/multilingual.py --model m2m100-418m --repeats 3    # M2M-100-418M's
    python benchmarks/multilingual.py --model nllb-600m --rows greedy:1 --repeats 1 --skip-train   # a first look
    python benchmarks/multilingual.py --model nllb-600m --rows "" --train-modes full,lora,qlora   # fine-tuning memory

The model: an M2M100ForConditionalGeneration of the shape (transformers' random init, seed 0) with a small NLLB or
M2M-100 tokenizer learned on the built-in task (tests/helpers/multilingual.py): its vocabulary is the model's
(256,206 or 128,112 entries), the tokenizer's few hundred pieces the ids the sources use. Written as the hub holds
it (config.json, model.safetensors, tokenizer files), imported with `train.py import` in a child process (its
peak resident memory from the OS, ru_maxrss, which counts the file pages mapped while reading the weights),
converted by CTranslate2's own TransformersConverter (float32; its int8 is CTranslate2's quantization of those
weights at load, compute_type="int8").

Decoding: random source ids (the language code first, EOS last), every call producing exactly --new-tokens tokens
per sentence, the target language's code first (this project's `generate` with forced_bos and min_length;
CTranslate2's target_prefix with min = max decoding length), interleaved repeats after an untimed warm-up; tokens/s
of the median and best call. Each process runs alone: the figures need the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402

MODELS = {  # the released models' config.json, shape fields
    "nllb-600m": dict(vocab_size=256206, family="nllb", layerdrop=0.0),  # facebook/nllb-200-distilled-600M
    "m2m100-418m": dict(vocab_size=128112, family="m2m100", layerdrop=0.05),  # facebook/m2m100_418M
}
SHAPE = dict(
    d_model=1024,
    encoder_layers=12,
    decoder_layers=12,
    encoder_attention_heads=16,
    decoder_attention_heads=16,
    encoder_ffn_dim=4096,
    decoder_ffn_dim=4096,
    max_position_embeddings=1024,
)
ROWS = ("greedy:1", "greedy:16", "beam4:16")
# The fine-tuning step's modes (--train-modes): its flags beside --init-from.
TRAIN_MODES = {
    "full": [],
    "lora": ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,out,ffn"],
    "qlora": [
        "--lora-rank",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "q,k,v,out,ffn",
        "--quantize",
        "int8-weights",
    ],
}


def write_model(name: str, folder: Path) -> Path:
    """`folder` as a save_pretrained directory of a random model of `name`'s shape with a small tokenizer."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    from tests.helpers.multilingual import TOKENIZERS

    spec = MODELS[name]
    TOKENIZERS[spec["family"]](folder)
    if spec["family"] == "m2m100":  # vocab.json as long as the released one (the table less the codes and the 8
        # placeholders), placeholder pieces after the learned ones: CTranslate2 reads the vocabulary from it
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        for i in range(len(vocab), spec["vocab_size"] - 100 - 8):
            vocab[f"\u2581w{i}"] = i
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    torch.manual_seed(0)
    config = M2M100Config(
        vocab_size=spec["vocab_size"],
        encoder_layerdrop=spec["layerdrop"],
        decoder_layerdrop=spec["layerdrop"],
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        **SHAPE,
    )
    model = M2M100ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_length": 200, "decoder_start_token_id": 2}))
    return folder


def child(argv: list[str], log) -> dict:
    """Runs `python train.py argv` in a child process: {"seconds", "peak_rss_gb"} (ru_maxrss of that child)."""
    began = time.perf_counter()
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv], stdout=subprocess.PIPE, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - began
    code = os.waitstatus_to_exitcode(status)
    measured = {"seconds": round(seconds, 1), "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "exit": code}
    if code == -9:  # the kernel's OOM killer: the figure is what it got to
        log(f"train.py {argv[0]}: killed (out of memory?) after {seconds:.0f} s at {measured['peak_rss_gb']} GB")
    elif code != 0:
        raise RuntimeError(f"train.py {' '.join(argv)} failed ({code}):\n{out}")
    else:
        log(out.strip().splitlines()[-1] if out.strip() else "")
    return measured


def m2m100_codes_for_ctranslate2() -> None:
    """CTranslate2 4.8's M2M-100 loader takes the language codes from the tokenizer's `special_tokens_map`
    ("additional_special_tokens"), which transformers 5's M2M100Tokenizer no longer fills, so its vocabulary lacks
    the 100 codes and the conversion fails. For this benchmark's conversion only, the loader appends them as
    transformers numbers them (`lang_token_to_id`), before the made-up words, as it did with transformers 4."""
    from ctranslate2.converters import transformers as ct2_transformers

    class Loader(ct2_transformers.M2M100Loader):
        def get_vocabulary(self, model, tokenizer):
            tokens = ct2_transformers.BartLoader.get_vocabulary(self, model, tokenizer)
            if tokens[-1] == tokenizer.unk_token:  # the loader's own workaround, kept
                tokens.insert(tokenizer.unk_token_id, tokens.pop())
            codes = sorted(getattr(tokenizer, "lang_token_to_id", {}).items(), key=lambda item: item[1])
            tokens += [code for code, _ in codes if code not in tokens]
            return tokens + [f"madeupword{i}" for i in range(model.config.vocab_size - len(tokens))]

    ct2_transformers._MODEL_LOADERS["M2M100Config"] = Loader()


def decode_rows(run: Path, folder: Path, name: str, rows, new_tokens: int, src_len: int, repeats: int, log) -> list:
    """Tokens/s of this project's generate and CTranslate2's float32 and int8 on each row (search:batch)."""
    import ctranslate2
    import jax

    from benchmarks.ctranslate2_decoding import interleaved
    from jax_transformer.decoding import loading
    from jax_transformer.decoding.decoders import generate, on_device
    from tests.helpers.multilingual import LANGUAGES

    src_lang, tgt_lang = LANGUAGES[MODELS[name]["family"]]
    loaded = loading.load(run, "latest", languages={"src_lang": src_lang, "tgt_lang": tgt_lang})
    config, tokenizer = loaded.config, loaded.tokenizer
    params = on_device(loaded.params)
    ct2 = folder.parent / "ctranslate2"
    began = time.perf_counter()
    translators, threads = {}, os.cpu_count() or 1
    if MODELS[name]["family"] == "m2m100":
        m2m100_codes_for_ctranslate2()
    try:
        ctranslate2.converters.TransformersConverter(str(folder)).convert(str(ct2), quantization="float32", force=True)
        log(f"CTranslate2 conversion: {time.perf_counter() - began:.0f} s")
        ct2_vocabulary = json.loads((ct2 / "shared_vocabulary.json").read_text(encoding="utf-8"))
        for kind in ("float32", "int8"):
            translators[kind] = ctranslate2.Translator(str(ct2), device="cpu", compute_type=kind, intra_threads=threads)
    except ValueError as e:  # M2M-100 with transformers 5's tokenizer: its converter misses the language codes
        log(f"CTranslate2 cannot convert this model: {e}; this project's rows only")
    code = tgt_lang if MODELS[name]["family"] == "nllb" else f"__{tgt_lang}__"
    rng = np.random.default_rng(0)
    results = []
    for row in rows:
        search, batch = row.split(":")
        beam, batch = (1 if search == "greedy" else int(search.removeprefix("beam"))), int(batch)
        pieces = rng.integers(4, tokenizer.vocab_size - len(tokenizer.codes) - 1, (batch, src_len - 2))
        src = np.array([tokenizer.encode("")[:1] + list(p) + [config.eos_id] for p in pieces], np.int32)
        source = [[tokenizer.piece(i) for i in s] for s in src]
        limits = dict(min_decoding_length=new_tokens, max_decoding_length=new_tokens, beam_size=beam)

        def ours():
            options = dict(max_length=new_tokens + 1, min_length=new_tokens + 1, num_beams=beam)
            return generate(params, config, src, forced_bos=tokenizer.forced_bos_id, **options)

        calls = {"flax": ours}
        for kind, translator in translators.items():
            calls[f"ctranslate2-{kind}"] = lambda t=translator: t.translate_batch(
                source, target_prefix=[[code]] * batch, **limits
            )
        began = time.perf_counter()
        outputs = {n: c() for n, c in calls.items()}  # warm-up, untimed (the Flax program compiles here)
        log(f"{row}: warm-up {time.perf_counter() - began:.0f} s")
        ours_pieces = [[ct2_vocabulary[int(i)] for i in r] for r in outputs["flax"]] if translators else []
        times, cores = interleaved(calls, repeats)
        for n in calls:
            best, median = min(times[n]), statistics.median(times[n])
            same = None
            if n != "flax":
                same = sum(a == r.hypotheses[0] for a, r in zip(ours_pieces, outputs[n]))
            results.append(
                dict(
                    row=row,
                    decoder=n,
                    tokens_per_s_median=round(batch * new_tokens / median, 1),
                    tokens_per_s_best=round(batch * new_tokens / best, 1),
                    seconds_median=round(median, 3),
                    cores_used=round(cores[n], 2),
                    same_as_flax=None if same is None else f"{same}/{batch}",
                )
            )
            log(f"{row:>10} {n:<20} {batch * new_tokens / median:>8.1f} tokens/s median ({cores[n]:.2f} cores)")
    # Where a greedy step's time goes: the output projection over the whole vocabulary, timed alone.
    table = params["shared_embed"]["embedding"]
    project = jax.jit(lambda h, e: h @ e.T)
    for batch in sorted({int(r.split(":")[1]) * (1 if r.startswith("greedy") else 4) for r in rows}):
        h = jax.numpy.ones((batch, config.d_model), jax.numpy.float32)
        project(h, table).block_until_ready()
        spent = []
        for _ in range(max(repeats, 3)):
            began = time.perf_counter()
            project(h, table).block_until_ready()
            spent.append(time.perf_counter() - began)
        results.append(dict(row=f"output projection, {batch} rows", seconds_median=statistics.median(spent)))
        log(f"output projection ({batch} x {config.d_model} by {table.shape[0]:,}): {statistics.median(spent):.4f} s")
    return results


def train_step(run: Path, work: Path, name: str, max_tokens: int, log, mode: str = "full") -> dict:
    """`train --init-from` of 3 steps on the built-in task (in a child process, before this one holds a model) in
    one of TRAIN_MODES: its wall time, peak memory and the time between its last two steps (its end: saving the
    train state)."""
    from jax_transformer.data.default_task import write_default_task
    from tests.helpers.multilingual import LANGUAGES

    src_lang, tgt_lang = LANGUAGES[MODELS[name]["family"]]
    tsv, _ = write_default_task(work / "task", n_train=2000, n_valid=10)
    args = ["train", "--init-from", str(run), "--tsv", str(tsv), "--src-lang", src_lang, "--tgt-lang", tgt_lang]
    args += ["--steps", "3", "--max-tokens", str(max_tokens), "--eval-every", "1000", "--save-every", "1000"]
    args += ["--eval-sentences", "0", "--samples", "0", "--no-progress", "--run-dir", str(work / f"tuned-{mode}")]
    measured = {"mode": mode, **child(args + TRAIN_MODES[mode], log)}
    metrics = work / f"tuned-{mode}" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [r for r in records if r.get("kind") == "train"]
    measured["steps_done"] = len(steps)
    if len(steps) >= 2:
        measured["step_seconds"] = round(steps[-1]["elapsed_s"] - steps[-2]["elapsed_s"], 1)
        measured["real_tokens_per_step"] = steps[-1].get("tokens")
    return measured


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="nllb-600m")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"search:batch, comma-separated ({','.join(ROWS)})")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens produced per sentence (default: 32)")
    parser.add_argument("--src-len", type=int, default=24, help="source tokens per sentence (default: 24)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per decoder and row (default: 3)")
    parser.add_argument("--skip-train", action="store_true", help="leave out the training step")
    parser.add_argument(
        "--train-modes", default="full", help=f"the training step's modes, comma-separated, of {','.join(TRAIN_MODES)}"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="the training step's batch (default: 256)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    try:
        import ctranslate2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"needs the ctranslate2 and pretrained extras ({e}); nothing measured")
        return 0
    log = lambda text: print(text, flush=True)  # noqa: E731
    report = {"machine": machine_info(), "model": args.model, "shape": {**SHAPE, **MODELS[args.model]}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        began = time.perf_counter()
        folder = write_model(args.model, work / "hf")
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        log(f"wrote {folder} in {time.perf_counter() - began:.0f} s: weights {size / 2**30:.2f} GiB")
        report["weights_gib"] = round(size / 2**30, 2)
        report["import"] = child(["import", str(folder), "--output", str(work / "run")], log)
        report["import"]["peak_over_weights"] = round(report["import"]["peak_rss_gb"] / (size / 2**30), 2)
        log(f"import: {report['import']}")
        if not args.skip_train:
            report["train_step"] = []
            for mode in args.train_modes.split(","):
                report["train_step"].append(train_step(work / "run", work, args.model, args.max_tokens, log, mode))
                log(f"train --init-from ({mode}): {report['train_step'][-1]}")
        rows = [row for row in args.rows.split(",") if row]
        report["decoding"] = decode_rows(
            work / "run", folder, args.model, rows, args.new_tokens, args.src_len, args.repeats, log
        )
    report["settings"] = dict(new_tokens=args.new_tokens, src_len=args.src_len, repeats=args.repeats)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
