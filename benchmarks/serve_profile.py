#!/usr/bin/env python3
"""Where the service's throughput goes at N concurrent clients, each candidate measured on its own (the model and
sentences of benchmarks/serve_load.py: the small preset's shape, random weights, greedy, 32 tokens, Multi30k):

    python benchmarks/serve_profile.py                 # 16 clients, 192 one-sentence requests, 3 repeats
    python benchmarks/serve_profile.py --clients 16 64 --quick

Rows:
- `translate, batches of B`: `translation.translate` of the same sentences in this process with batch_size B (64:
  what `train.py translate` does; N: the largest batch N clients can make, one sentence each; N / 2: what each of
  two decoding threads holds when N clients split into two groups), two batches side by side on a CPU of two
  cores: the engine's rate with as many sentences in flight as the service has at N clients.
- `serve, window W ms`: N clients against `serve --batch-window-ms W`: sentences/s, and
  from /metrics the mean sentences per decoded batch and the share of the wall time the decoders spent decoding
  (jt_batch_seconds); the CPU the server used
  (all its threads), its event loop's thread alone, and the clients' (this process: on a 2-core machine the load
  competes with the service for the same cores).
- `serve, empty requests`: N clients sending `q: ""` (no sentence: the HTTP, JSON, limits and event-loop path
  alone): requests/s, i.e. the per-request overhead.
- `tokenize`: splitting and tokenizing the sentences in this process as a request's are (`Segmenter.split`, then
  `encode_sources`; the splitter's fit check tokenizes once more): microseconds per sentence.
Rows alternate within a repeat; the table gives medians (best in brackets). Prints the machine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.serve_load import Service, imported_model, load, sentences  # noqa: E402


def metrics(service: Service) -> dict[str, float]:
    """The service's /metrics samples, by name with labels, summed over models."""
    connection = http.client.HTTPConnection(service.host, service.port, timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def cpu_seconds(service: Service) -> tuple[float, float, float]:
    """CPU seconds so far of the server process, of its main thread (the event loop: uvicorn runs it there), and
    of this process (the clients)."""
    import os

    import psutil

    process = psutil.Process(service.process.pid)
    total = sum(process.cpu_times()[:2])
    loop = next((t.user_time + t.system_time for t in process.threads() if t.id == process.pid), 0.0)
    mine = os.times()
    return total, loop, mine.user + mine.system


def empty_requests(service: Service, n: int, clients: int) -> float:
    """requests/s of `n` requests with no sentence from `clients` keep-alive clients."""
    todo, lock = iter(range(n)), threading.Lock()

    def client():
        connection = http.client.HTTPConnection(service.host, service.port, timeout=60)
        body = json.dumps({"q": "", "source": "de", "target": "en"})
        while True:
            with lock:
                if next(todo, None) is None:
                    break
            connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
            connection.getresponse().read()
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return n / (time.perf_counter() - began)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[16])
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--windows", type=float, nargs="+", default=[0.0, 2.0, 5.0, 10.0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats

    from jax_transformer.decoding import loading
    from jax_transformer.decoding.documents import Segmenter, model_fits
    from jax_transformer.decoding.translation import encode_sources, translate

    texts = sentences(None, args.requests)
    flags = ["--beam-size", "1", "--max-length", str(args.new_tokens + 1), "--no-forced-eos"]
    rows: dict[str, list[float]] = {}
    details: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _, loaded = imported_model(texts, tmp)
        decode = loading.decoding(loaded, {"beam_size": 1, "max_length": args.new_tokens + 1, "forced_eos": False})
        sizes = sorted({64, *args.clients, *(max(1, c // 2) for c in args.clients)})
        for size in sizes:  # untimed: compiles its programs
            translate(loaded.params, loaded.config, loaded.tokenizer, texts, decode, batch_size=size, progress=False)
        segmenter = Segmenter("de", model_fits(loaded.tokenizer, loaded.config))
        services = {}
        try:
            for window in args.windows:
                services[window] = Service(tmp / "run", [*flags, "--languages", "de-en", "--max-queue", "100000",
                                                         "--batch-window-ms", str(window)])  # fmt: skip
            for service in services.values():
                for clients in args.clients:
                    load(service, texts, clients)  # untimed
            for _ in range(repeats):
                for size in sizes:
                    began = time.perf_counter()
                    translate(loaded.params, loaded.config, loaded.tokenizer, texts, decode, batch_size=size,
                              progress=False)  # fmt: skip
                    rows.setdefault(f"translate, batches of {size}", []).append(
                        len(texts) / (time.perf_counter() - began)
                    )
                for clients in args.clients:
                    for window, service in services.items():
                        before, cpu_before = metrics(service), cpu_seconds(service)
                        found = load(service, texts, clients)
                        after, cpu_after = metrics(service), cpu_seconds(service)
                        cpu = [(b - a) / found["seconds"] for a, b in zip(cpu_before, cpu_after)]
                        batches = after["jt_batch_sentences_count"] - before["jt_batch_sentences_count"]
                        decoding = after["jt_batch_seconds_sum"] - before["jt_batch_seconds_sum"]
                        name = f"serve, {clients} clients, window {window:g} ms"
                        rows.setdefault(name, []).append(len(texts) / found["seconds"])
                        details.setdefault(name, []).append({
                            "per_batch": len(texts) / max(batches, 1),
                            "decoding_share": decoding / found["seconds"],
                            "p50_ms": found["p50_ms"], "p99_ms": found["p99_ms"], "errors": found["errors"],
                            "server_cpu": cpu[0], "loop_cpu": cpu[1], "client_cpu": cpu[2],
                        })  # fmt: skip
                    name = f"serve, {clients} clients, empty requests (requests/s)"
                    first = next(iter(services.values()))
                    rows.setdefault(name, []).append(empty_requests(first, 2000, clients))
                began = time.perf_counter()
                for text in texts:
                    pieces = segmenter.split(text)
                    encode_sources(loaded.tokenizer, [p.text for p in pieces if p.sentence], loaded.config)
                rows.setdefault("tokenize (us per sentence)", []).append(
                    1e6 * (time.perf_counter() - began) / len(texts)
                )
        finally:
            for service in services.values():
                service.stop()
    print(f"machine: {machine_info()}")
    print(f"{len(texts)} one-sentence requests, greedy, {args.new_tokens} tokens; {repeats} repeat(s)")
    print("| row | sentences/s (best) | sentences per batch | decoder busy | server CPU | its event loop "
          "| clients' CPU | p50 ms | p99 ms | errors |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report = {"machine": machine_info(), "rows": {}}
    for name, values in rows.items():
        best = min(values) if name.startswith("tokenize") else max(values)
        extra = details.get(name)
        cells = ["-"] * 8
        if extra:
            med = lambda key: statistics.median(d[key] for d in extra)  # noqa: E731
            share = lambda key: f"{100 * med(key):.0f}%"  # noqa: E731
            cells = [f"{med('per_batch'):.1f}", share("decoding_share"), share("server_cpu"), share("loop_cpu"),
                     share("client_cpu"), f"{med('p50_ms'):.0f}", f"{med('p99_ms'):.0f}",
                     str(sum(d["errors"] for d in extra))]  # fmt: skip
        print(f"| {name} | {statistics.median(values):.1f} ({best:.1f}) | " + " | ".join(cells) + " |")
        report["rows"][name] = {"values": values, "details": extra}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
