#!/usr/bin/env python3
"""Decoding speed against CTranslate2, the C++ engine people deploy this model family with, on the same weights.

    python benchmarks/ctranslate2_decoding.py                 # small preset's shape, the six rows, 7 repeats
    python benchmarks/ctranslate2_decoding.py --quick         # 3 repeats: a first look
    python benchmarks/ctranslate2_decoding.py --rows greedy:1 --repeats 1 --preset tiny   # smoke test
    python benchmarks/ctranslate2_decoding.py --run runs/m30k-marian --input test.de       # translate, end to end
    python benchmarks/ctranslate2_decoding.py --write-marian DIR --texts train.de train.en  # a model for --run
    python benchmarks/ctranslate2_decoding.py --device cuda --dtype bfloat16 --decoders flax,ctranslate2  # GPU
    python benchmarks/ctranslate2_decoding.py --model nllb-600m --rows greedy:1,greedy:16,beam4:16   # a real shape

Needs the `ctranslate2` extra (`pip install -e ".[ctranslate2]"`) and transformers (the `pretrained` extra): the
model is written with `export --format transformers` (jax_transformer.interop.hub) and converted by CTranslate2's own
TransformersConverter, so both engines run the very same float32 weights. Without ctranslate2 the script says so
and exits 0 (it is an optional benchmark).

The model: a preset's shape (small: d_model 256, 4 heads, d_ff 1024, 3+3 layers) with a vocabulary of 8,000 in
Marian's conventions, which CTranslate2's Marian loader requires (pad the last id, a zero pad embedding that the
decoder starts from, EOS 0, no BOS, sinusoids in halves); random weights, seed 0. Sources: random ids, 32 tokens
per sentence (EOS last). Every call produces exactly `--new-tokens` tokens per sentence (EOS banned until then:
the Flax decoders' min_len, CTranslate2's min_decoding_length = max_decoding_length), and includes encoding.
Decoders: `flax` (jax_transformer.decoding.decoders, this project's own rules), `flax-generate` (`decoders.generate`,
transformers' rules, what imported models use) and `ctranslate2` (Translator.translate_batch, float32,
`intra_threads` = the machine's cores). With every output of one length, the length penalties do not reorder the
beam, so all three should give the same tokens: the table says how many sentences agree.

Timing: the decoders are interleaved within each repeat in a rotating order (so drift on a shared machine hits all
alike), after one untimed warm-up call each (Flax's compilation); each figure is the best and the median of the
repeats; ratios are of medians, flax over ctranslate2 (> 1: this project is faster). "cores used": the process's CPU
time over the wall time of a decoder's timed calls (2.0: both cores of a 2-core machine busy throughout).
`--threads 1` runs CTranslate2 on one thread (the Flax decoders still use the cores XLA:CPU gives them: see their
cores used).

On a GPU (`--device cuda`: CTranslate2 on the GPU, JAX on its default backend, which must be the GPU): every call
ends with its tokens on the host, so the time includes the device's work. `--dtype` is the Flax model's compute
dtype (float32, or bfloat16 mixed precision) and CTranslate2's compute type unless `--ct2-compute-type` names another
(float16, say). CTranslate2's float32 on a GPU is full float32 (cuBLAS's default math, no TF32), while XLA's default
for a float32 matmul on a GPU is TF32: `--matmul-precision highest` makes JAX's float32 rows full float32 as well.

--run: `train.py translate`'s path (translation.translate_lines: tokenizing, batching, beam search, detokenizing)
on the lines of --input, against CTranslate2 translating the same lines with the same tokenizer, from a run
directory whose model CTranslate2 can read (a model imported from Marian, or trained from one with --init-from):
sentences/s, the share of identical translations.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/ctranslate2_decoding.py` puts benchmarks/ first on the path
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from benchmarks.machine import machine_info  # noqa: E402

ROWS = ("greedy:16", "greedy:64", "greedy:1", "beam4:16", "beam4:64", "beam4:1")
DECODERS = ("flax", "flax-generate", "ctranslate2")
# int8 (--decoders): this project's search on weights quantized at load (jax_transformer.model.quantization: int8 x int8
# products, or int8 weights converted inside float ones) and CTranslate2's compute_type "int8", same weights.
INT8_DECODERS = ("flax-int8", "flax-int8-weights", "ctranslate2-int8")
QUANTIZE = {"flax-int8": "int8-dynamic", "flax-int8-weights": "int8-weights"}


def marian_shaped_model(preset_name: str, vocab: int, max_len: int, seed: int = 0, texts: Sequence[str] = ()):
    """(config, params, tokenizer): random weights of `preset_name`'s shape in Marian's conventions, and a
    MarianTokenizer whose vocabulary has `vocab` entries, as `export --format transformers` needs one: a
    SentencePiece model of `texts` with up to `vocab` pieces, or without texts a small one of the built-in task
    (the rest of the entries are placeholder pieces)."""
    import sentencepiece as spm

    from jax_transformer.data.default_task import default_pairs
    from jax_transformer.data.tokenizer import MarianTokenizer, unigram_model_bytes
    from jax_transformer.model.transformer import init_params
    from jax_transformer.settings.config import preset

    pad = vocab - 1
    config = preset(
        preset_name,
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        max_len=max_len,
        share_embeddings=True,
        tie_output=True,
        logits_bias=True,
        pad_id=pad,
        eos_id=0,
        bos_id=None,
        decoder_start_id=pad,
        sinusoid_layout="halves",
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        embedding_dropout=0.0,
    )
    params = init_params(config, seed)
    embed = np.array(params["shared_embed"]["embedding"])
    embed[pad] = 0.0  # Marian's pad row: the decoder's start embedding, zero
    params = {**params, "shared_embed": {"embedding": embed}}
    if texts:
        model = unigram_model_bytes(texts, vocab)
    else:
        model = unigram_model_bytes(default_pairs("train", n=500).sources, 100)  # a small SentencePiece model
    pieces = {"</s>": 0, "<unk>": 1}
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model)
    for i in range(processor.get_piece_size()):
        if processor.IdToPiece(i) not in ("<s>", "</s>", "<unk>"):
            pieces.setdefault(processor.IdToPiece(i), len(pieces))
    while len(pieces) < pad:
        pieces[f"\u2581w{len(pieces)}"] = len(pieces)
    pieces["<pad>"] = pad
    files = {"source.spm": model, "target.spm": model, "vocab.json": json.dumps(pieces).encode()}
    return config, params, MarianTokenizer(files, {"separate_vocabs": False})


def convert(params, config, tokenizer, folder: Path, run: dict | None = None) -> Path:
    """Writes the model as a MarianMTModel directory (jax_transformer.interop.hub) and converts it with CTranslate2's
    TransformersConverter; returns the CTranslate2 model folder."""
    import ctranslate2

    from jax_transformer.interop import hub

    run = run or {"imported_from": {"family": "marian"}, "decode": {"beam_size": 4, "alpha": 1.0}}
    hf = folder / "transformers"
    hub.export_transformers(params, config, tokenizer, run, hf)
    ct2 = folder / "ctranslate2"
    ctranslate2.converters.TransformersConverter(str(hf)).convert(str(ct2), quantization="float32")
    return ct2


def engine(names: Sequence[str]) -> str:
    """The run's one CTranslate2 decoder (ctranslate2 or ctranslate2-int8), which every row is compared with."""
    return next(name for name in names if name.startswith("ctranslate2"))


def decoders(
    config, params, translator, name: str, pieces, src: np.ndarray, beam: int, new_tokens: int, quantized=None
) -> dict:
    """name -> a zero-argument call that decodes `src` into (B, new_tokens) token ids. `translator` is CTranslate2's,
    its decoder called `name`; `quantized`: {decoder name: (params, config)} of the int8 rows."""
    from jax_transformer.decoding import decoders
    from jax_transformer.decoding.decoders import generate

    fixed = dict(max_len_a=0, max_len_b=new_tokens, min_len=new_tokens)
    index = {piece: i for i, piece in enumerate(pieces)}
    source = [[pieces[i] for i in row] for row in src]
    limits = dict(min_decoding_length=new_tokens, max_decoding_length=new_tokens)

    def ct2():
        results = translator.translate_batch(source, beam_size=beam, **limits)
        return np.array([[index[t] for t in r.hypotheses[0]] for r in results], np.int32)

    # The searches return their tokens as numpy, on the host: on a GPU a call's time includes the device's work.
    def flax(params=params, config=config):
        if beam == 1:
            return decoders.greedy_search(params, config, src, **fixed)[0]
        return decoders.beam_search(params, config, src, beam_size=beam, alpha=1.0, **fixed)[0]

    def flax_generate():
        return generate(
            params,
            config,
            src,
            max_length=new_tokens + 1,
            min_length=new_tokens + 1,
            num_beams=beam,
            banned=(config.pad_id,),
        )

    calls = {"flax": flax, "flax-generate": flax_generate, name: ct2}
    calls.update({name: (lambda pc=pc: flax(*pc)) for name, pc in (quantized or {}).items()})
    return calls


def timed(call: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one call. The CPU time is the whole process's, all its threads: the share of
    the machine's cores a decoder keeps busy (CTranslate2 runs each matrix product on `intra_threads` threads;
    XLA:CPU splits only its larger ops across the cores, and runs a decoding step's small ones one after another).
    Other threads' work in the window counts too (CTranslate2's OpenMP workers spin for a moment after its calls):
    negligible over calls of tens of milliseconds, not over calls of one or two."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> tuple[dict, dict]:
    """({name: wall seconds per call}, {name: cores used over its calls}) of `repeats` rounds of every call, in an
    order that rotates by one each round (drift on a shared machine hits all alike); cores used: CPU over wall time."""
    names = list(calls)
    times, cpu = {name: [] for name in names}, {name: 0.0 for name in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            wall, busy = timed(calls[name])
            times[name].append(wall)
            cpu[name] += busy
    return times, {name: cpu[name] / sum(times[name]) for name in names}


def benchmark(
    preset_name: str = "small",
    rows: Sequence[str] = ROWS,
    *,
    new_tokens: int = 64,
    src_len: int = 32,
    vocab: int = 8000,
    repeats: int = 7,
    threads: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    ct2_compute_type: str | None = None,
    names: Sequence[str] = DECODERS,
    log: Callable[[str], None] = print,
) -> dict:
    import ctranslate2
    import jax

    threads = threads or os.cpu_count() or 1
    ct2_compute_type = ct2_compute_type or dtype
    if len([name for name in names if name.startswith("ctranslate2")]) != 1:
        raise ValueError(f"one CTranslate2 decoder per run (two in one process slow each other), got {names}")
    from jax_transformer.model import quantization

    config, params, tokenizer = marian_shaped_model(preset_name, vocab, max(new_tokens, src_len) + 1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ct2_dir = convert(params, config, tokenizer, Path(tmp))  # the float32 weights; each engine casts its own
        config = config.replace(dtype=dtype)
        base = engine(names)
        compute_type = "int8" if base == "ctranslate2-int8" else ct2_compute_type
        translator = ctranslate2.Translator(
            str(ct2_dir), device=device, compute_type=compute_type, intra_threads=threads
        )
        quantized = {name: quantization.quantized(params, config, QUANTIZE[name]) for name in QUANTIZE if name in names}
        pieces = [tokenizer.piece(i) for i in range(vocab - 1)]  # CTranslate2's vocabulary: all but <pad>
        rng = np.random.default_rng(0)
        for row in rows:
            search, batch = row.split(":")
            beam, batch = (1 if search == "greedy" else int(search.removeprefix("beam"))), int(batch)
            src = rng.integers(2, vocab - 1, (batch, src_len)).astype(np.int32)
            src[:, -1] = config.eos_id
            every = decoders(config, params, translator, base, pieces, src, beam, new_tokens, quantized)
            calls = {name: every[name] for name in names}
            outputs = {name: call() for name, call in calls.items()}  # warm-up (compilation), untimed
            times, cores_used = interleaved(calls, repeats)
            for name in calls:
                best, median = min(times[name]), statistics.median(times[name])
                cores = cores_used[name]
                agree = lambda other: int(np.sum(np.all(outputs[name] == outputs[other], axis=1)))  # noqa: E731
                same = agree(base)
                same_as_flax = agree("flax") if "flax" in names else None
                results.append(
                    dict(
                        search=search,
                        batch=batch,
                        decoder=name,
                        seconds_min=best,
                        seconds_median=median,
                        tokens_per_s_best=batch * new_tokens / best,
                        tokens_per_s_median=batch * new_tokens / median,
                        same_as_ctranslate2=f"{same}/{batch}",  # as the run's CTranslate2 decoder
                        same_as_flax=None if same_as_flax is None else f"{same_as_flax}/{batch}",
                        cores_used=cores,
                    )
                )
                log(
                    f"{search:>7} batch {batch:>3}  {name:<17} {batch * new_tokens / median:>9.0f} tokens/s median "
                    f"{batch * new_tokens / best:>9.0f} best   {cores:.2f} cores   same tokens as "
                    f"{base}: {same}/{batch}"
                )
    settings = dict(
        preset=preset_name,
        d_model=config.d_model,
        d_ff=config.d_ff,
        layers=[config.num_encoder_layers, config.num_decoder_layers],
        vocab=vocab,
        src_len=src_len,
        new_tokens=new_tokens,
        repeats=repeats,
        ctranslate2_intra_threads=threads,
        ctranslate2=ctranslate2.__version__,
        ctranslate2_device=device,
        ctranslate2_compute_type=translator.compute_type,  # the type it runs, as CTranslate2 reports it
        decoders=list(names),
        flax_dtype=dtype if {"flax", "flax-generate"} & set(names) else None,
        jax_backend=jax.default_backend(),
        jax_matmul_precision=jax.config.jax_default_matmul_precision,
    )
    return {"machine": machine_info(), "settings": settings, "results": results}


def translate_run(run_dir: Path, input_path: Path, beam: int, repeats: int, log=print) -> dict:
    """`train.py translate` (translation.translate_lines) against CTranslate2 on the lines of `input_path`, with
    the run's tokenizer on both sides: sentences/s over the whole file, tokenizing and detokenizing included."""
    import ctranslate2

    from jax_transformer.checkpoint.settings import stored_settings
    from jax_transformer.decoding import loading
    from jax_transformer.decoding.decoders import decoder
    from jax_transformer.decoding.translation import translate_lines

    loaded = loading.load(run_dir, "best")  # as train.py translate loads it
    config, tokenizer, settings = loaded.config, loaded.tokenizer, stored_settings(loaded)
    decode = loading.decoding(loaded)
    lines = [line.rstrip("\n") for line in input_path.read_text(encoding="utf-8").splitlines()]
    # Lines longer than the model takes are left out (translate would stop at them), and counted.
    fits = [line for line in lines if len(tokenizer.encode(line)) < config.max_len]
    if len(fits) < len(lines):
        log(f"{len(lines) - len(fits)} of {len(lines)} lines are longer than the model takes: left out")
    lines = fits
    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        ct2_dir = convert(loaded.params, config, tokenizer, Path(tmp), run=settings)
        translator = ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type="float32", intra_threads=threads)
        # generate counts the start token in max_length and, with forced_eos, ends at its last position with EOS
        decode = decode.replace(beam_size=beam, alpha=1.0)
        limit = decoder(config, decode, config.max_len).length - int(decode.forced_eos)

        def ours():
            out = []
            translate_lines(
                loaded.params,
                config,
                tokenizer,
                iter(lines),
                out.append,
                decode,
                progress=False,
            )
            return out

        def ct2():
            source = [[tokenizer.piece(i, "source") for i in tokenizer.encode(x)] + ["</s>"] for x in lines]
            results = translator.translate_batch(
                source, beam_size=beam, max_batch_size=64, max_decoding_length=limit, min_decoding_length=0
            )
            index = tokenizer.target_vocab
            return [tokenizer.decode([index[t] for t in r.hypotheses[0]]) for r in results]

        calls = {"train.py translate": ours, "ctranslate2": ct2}
        outputs = {name: call() for name, call in calls.items()}
        times, cores_used = interleaved(calls, repeats)
    same = sum(a == b for a, b in zip(outputs["train.py translate"], outputs["ctranslate2"]))
    results = []
    for name in calls:
        best, median = min(times[name]), statistics.median(times[name])
        cores = cores_used[name]
        results.append(
            dict(
                decoder=name,
                sentences=len(lines),
                seconds_min=best,
                seconds_median=median,
                sentences_per_s_median=len(lines) / median,
                sentences_per_s_best=len(lines) / best,
                cores_used=cores,
            )
        )
        log(
            f"{name:<20} {len(lines) / median:>8.1f} sentences/s median, {len(lines) / best:>8.1f} best, "
            f"{cores:.2f} cores"
        )
    log(f"identical translations: {same}/{len(lines)}")
    pairs = zip(lines, outputs["train.py translate"], outputs["ctranslate2"])
    differ = [dict(source=x, ours=a, ctranslate2=b) for x, a, b in pairs if a != b][:3]
    for d in differ:
        log(f"differs: {d['source']!r}\n  ours:        {d['ours']!r}\n  ctranslate2: {d['ctranslate2']!r}")
    report = {"machine": machine_info(), "results": results, "identical": f"{same}/{len(lines)}", "beam": beam}
    return {**report, "first_differences": differ}


def table(report: dict) -> str:
    rows = report["results"]
    lines = [
        "| search | batch | decoder | tokens/s (median) | tokens/s (best) | / ctranslate2 (medians) | cores used | "
        "same tokens as ctranslate2 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        key = (row["search"], row["batch"], engine(report["settings"]["decoders"]))
        base = next(r for r in rows if (r["search"], r["batch"], r["decoder"]) == key)
        lines.append(
            f"| {row['search']} | {row['batch']} | {row['decoder']} | {row['tokens_per_s_median']:,.0f} | "
            f"{row['tokens_per_s_best']:,.0f} | {base['seconds_median'] / row['seconds_median']:.2f} | "
            f"{row['cores_used']:.2f} | {row['same_as_ctranslate2']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", help="model shape (default: small)")
    parser.add_argument(
        "--model",
        choices=("nllb-600m", "m2m100-418m"),
        help="a released multilingual model's shape instead of --preset: benchmarks/multilingual.py's rows (Flax "
        "against CTranslate2's float32 and int8, on the CPU; --rows, --new-tokens, --src-len, --repeats, --json)",
    )
    rows_help = f"comma-separated search:batch (default: {','.join(ROWS)})"
    parser.add_argument("--rows", default=",".join(ROWS), help=rows_help)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens produced per sentence (default: 64)")
    parser.add_argument("--src-len", type=int, default=32, help="source tokens per sentence (default: 32)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default: 8000)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per decoder and row (default: 7)")
    parser.add_argument("--quick", action="store_true", help="3 timed repeats")
    parser.add_argument("--threads", type=int, help="CTranslate2's intra_threads (default: the machine's cores)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="CTranslate2's device (default: cpu)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="Flax compute dtype (default: float32)"
    )
    parser.add_argument(
        "--ct2-compute-type",
        choices=("float32", "float16", "bfloat16", "int8", "int8_float32", "int8_float16", "int8_bfloat16"),
        help="CTranslate2's compute type (default: --dtype)",
    )
    parser.add_argument(
        "--matmul-precision",
        choices=("default", "high", "highest"),
        help="jax_default_matmul_precision (default: JAX's; on a GPU its float32 matmuls are then TF32)",
    )
    parser.add_argument(
        "--decoders",
        default=",".join(DECODERS),
        help=f"comma-separated decoders to time, ctranslate2 among them (default: {','.join(DECODERS)}); int8: "
        f"{','.join(INT8_DECODERS)} (ctranslate2-int8 in place of ctranslate2)",
    )
    parser.add_argument("--run", type=Path, help="a run directory: time translate end to end on --input instead")
    parser.add_argument("--input", type=Path, help="text to translate with --run, one sentence per line")
    parser.add_argument("--beam-size", type=int, default=4, help="beam size with --run (default: 4)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--write-marian",
        type=Path,
        metavar="DIR",
        help="write a random-weight model of --preset's shape in Marian's conventions as a transformers directory "
        "(for `train.py import`, then `train --init-from`: a model CTranslate2 can read) and exit",
    )
    parser.add_argument("--texts", type=Path, nargs="+", default=(), help="with --write-marian: its vocabulary's text")
    parser.add_argument("--max-len", type=int, default=128, help="with --write-marian: positions (default: 128)")
    args = parser.parse_args(argv)
    if args.model:  # the real shapes need their own model files and tokenizer: that script's decoding rows
        import subprocess

        forwarded = ["--model", args.model, "--skip-train", "--rows", args.rows, "--new-tokens", str(args.new_tokens)]
        forwarded += ["--src-len", str(args.src_len), "--repeats", str(3 if args.quick else args.repeats)]
        forwarded += ["--json", str(args.json)] if args.json else []
        return subprocess.run([sys.executable, str(REPO / "benchmarks" / "multilingual.py"), *forwarded]).returncode
    if args.write_marian:
        from jax_transformer.interop import hub

        texts = [line for path in args.texts for line in path.read_text(encoding="utf-8").splitlines()]
        config, params, tokenizer = marian_shaped_model(args.preset, args.vocab, args.max_len, texts=texts)
        run = {"imported_from": {"family": "marian"}, "decode": {"beam_size": 4, "alpha": 1.0}}
        hub.export_transformers(params, config, tokenizer, run, args.write_marian)
        print(f"wrote {args.write_marian}: {args.preset} shape, vocabulary {args.vocab}, {args.max_len} positions")
        return 0
    try:
        import ctranslate2
    except ImportError:
        print("ctranslate2 is not installed (pip install -e '.[ctranslate2]'): this benchmark is skipped")
        return 0
    names = tuple(name for name in args.decoders.split(",") if name)
    engines = [name for name in names if name.startswith("ctranslate2")]
    if len(engines) != 1 or not set(names) <= {*DECODERS, *INT8_DECODERS}:
        # Two CTranslate2 translators in one process slow each other down (docs/benchmarks.md#int8).
        parser.error(
            f"--decoders: a comma-separated subset of {','.join(DECODERS + INT8_DECODERS)} with one CTranslate2 in "
            "it (ctranslate2 or ctranslate2-int8: time the other in a run of its own)"
        )
    import jax

    if args.matmul_precision:
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    backend = jax.default_backend()
    if args.device == "cuda" and backend != "gpu":
        parser.error(f"--device cuda: JAX's default backend is {backend!r}, not the GPU")
    if args.device == "cpu" and backend != "cpu":  # the two engines on different devices: not a comparison
        parser.error(f"JAX runs on {backend!r} here: give --device cuda, or run JAX on the CPU (JAX_PLATFORMS=cpu)")
    if args.run and (args.device != "cpu" or args.dtype != "float32" or args.ct2_compute_type or names != DECODERS):
        rows_only = "--device, --dtype, --ct2-compute-type and --decoders apply to the rows only"
        parser.error(f"--run times train.py translate on the CPU in float32 against CTranslate2's: {rows_only}")
    compute_type = args.ct2_compute_type or args.dtype
    supported = ctranslate2.get_supported_compute_types(args.device)
    if compute_type not in supported:
        parser.error(
            f"CTranslate2 runs {sorted(supported)} on this {args.device}, not {compute_type!r}: give "
            "--ct2-compute-type (the Flax model in bfloat16 may run beside CTranslate2's float32)"
        )
    info = machine_info()
    gpus = f"; GPU: {info['gpus']}" if args.device == "cuda" else ""
    print(f"machine: {info['cpu_model']}, {info['cores']} cores{gpus}; {info['libraries']}", flush=True)
    if args.run:
        if not args.input:
            parser.error("--run needs --input")
        report = translate_run(args.run, args.input, args.beam_size, 3 if args.quick else args.repeats)
    else:
        report = benchmark(
            args.preset,
            [r for r in args.rows.split(",") if r],
            new_tokens=args.new_tokens,
            src_len=args.src_len,
            vocab=args.vocab,
            repeats=3 if args.quick else args.repeats,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            ct2_compute_type=compute_type,
            names=names,
            log=lambda line: print(line, flush=True),
        )
        print()
        print(table(report))
    print(f"load average after: {machine_info()['load_average']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
