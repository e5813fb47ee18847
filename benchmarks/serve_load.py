#!/usr/bin/env python3
"""`train.py serve` under a bounded load on loopback, against `translate` and CTranslate2 on the same weights.

    python benchmarks/serve_load.py                        # clients 1, 4, 16; 192 requests of one sentence each
    python benchmarks/serve_load.py --clients 1 8 --requests 64 --quick     # a first look
    python benchmarks/serve_load.py --input val.de         # the sentences (default: Multi30k's val.de if present)

The model: the small preset's shape in Marian's conventions with random weights (benchmarks/ctranslate2_decoding.py's
`marian_shaped_model`, its SentencePiece model learned on the sentences), written as a MarianMTModel directory,
imported into a run (`train.py import`) for `serve` and `translate`, and converted by CTranslate2's own converter,
so all three decode the very same float32 weights. Greedy search, at most `--new-tokens` tokens per sentence (a
random model seldom ends a sentence on its own: every row runs to the limit, in all three alike).

Rows:
- `serve, N clients`: a child process `train.py serve --port 0` (its start-up, and one untimed pass of every load
  to compile the batch shapes it makes, before the clock starts); N client threads, each with its own keep-alive
  connection, send the requests one after the other (LibreTranslate's POST /translate, one sentence each) until
  `--requests` are sent in all. requests/s and sentences/s over the wall time of all of them; p50 and p99 of each
  request's latency; errors: any answer but 200.
- `translate`: `translation.translate` of the same sentences in this process, all at once (what `train.py
  translate` does with a file, its start-up left out), after one untimed warm-up.
- `ctranslate2`: `Translator.translate_batch` of the same sentences, max_batch_size 64, `intra_threads` = the cores.
Each row once per repeat, rows alternated; the table gives the median of the repeats (and the best of them). The
machine is shared with nothing else only if you make it so: the script prints what it ran on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.ctranslate2_decoding import convert, marian_shaped_model  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402

MULTI30K = REPO.parent / "shared" / "data" / "multi30k" / "val.de"


def sentences(path: Path | None, n: int) -> list[str]:
    if path is None and MULTI30K.exists():
        path = MULTI30K
    if path is not None:
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        from jax_transformer.data.default_task import default_pairs

        lines = list(default_pairs("valid", n=n).sources)
    return (lines * (n // len(lines) + 1))[:n]


class Service:
    """`train.py serve` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, run: Path, flags: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(REPO / "train.py"), "serve", "--checkpoint", str(run), "--port", "0", *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        for line in self.process.stderr:
            if line.startswith("serving http://"):
                self.host, port = line.split()[1].removeprefix("http://").split(":")
                self.port = int(port)
                break
        else:
            raise RuntimeError("serve did not start")
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=300)


def load(service: Service, texts: list[str], clients: int) -> dict:
    """Every text once, as requests from `clients` threads with a connection each: wall time, latencies, errors."""
    lock, latencies, errors = threading.Lock(), [], []
    todo = iter(range(len(texts)))

    def client() -> None:
        connection = http.client.HTTPConnection(service.host, service.port, timeout=600)
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                break
            body = json.dumps({"q": texts[i], "source": "de", "target": "en"})
            began = time.perf_counter()
            connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            with lock:
                latencies.append(time.perf_counter() - began)
                if response.status != 200:
                    errors.append(response.status)
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    latencies.sort()
    return {
        "seconds": wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "errors": len(errors),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=192, help="requests of one sentence each, per row")
    parser.add_argument("--input", type=Path, help="sentences, one per line (default: Multi30k val.de if present)")
    parser.add_argument("--new-tokens", type=int, default=32, help="at most this many tokens per translation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats

    from jax_transformer.decoding import loading
    from jax_transformer.decoding.translation import translate
    from jax_transformer.interop import hub

    texts = sentences(args.input, args.requests)
    # Imported models decode by transformers' rules: max_length counts the start token; no forced EOS, so that each
    # engine stops after the same `new_tokens` tokens as CTranslate2's max_decoding_length.
    limits = {"beam_size": 1, "max_length": args.new_tokens + 1, "forced_eos": False}
    flags = ["--beam-size", "1", "--max-length", str(args.new_tokens + 1), "--no-forced-eos"]
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config, params, tokenizer = marian_shaped_model("small", 8000, 128, texts=texts)
        run_info = {"imported_from": {"family": "marian"}, "decode": {"beam_size": 1, "alpha": 1.0}}
        hub.export_transformers(params, config, tokenizer, run_info, tmp / "hf")
        subprocess.run([sys.executable, str(REPO / "train.py"), "import", str(tmp / "hf"), "--output",
                        str(tmp / "run")], check=True, capture_output=True)  # fmt: skip
        loaded = loading.load(tmp / "run", "latest")
        decode = loading.decoding(loaded, limits)
        ct2 = None
        try:
            import ctranslate2

            folder = convert(loaded.params, loaded.config, loaded.tokenizer, tmp / "ct2", run=run_info)
            ct2 = ctranslate2.Translator(str(folder), device="cpu", compute_type="float32",
                                         intra_threads=os.cpu_count() or 1)  # fmt: skip
        except ImportError:
            print("ctranslate2 is not installed: its row is left out")
        tok = loaded.tokenizer
        source = [[tok.piece(i, "source") for i in tok.encode(x)] + ["</s>"] for x in texts]

        outputs = {}

        def run_translate() -> dict:
            began = time.perf_counter()
            outputs["translate"] = translate(loaded.params, loaded.config, tok, texts, decode, progress=False)
            return {"seconds": time.perf_counter() - began, "errors": 0}

        def run_ct2() -> dict:
            began = time.perf_counter()
            found = ct2.translate_batch(source, beam_size=1, max_batch_size=64, max_decoding_length=args.new_tokens)
            seconds = time.perf_counter() - began
            outputs["ctranslate2"] = [tok.decode([tok.target_vocab[t] for t in r.hypotheses[0]]) for r in found]
            return {"seconds": seconds, "errors": 0}

        run_translate()  # compiles its programs
        service = Service(tmp / "run", [*flags, "--languages", "de-en", "--max-queue", str(len(texts) + 1)])
        try:
            for clients in args.clients:  # untimed: the batch shapes each load makes compile here, once
                load(service, texts, clients)
            for _ in range(repeats):
                for clients in args.clients:
                    name = f"serve, {clients} client{'s' * (clients > 1)}"
                    rows.setdefault(name, []).append(load(service, texts, clients))
                rows.setdefault("translate (one call, all sentences)", []).append(run_translate())
                if ct2 is not None:
                    rows.setdefault("ctranslate2 translate_batch", []).append(run_ct2())
        finally:
            code = service.stop()
    if "ctranslate2" in outputs:  # the same weights and search: the same translations, but for near-ties
        same = sum(a == b for a, b in zip(outputs["translate"], outputs["ctranslate2"]))
        print(f"translate and ctranslate2: {same}/{len(texts)} identical translations")
    info = machine_info()
    print(f"machine: {info}")
    print(f"{len(texts)} sentences, greedy, at most {args.new_tokens} tokens each; {repeats} repeat(s); exit {code}")
    print("| row | requests/s | sentences/s (best) | p50 ms | p99 ms | errors |\n|---|---:|---:|---:|---:|---:|")
    report = {"machine": info, "sentences": len(texts), "new_tokens": args.new_tokens, "rows": {}}
    for name, runs in rows.items():
        seconds = [r["seconds"] for r in runs]
        median, best = statistics.median(seconds), min(seconds)
        serve = name.startswith("serve")
        p50 = statistics.median(r["p50_ms"] for r in runs) if serve else None
        p99 = statistics.median(r["p99_ms"] for r in runs) if serve else None
        errors = sum(r["errors"] for r in runs)
        rate = len(texts) / median
        print(
            f"| {name} | {f'{rate:.1f}' if serve else '-'} | {rate:.1f} ({len(texts) / best:.1f}) | "
            f"{f'{p50:.0f}' if serve else '-'} | {f'{p99:.0f}' if serve else '-'} | {errors} |"
        )
        report["rows"][name] = {"seconds": seconds, "p50_ms": p50, "p99_ms": p99, "errors": errors}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
