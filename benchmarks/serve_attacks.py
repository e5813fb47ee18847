#!/usr/bin/env python3
"""How `train.py serve` holds up against hostile or clumsy clients, on loopback: one table, a row per attack.

    python benchmarks/serve_attacks.py                            # every row, against this checkout's serve
    python benchmarks/serve_attacks.py --repo /tmp/serve-before   # another checkout's (git worktree add ...)
    python benchmarks/serve_attacks.py --rows 1,3 --json attacks.json

The model: the trained tiny model saved as test data (tests/helpers/saved.py's `saved_run`, written by this
checkout's tests package into a temporary folder; the built-in task, English number words to French), so it decodes
the same on every CPU. Each row starts its own `train.py serve --port 0` of `--repo` (a child process, cwd and
PYTHONPATH that checkout, `--compilation-cache off` so that every compilation happens in the row that causes it;
`--compilation-cache DIR` shares one among the rows: faster starts, and row 7 then measures a warm cache), and stops
it with SIGTERM (killed after 70 s); the script prints how long each took to listen. Flags that only newer
checkouts know (`--header-timeout-s`) are passed only where the checkout's `train.py serve --help` lists them. All
traffic is on 127.0.0.1 (127.0.0.2 as the slow sockets' source address), a bounded number of requests and sockets,
each with a timeout.

Rows:
1. distinct option values: 40 sequential requests to /v1/translate, each with another `alpha` (0.5 + i/100), then 40
   with `rules: transformers` and another `repetition_penalty` (1 + (i+1)/100): latency p50/max and the statuses
   of each kind; the server's resident memory (psutil) before and after; the latency of a short plain request sent
   from another thread every 0.2 s meanwhile (p50/max, during each kind).
2. slow sockets: 64 sockets from 127.0.0.2, each sending part of a request header and then nothing, against
   `--max-connections 16` (and `--header-timeout-s 2` where known); a normal request from 127.0.0.1 0.5 s later
   (its status: 200, 503, or timeout after 4 s), how many of the 64 the server has closed 5 s after they sent,
   and a normal request then.
3. shutdown: 4 sockets that sent their headers (`Content-Length: 1000`) and 100 bytes of the body, then SIGTERM:
   seconds until the process exits (killed at 70 s), its exit status, the lines starting "Traceback" on its
   stderr, and what the 4 sockets got.
4. disconnects: 64 clients send their headers and half of the body, then close: "Traceback" lines on stderr after,
   and whether the server still answers.
5. deep JSON: a body `[[[...]]]` nested 100,000 deep (200 kB; `--max-request-bytes 1000000`): its status, and
   whether that is a 500.
6. a form body whose %-escapes are not UTF-8 (`q=%ff%fe&source=en&target=fr`): its status.
7. new options on a fresh server: latency of a plain request, of the first `{"rules": "transformers"}` request
   and of the same again, of the first `{"do_sample": true}` and of the same again.
8. a fresh server, 8 clients with a keep-alive connection each, 8 requests each per round (64 validation sentences
   spread over the lengths there are), 5 rounds: p50/p99 of the first round and of the last.
A row's failure is written in its cell; the other rows still run. The machine: benchmarks/machine.py.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import re
import select
import signal
import socket
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

from benchmarks.machine import machine_info  # noqa: E402

HOST = "127.0.0.1"
SLOW_SOURCE = "127.0.0.2"  # another loopback address: the slow sockets are told apart from the normal client
PLAIN = "one hundred and two"
STOP_WAIT_S = 70.0


def child_env(repo: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(repo))


def serve_flags(repo: Path) -> set[str]:
    """The flags `train.py serve --help` of `repo` lists."""
    found = subprocess.run([sys.executable, "train.py", "serve", "--help"], cwd=repo, env=child_env(repo),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    if found.returncode != 0:
        raise RuntimeError(f"train.py serve --help in {repo} failed: {found.stderr.strip()[-500:]}")
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", found.stdout))


def prepare(folder: Path) -> list[str]:
    """`saved_run` into folder/run (this checkout's tests package, in a child: this process loads no jax); the
    model's validation sentences."""
    code = (
        "import json, sys\nfrom pathlib import Path\nfrom tests.helpers.saved import load_saved_model, saved_run\n"
        "saved_run(Path(sys.argv[1]))\nprint(json.dumps(list(load_saved_model('trained_tiny').source_texts)))\n"
    )
    found = subprocess.run([sys.executable, "-c", code, str(folder / "run")], cwd=REPO, env=child_env(REPO),
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    if found.returncode != 0:
        raise RuntimeError(f"saved_run failed: {found.stderr.strip()[-2000:]}")
    return json.loads(found.stdout.strip().splitlines()[-1])


# =============================================================================================================
# The server and its clients
# =============================================================================================================


class Server:
    """`train.py serve --port 0` of a checkout in a child process; its stderr kept, its URL read from the line it
    prints once it listens."""

    starts: list[float] = []  # seconds from the start of each server until it listened

    def __init__(self, repo: Path, run: Path, flags: list[str], known: set[str], cache: str = "off") -> None:
        common = ["--checkpoint", str(run), "--step", "latest", "--port", "0"]
        if "--compilation-cache" in known:
            common += ["--compilation-cache", cache]
        began = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "train.py", "serve", *common, *flags], cwd=repo,
                                        env=child_env(repo), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, errors="replace")  # fmt: skip
        self.log: list[str] = []
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.port = None
        deadline = time.monotonic() + 300
        while self.port is None:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.kill()
                raise RuntimeError("serve did not start in 300 s: " + "".join(self.log)[-1000:]) from None
            if line.startswith("serving http://"):
                self.port = int(line.split()[1].rsplit(":", 1)[1])
                Server.starts.append(time.monotonic() - began)
            elif line == "":
                raise RuntimeError(f"serve exited ({self.process.wait()}): " + "".join(self.log)[-1000:])

    def _read(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put("")

    def tracebacks(self) -> int:
        return sum(line.startswith("Traceback") for line in self.log)

    def rss_mib(self) -> float:
        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def call(self, method: str, path: str, body=None, headers=None, timeout: float = 120.0):
        return call(self.port, method, path, body, headers, timeout)

    def answers(self) -> str:
        """Whether the server still translates: the status of a plain request (or why there is none)."""
        if self.process.poll() is not None:
            return f"no (exited {self.process.returncode})"
        status, _, seconds = self.call("POST", "/v1/translate", {"text": PLAIN}, timeout=60)
        return f"yes ({status}, {ms(seconds)})" if status == 200 else f"no ({status})"

    def stop(self) -> tuple[float, int | None]:
        """SIGTERM, then the process killed after STOP_WAIT_S: (seconds until it ended, exit status; None: killed)."""
        began = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            code = None
        seconds = time.monotonic() - began
        self.reader.join(10)
        return seconds, code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def call(port: int, method: str, path: str, body=None, headers=None, timeout: float = 120.0, connection=None):
    """(status or why there is none, answer's body, seconds) of one request; `body` a dict or list goes as JSON,
    bytes as they are. `connection`: a kept-alive http.client connection (else one of its own)."""
    own = connection is None
    connection = connection or http.client.HTTPConnection(HOST, port, timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    kind = {"Content-Type": "application/json"} if isinstance(body, (dict, list)) else {}
    began = time.perf_counter()
    try:
        connection.request(method, path, data, {**kind, **(headers or {})})
        response = connection.getresponse()
        answer = response.read()
        status: int | str = response.status
    except TimeoutError:
        status, answer = "timeout", b""
        connection.close()
    except (OSError, http.client.HTTPException) as e:
        status, answer = type(e).__name__, b""
        connection.close()
    finally:
        if own:
            connection.close()
    return status, answer, time.perf_counter() - began


def slow_socket(port: int, data: bytes, source: str = HOST) -> socket.socket:
    """A connected socket (from `source`) that has sent `data`."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect((HOST, port))
    sock.sendall(data)
    return sock


def peer_state(sock: socket.socket) -> str:
    """What the server did with a socket so far, without waiting: "open", "answered" (bytes, still open),
    "closed" (EOF or reset, after an answer or without), with the answer's status line where there is one."""
    got = b""
    state = "open"
    while True:
        ready, _, _ = select.select([sock], [], [], 0)
        if not ready:
            break
        try:
            chunk = sock.recv(65536)
        except OSError:
            state = "closed"
            break
        if not chunk:
            state = "closed"
            break
        got += chunk
    status = got.split(b"\r\n", 1)[0].decode("latin-1")[9:12] if got.startswith(b"HTTP/") else ""
    if state == "open" and got:
        state = "answered"
    return f"{state} {status}" if status else state


def ms(seconds: float) -> str:
    return f"{1000 * seconds:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def spread(seconds: list[float]) -> str:
    if not seconds:
        return "none"
    return f"p50 {ms(statistics.median(seconds))}, max {ms(max(seconds))}"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def counted(statuses) -> str:
    return " ".join(f"{status}×{n}" for status, n in Counter(map(str, statuses)).most_common())


# =============================================================================================================
# The rows
# =============================================================================================================


class Context:
    def __init__(self, repo: Path, run: Path, texts: list[str], known: set[str], cache: str) -> None:
        self.repo, self.run, self.texts, self.known, self.cache = repo, run, texts, known, cache

    def start(self, flags: list[str] = ()) -> Server:
        return Server(self.repo, self.run, list(flags), self.known, self.cache)

    def if_known(self, *flags: str) -> list[str]:
        """Each (flag, value) pair given whose flag the checkout's serve lists."""
        out = []
        for flag, value in zip(flags[::2], flags[1::2]):
            if flag in self.known:
                out += [flag, value]
        return out

    @contextlib.contextmanager
    def server(self, flags: list[str] = ()):
        server = self.start(flags)
        try:
            yield server
        finally:
            server.stop()


def distinct_options(ctx: Context) -> tuple[str, dict]:
    with ctx.server() as server:
        server.call("POST", "/v1/translate", {"text": PLAIN})
        before = server.rss_mib()
        stop, plain, phase = threading.Event(), [], ["alpha"]

        def probe() -> None:
            while not stop.is_set():
                during = phase[0]
                status, _, seconds = server.call("POST", "/v1/translate", {"text": "one"}, timeout=120)
                plain.append((during, status, seconds))
                stop.wait(0.2)

        kinds = {
            "alpha": [{"alpha": round(0.5 + i / 100, 4)} for i in range(40)],
            "repetition_penalty (rules transformers)": [
                {"rules": "transformers", "repetition_penalty": round(1.0 + (i + 1) / 100, 4)} for i in range(40)
            ],
        }
        thread = threading.Thread(target=probe, daemon=True)
        thread.start()
        found = {}
        try:
            for kind, options in kinds.items():
                phase[0] = kind
                found[kind] = [server.call("POST", "/v1/translate", {"text": PLAIN, "options": o}, timeout=120)
                               for o in options]  # fmt: skip
        finally:
            stop.set()
            thread.join(150)
        after = server.rss_mib()
    parts, figures = [], {"rss_mib": [round(before), round(after)]}
    for kind, results in found.items():
        seconds = [s for _, _, s in results]
        parts.append(f"{kind} ×40: {spread(seconds)}, {counted(r[0] for r in results)}")
        figures[kind] = {"seconds": seconds, "statuses": [r[0] for r in results]}
    parts.append(f"RSS {before:.0f} → {after:.0f} MiB")
    for kind in kinds:
        during = [(status, seconds) for k, status, seconds in plain if k == kind]
        seconds = [s for _, s in during]
        parts.append(f"a plain request sent meanwhile, during {kind.split()[0]} (n={len(during)}): {spread(seconds)}"
                     f", {counted(r[0] for r in during)}")  # fmt: skip
        figures[f"plain during {kind}"] = {"seconds": seconds, "statuses": [r[0] for r in during]}
    return "; ".join(parts), figures


def slow_sockets(ctx: Context) -> tuple[str, dict]:
    flags = ["--max-connections", "16", *ctx.if_known("--header-timeout-s", "2")]
    partial = b"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Le"
    with ctx.server(flags) as server:
        sockets, refused = [], 0
        began = time.monotonic()
        for _ in range(64):
            try:
                sockets.append(slow_socket(server.port, partial, SLOW_SOURCE))
            except OSError:
                refused += 1
        try:
            time.sleep(0.5)
            body = {"q": PLAIN, "source": "en", "target": "fr"}
            first, _, first_s = server.call("POST", "/translate", body, timeout=4)
            time.sleep(max(0.0, began + 5 - time.monotonic()))
            states = Counter(peer_state(s) for s in sockets)
            later, _, later_s = server.call("POST", "/translate", body, timeout=4)
        finally:
            for s in sockets:
                s.close()
        answers = server.answers()
    closed = sum(n for state, n in states.items() if state.startswith("closed"))
    cell = (
        f"flags {' '.join(flags)}; normal request at 0.5 s: {first} ({ms(first_s)}); after 5 s the server had closed "
        f"{closed}/{len(sockets)} ({counted(states.elements())}){f', {refused} refused' if refused else ''}; normal "
        f"request then: {later} ({ms(later_s)}); after: answers {answers}"
    )
    figures = {"first": first, "first_s": first_s, "closed_after_5s": closed, "states": dict(states), "then": later}
    return cell, figures


def shutdown(ctx: Context) -> tuple[str, dict]:
    head = (b"POST /v1/translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")  # fmt: skip
    server = ctx.start()
    sockets = []
    try:
        sockets = [slow_socket(server.port, head + b'{"text": "' + b"one " * 22 + b"on") for _ in range(4)]
        time.sleep(0.5)
    finally:
        seconds, code = server.stop()
        states = Counter(peer_state(s) for s in sockets)
        for s in sockets:
            s.close()
    ended = f"exited {code}" if code is not None else f"still running after {STOP_WAIT_S:.0f} s: killed"
    cell = (
        f"{ended} {seconds:.1f} s after SIGTERM; Traceback lines: {server.tracebacks()}; the 4 sockets: "
        f"{counted(states.elements())}"
    )
    return cell, {"seconds": seconds, "exit": code, "tracebacks": server.tracebacks(), "sockets": dict(states)}


def disconnects(ctx: Context) -> tuple[str, dict]:
    body = json.dumps({"q": "one hundred and two " * 10, "source": "en", "target": "fr"}).encode()
    head = (f"POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with ctx.server() as server:
        before = server.tracebacks()
        sockets = [slow_socket(server.port, head + body[: len(body) // 2]) for _ in range(64)]
        time.sleep(0.3)
        for s in sockets:
            s.close()
        time.sleep(2)
        tracebacks = server.tracebacks() - before
        answers = server.answers()
    return f"Traceback lines after: {tracebacks}; still answers: {answers}", {"tracebacks": tracebacks}


def deep_json(ctx: Context) -> tuple[str, dict]:
    depth = 100_000
    body = b"[" * depth + b"]" * depth
    with ctx.server(ctx.if_known("--max-request-bytes", "1000000")) as server:
        status, answer, seconds = server.call("POST", "/v1/translate", body, {"Content-Type": "application/json"})
        tracebacks = server.tracebacks()
        answers = server.answers()
    error = answer.decode("utf-8", "replace")[:90]
    cell = (
        f"{status} ({'a 500' if status == 500 else 'not a 500'}, {ms(seconds)}): {error}; Traceback lines: "
        f"{tracebacks}; still answers: {answers}"
    )
    return cell, {"status": status, "answer": error, "tracebacks": tracebacks}


def bad_form(ctx: Context) -> tuple[str, dict]:
    body = b"q=%ff%fe&source=en&target=fr"
    with ctx.server() as server:
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        status, answer, _ = server.call("POST", "/translate", body, headers)
    text = answer.decode("utf-8", "replace")[:90]
    return f"{status}: {text}", {"status": status, "answer": text}


def new_options(ctx: Context) -> tuple[str, dict]:
    asks = [
        ("plain", None),
        ("first rules transformers", {"rules": "transformers"}),
        ("again", {"rules": "transformers"}),
        ("first do_sample", {"do_sample": True}),
        ("again", {"do_sample": True}),
    ]
    with ctx.server() as server:
        found = []
        for name, options in asks:
            body = {"text": PLAIN, **({"options": options} if options else {})}
            status, _, seconds = server.call("POST", "/v1/translate", body, timeout=300)
            found.append((name, status, seconds))
    cell = ", ".join(f"{name} {ms(s)}" + ("" if status == 200 else f" ({status})") for name, status, s in found)
    return cell, {"requests": [{"name": n, "status": st, "seconds": s} for n, st, s in found]}


def rounds(ctx: Context) -> tuple[str, dict]:
    by_length = sorted(dict.fromkeys(ctx.texts), key=len)
    chosen = [by_length[i * (len(by_length) - 1) // 63] for i in range(64)]  # shortest to longest
    chosen = chosen[0::2] + chosen[1::2][::-1]  # each client gets short and long ones
    with ctx.server() as server:
        found = []
        for _ in range(5):
            latencies, statuses, lock = [], [], threading.Lock()

            def client(c: int) -> None:
                connection = http.client.HTTPConnection(HOST, server.port, timeout=300)
                for j in range(8):
                    body = {"q": chosen[c + 8 * j], "source": "en", "target": "fr"}
                    status, _, seconds = call(server.port, "POST", "/translate", body, connection=connection)
                    with lock:
                        latencies.append(seconds)
                        statuses.append(status)
                connection.close()

            threads = [threading.Thread(target=client, args=(c,)) for c in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            found.append((latencies, statuses))
    first, last = found[0][0], found[-1][0]
    errors = sum(s != 200 for _, statuses in found for s in statuses)
    cell = (
        f"round 1: p99 {ms(percentile(first, 0.99))} (p50 {ms(statistics.median(first))}); round 5: p99 "
        f"{ms(percentile(last, 0.99))} (p50 {ms(statistics.median(last))}); non-200: {errors}/{64 * len(found)}"
    )
    return cell, {"rounds": [{"seconds": lat, "statuses": st} for lat, st in found]}


ROWS = {
    1: ("distinct option values (40 + 40)", distinct_options),
    2: ("64 slow sockets, --max-connections 16", slow_sockets),
    3: ("SIGTERM with 4 half-sent bodies", shutdown),
    4: ("64 clients close mid-body", disconnects),
    5: ("JSON nested 100,000 deep", deep_json),
    6: ("form with invalid UTF-8 escapes", bad_form),
    7: ("first requests of new options", new_options),
    8: ("8 clients of mixed lengths, 5 rounds", rounds),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose train.py serve to start")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="which rows, e.g. 1,3 (default all)")
    parser.add_argument("--json", type=Path, help="also write the table here")
    parser.add_argument(
        "--compilation-cache",
        default="off",
        metavar="DIR",
        help="serve's --compilation-cache (default off: each row compiles what it causes; a folder "
        "shared by the rows starts the servers faster, and row 7 then measures a warm cache)",
    )
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    try:
        wanted = [int(x) for x in args.rows.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: expected numbers such as 1,3")
    unknown = [n for n in wanted if n not in ROWS]
    if unknown:
        parser.error(f"--rows: no row {unknown[0]} (there are {', '.join(map(str, ROWS))})")
    known = serve_flags(repo)
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        texts = prepare(Path(tmp))
        cache = args.compilation_cache
        if cache != "off":
            cache = str(Path(cache).resolve())
        ctx = Context(repo, Path(tmp) / "run", texts, known, cache)
        for n in wanted:
            name, row = ROWS[n]
            began, starts = time.monotonic(), len(Server.starts)
            try:
                cell, figures = row(ctx)
            except Exception as e:  # noqa: BLE001 (a row's failure is its result; the others still run)
                cell, figures = f"error: {type(e).__name__}: {e}"[:400], {}
            seconds = time.monotonic() - began
            start_s = [round(s, 1) for s in Server.starts[starts:]]
            print(f"row {n} ({name}): {seconds:.0f} s, the server listening after {start_s} s", file=sys.stderr,
                  flush=True)  # fmt: skip
            results.append({"row": n, "name": name, "result": cell, "seconds": round(seconds, 1),
                            "server_start_s": start_s, "figures": figures})  # fmt: skip
    info = machine_info()
    print(f"machine: {json.dumps(info)}")
    starts = ", ".join(f"{s:.0f}" for s in Server.starts)
    new = ", ".join(f for f in ("--header-timeout-s",) if f in known) or "none"
    cache = cache if "--compilation-cache" in known else "(not a flag there)"
    print(f"serve of {repo} ({commit or 'no git'}); new flags known: {new}; --compilation-cache {cache}")
    print(f"its servers listened after: {starts} s")
    print("| # | attack | result |\n|---|---|---|")
    for r in results:
        cell = " ".join(r["result"].split()).replace("|", "/")
        print(f"| {r['row']} | {r['name']} | {cell} |")
    if args.json:
        report = {"machine": info, "repo": str(repo), "commit": commit, "compilation_cache": ctx.cache, "rows": results}
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
