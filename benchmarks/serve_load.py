#!/usr/bin/env python3
"""`train.py serve` under a bounded load on loopback, against `translate` and CTranslate2 on the same weights.

    python benchmarks/serve_load.py                        # clients 1, 4, 16, 64; 192 requests of one sentence each
    python benchmarks/serve_load.py --clients 1 8 --requests 64 --quick     # a first look
    python benchmarks/serve_load.py --input val.de         # the sentences (default: Multi30k's val.de if present)
    python benchmarks/serve_load.py --soak-minutes 10      # and 10 minutes of 8 clients on one server, then SIGTERM
    python benchmarks/serve_load.py --repo /tmp/serve-before   # another checkout's serve (git worktree add ...)

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
  request's latency; errors: any answer but 200. After each row, the service's `compilations_after_ready` (GET
  /health: the programs it compiled after it said it was ready, counted from its start), where it reports one.
- `translate`: `translation.translate` of the same sentences in this process, all at once (what `train.py
  translate` does with a file, its start-up left out), after one untimed warm-up.
- `ctranslate2`: `Translator.translate_batch` of the same sentences, max_batch_size 64, `intra_threads` = the cores.
Each row once per repeat, rows alternated; the table gives the median of the repeats (and the best of them). Then
"p99 / p50 at 8 clients": how far the slowest requests are from the typical one (the `serve, 8 clients` row's
medians where --clients has 8; the soak's).

`--soak-minutes M` (0: none): a fresh service, one untimed pass of the sentences by `--soak-clients` (8) clients,
then those clients send without a pause for M minutes, each on a keep-alive connection (a new one where the server
closed it: checked before each request, as urllib3 does): requests, errors, p50/p99, and the server's resident
memory (psutil) after the warm-up and at the end. Then SIGTERM while they still send: a request whose bytes were
all sent must be answered (a 503 counts as an answer); one refused or reset before it was sent was not accepted.
The script says "every accepted request answered", or how many were not (told apart: sent before SIGTERM or after
it, on a new connection or a kept-alive one, and whether that connection's last answer came after SIGTERM without
`Connection: close`, so that the client could not know the server would close it; EOF or reset) and exits 1.

`--repo PATH`: `serve` of that checkout (its train.py, cwd and PYTHONPATH), e.g. one from `git worktree add`; the
model, `translate` and CTranslate2 are this checkout's. The machine is shared with nothing else only if you make it
so: the script prints what it ran on.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

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


def imported_model(texts: list[str], folder: Path):
    """The benchmark's model (the module's docstring) written as a MarianMTModel directory and imported into
    folder/run with `train.py import`: (its run info, the run loaded)."""
    from jax_transformer.decoding import loading
    from jax_transformer.interop import hub

    config, params, tokenizer = marian_shaped_model("small", 8000, 128, texts=texts)
    run_info = {"imported_from": {"family": "marian"}, "decode": {"beam_size": 1, "alpha": 1.0}}
    hub.export_transformers(params, config, tokenizer, run_info, folder / "hf")
    subprocess.run([sys.executable, str(REPO / "train.py"), "import", str(folder / "hf"), "--output",
                    str(folder / "run")], check=True, capture_output=True)  # fmt: skip
    return run_info, loading.load(folder / "run", "latest")


class Service:
    """`train.py serve` of the checkout `repo` in a child process, on a free port of 127.0.0.1."""

    def __init__(self, run: Path, flags: list[str], repo: Path = REPO) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(repo / "train.py"), "serve", "--checkpoint", str(run), "--port", "0", *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=repo,
            env=dict(os.environ, PYTHONPATH=str(repo)),
        )
        for line in self.process.stderr:
            if line.startswith("serving http://"):
                self.host, port = line.split()[1].removeprefix("http://").split(":")
                self.port = int(port)
                break
        else:
            raise RuntimeError("serve did not start")
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()

    def health(self) -> dict:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            connection.request("GET", "/health")
            return json.loads(connection.getresponse().read())
        finally:
            connection.close()

    def compilations(self):
        """GET /health's `compilations_after_ready`, None where the service reports none."""
        return self.health().get("compilations_after_ready")

    def rss_mib(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=300)


def load(service: Service, texts: list[str], clients: int) -> dict:
    """Every text once, as requests from `clients` threads with a connection each: wall time, latencies, errors."""
    lock, latencies, errors, first_error = threading.Lock(), [], [], {}
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
            answer = response.read()
            with lock:
                latencies.append(time.perf_counter() - began)
                if response.status != 200:
                    errors.append(response.status)
                    first_error.setdefault(
                        "first_error", f"{response.status} {answer[:300].decode('utf-8', 'replace')}"
                    )
        connection.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    return {"seconds": wall, **quantiles(latencies), "errors": len(errors), **first_error}


def quantiles(latencies: list[float]) -> dict:
    ordered = sorted(latencies)
    if not ordered:
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": 1000 * ordered[len(ordered) // 2],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def dropped(connection: http.client.HTTPConnection) -> bool:
    """Whether the server closed this idle kept-alive connection: readable while no request is out (EOF or a reset;
    a server sends nothing unasked)."""
    if connection.sock is None:
        return True
    return bool(select.select([connection.sock], [], [], 0)[0])


def soak(service: Service, texts: list[str], clients: int, minutes: float) -> dict:
    """`clients` keep-alive clients sending for `minutes` after a warm-up pass (latencies, errors, resident memory
    at both ends), then SIGTERM while they still send: which requests were not accepted, which were answered, and
    which were sent in full but got no answer."""
    load(service, texts, clients)  # untimed: the batch shapes of this load compile here
    rss_start = service.rss_mib()
    lock = threading.Lock()
    latencies: list[float] = []
    errors: Counter = Counter()
    late: Counter = Counter()  # after SIGTERM: the answers' statuses, "not accepted", unanswered ones
    first_error: dict[str, str] = {}
    terminated = threading.Event()
    stop = threading.Event()
    ends = time.monotonic() + 60 * minutes

    def client(c: int) -> None:
        connection, i = None, c
        kept_after = False  # this connection's last answer came after SIGTERM, without "Connection: close"
        while not stop.is_set():
            if connection is not None and dropped(connection):
                connection.close()
                connection = None
            reused = connection is not None
            after = terminated.is_set()
            if connection is None:
                connection = http.client.HTTPConnection(service.host, service.port, timeout=120)
            body = json.dumps({"q": texts[i % len(texts)], "source": "de", "target": "en"})
            i += clients
            began = time.perf_counter()
            try:
                connection.request("POST", "/translate", body, {"Content-Type": "application/json"})
            except OSError as e:  # refused, or reset before the request was out: not accepted
                connection.close()
                connection = None
                after = after or terminated.is_set()
                with lock:
                    (late if after else errors)["not accepted" if after else type(e).__name__] += 1
                if after:
                    break
                continue
            sent_after = terminated.is_set()
            try:
                response = connection.getresponse()
                answer = response.read()
            except (OSError, http.client.HTTPException) as e:  # sent in full, no answer
                connection.close()
                connection = None
                when = "after" if sent_after else "before"
                how = "a kept-alive" if reused else "a new"
                if reused and kept_after:
                    how += " connection whose last answer, after SIGTERM, had no Connection: close"
                else:
                    how += " connection"
                with lock:
                    late[f"unanswered (sent {when} SIGTERM on {how}: {type(e).__name__})"] += 1
                continue
            seconds = time.perf_counter() - began
            kept_after = terminated.is_set() and not response.will_close
            if response.will_close:
                connection.close()
                connection = None
            with lock:
                if time.monotonic() > ends:  # (answered after the soak's end: during the shutdown)
                    late[response.status] += 1
                else:
                    latencies.append(seconds)
                    if response.status != 200:
                        errors[response.status] += 1
                        first_error.setdefault(
                            "first_error", f"{response.status} {answer[:300].decode('utf-8', 'replace')}"
                        )
        if connection is not None:
            connection.close()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    for t in threads:
        t.start()
    time.sleep(max(0.0, ends - time.monotonic()))
    rss_end = service.rss_mib()
    compilations = service.compilations()
    with lock:
        measured, failed = list(latencies), dict(errors)
    terminated.set()
    began = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    code = service.process.wait(timeout=300)
    exit_s = time.monotonic() - began
    for t in threads:  # each ends at its first refused connection
        t.join(60)
    stop.set()
    for t in threads:
        t.join(60)
    unanswered = {k: v for k, v in late.items() if str(k).startswith("unanswered")}
    return {
        "minutes": minutes,
        "clients": clients,
        "requests": len(measured),
        "errors": failed,
        **quantiles(measured),
        "rss_mib": [rss_start, rss_end],
        "compilations_after_ready": compilations,
        "after_sigterm": {str(k): v for k, v in late.items()},
        "unanswered": sum(unanswered.values()),
        "exit": code,
        "exit_seconds": exit_s,
        **first_error,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=192, help="requests of one sentence each, per row")
    parser.add_argument("--input", type=Path, help="sentences, one per line (default: Multi30k val.de if present)")
    parser.add_argument("--new-tokens", type=int, default=32, help="at most this many tokens per translation")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--soak-minutes", type=float, default=0.0, help="minutes of the soak (0: none)")
    parser.add_argument("--soak-clients", type=int, default=8, help="clients of the soak")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py serve to start")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    repeats = 1 if args.quick else args.repeats

    from jax_transformer.decoding import loading
    from jax_transformer.decoding.translation import translate

    texts = sentences(args.input, args.requests)
    # Imported models decode by transformers' rules: max_length counts the start token; no forced EOS, so that each
    # engine stops after the same `new_tokens` tokens as CTranslate2's max_decoding_length.
    limits = {"beam_size": 1, "max_length": args.new_tokens + 1, "forced_eos": False}
    flags = ["--beam-size", "1", "--max-length", str(args.new_tokens + 1), "--no-forced-eos"]
    rows: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run_info, loaded = imported_model(texts, tmp)
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
        serve_flags = [*flags, "--languages", "de-en", "--max-queue", str(len(texts) + 1)]
        service = Service(tmp / "run", serve_flags, repo)
        try:
            for clients in args.clients:  # untimed: the batch shapes each load makes compile here, once
                load(service, texts, clients)
            for _ in range(repeats):
                for clients in args.clients:
                    name = f"serve, {clients} client{'s' * (clients > 1)}"
                    found = load(service, texts, clients)
                    found["compilations_after_ready"] = service.compilations()
                    rows.setdefault(name, []).append(found)
                rows.setdefault("translate (one call, all sentences)", []).append(run_translate())
                if ct2 is not None:
                    rows.setdefault("ctranslate2 translate_batch", []).append(run_ct2())
        finally:
            code = service.stop()
        soaked = None
        if args.soak_minutes > 0:
            soaking = Service(tmp / "run", serve_flags, repo)
            try:
                soaked = soak(soaking, texts, args.soak_clients, args.soak_minutes)
            finally:
                if soaking.process.poll() is None:
                    soaking.process.kill()
    if "ctranslate2" in outputs:  # the same weights and search: the same translations, but for near-ties
        same = sum(a == b for a, b in zip(outputs["translate"], outputs["ctranslate2"]))
        print(f"translate and ctranslate2: {same}/{len(texts)} identical translations")
    info = machine_info()
    print(f"machine: {info}")
    print(f"serve of {repo}")
    print(f"{len(texts)} sentences, greedy, at most {args.new_tokens} tokens each; {repeats} repeat(s); exit {code}")
    print("| row | requests/s | sentences/s (best) | p50 ms | p99 ms | errors | compilations after ready |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    report = {"machine": info, "repo": str(repo), "sentences": len(texts), "new_tokens": args.new_tokens, "rows": {}}
    for name, runs in rows.items():
        seconds = [r["seconds"] for r in runs]
        median, best = statistics.median(seconds), min(seconds)
        serve = name.startswith("serve")
        p50 = statistics.median(r["p50_ms"] for r in runs) if serve else None
        p99 = statistics.median(r["p99_ms"] for r in runs) if serve else None
        errors = sum(r["errors"] for r in runs)
        compiled = runs[-1].get("compilations_after_ready")  # (counted from the start: after the last repeat)
        rate = len(texts) / median
        print(
            f"| {name} | {f'{rate:.1f}' if serve else '-'} | {rate:.1f} ({len(texts) / best:.1f}) | "
            f"{f'{p50:.0f}' if serve else '-'} | {f'{p99:.0f}' if serve else '-'} | {errors} | "
            f"{'-' if compiled is None else compiled} |"
        )
        report["rows"][name] = {"seconds": seconds, "p50_ms": p50, "p99_ms": p99, "errors": errors,
                                "compilations_after_ready": compiled}  # fmt: skip
    for name, runs in rows.items():
        errors = next((r["first_error"] for r in runs if "first_error" in r), None)
        if errors:
            print(f"{name}: the first error: {errors}")
        report["rows"][name]["first_error"] = errors
    ratios = {}
    if "serve, 8 clients" in report["rows"]:
        row = report["rows"]["serve, 8 clients"]
        ratios["serve, 8 clients row"] = row["p99_ms"] / row["p50_ms"]
    if soaked is not None and soaked["clients"] == 8 and soaked["p50_ms"]:
        ratios["soak"] = soaked["p99_ms"] / soaked["p50_ms"]
    if ratios:
        print("p99 / p50 at 8 clients: " + "; ".join(f"{v:.2f} ({k})" for k, v in ratios.items()))
    else:
        print("p99 / p50 at 8 clients: not measured (--clients has no 8, and no soak of 8 clients)")
    report["p99_over_p50_at_8_clients"] = ratios
    unanswered = 0
    if soaked is not None:
        report["soak"] = soaked
        unanswered = soaked["unanswered"]
        start, end = soaked["rss_mib"]
        failed = ", ".join(f"{k}×{v}" for k, v in soaked["errors"].items()) or "none"
        late = ", ".join(f"{k}×{v}" for k, v in soaked["after_sigterm"].items() if not k.startswith("unanswered"))
        compiled = soaked["compilations_after_ready"]
        print(
            f"soak: {soaked['minutes']:g} min, {soaked['clients']} keep-alive clients, one service: "
            f"{soaked['requests']} requests, errors {failed}, p50 {soaked['p50_ms']:.0f} ms, p99 "
            f"{soaked['p99_ms']:.0f} ms; resident memory {start:.0f} MiB after the warm-up, {end:.0f} MiB at the end"
            + ("" if compiled is None else f"; compilations_after_ready {compiled}")
        )
        if "first_error" in soaked:
            print(f"soak: the first error: {soaked['first_error']}")
        verdict = "every accepted request answered"
        if unanswered:
            how = ", ".join(f"{k}×{v}" for k, v in soaked["after_sigterm"].items() if k.startswith("unanswered"))
            verdict = f"{unanswered} requests sent in full got NO ANSWER ({how})"
        print(
            f"SIGTERM while they sent: exit {soaked['exit']} after {soaked['exit_seconds']:.1f} s; the requests after "
            f"the soak's end: {late or 'none'}; {verdict}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=float) + "\n")
    return 1 if unanswered else 0


if __name__ == "__main__":
    sys.exit(main())
