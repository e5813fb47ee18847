"""`serve` against clients that would take it down, each attack bounded and on loopback: requests of distinct option
values (no compilation after ready, by jax's compile events; resident memory flat), sockets that send a partial
head or body (closed, and they cannot hold the connection slots of other clients), a client leaving mid-body (one
quiet line), deeply nested JSON, a form that is not UTF-8, per-client limits (429 with Retry-After), and a SIGTERM
with slow clients connected (every accepted request answered, exit within 10 s, no traceback)."""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_serve import SENTENCES, Server

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.slow  # (servers in child processes)


def resident_mib(pid: int) -> float:
    """The process's resident memory (Linux's /proc: VmRSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.helpers.saved import saved_run

    return saved_run(tmp_path_factory.mktemp("guard") / "run")


@pytest.fixture(scope="module")
def options_server(run):
    """transformers' rules with a repetition penalty allowed: its value, alpha and min_length are run-time. (Greedy
    and a small budget: few programs; tests/test_serve_programs.py covers every path of larger batches.)"""
    found = Server(["--checkpoint", str(run), "--step", "latest", "--rules", "transformers", "--beam-size", "1",
                    "--max-tokens", "32", "--allow", "repetition_penalty=1.3"])  # fmt: skip
    yield found
    assert found.stop() == 0, "".join(found.log)


def test_distinct_option_values_compile_nothing_and_leave_memory_flat(options_server):
    server = options_server

    def ask(i: int):
        options = {"alpha": 0.5 + i / 97, "repetition_penalty": 1.0 + (i % 7) / 10, "min_length": i % 3}
        sentences = SENTENCES[i % 5 : i % 5 + 1 + i % 4]  # 1 to 4 sentences of mixed lengths
        return server.request("/v1/translate", {"text": " ".join(sentences), "options": options})

    with ThreadPoolExecutor(4) as pool:  # a first round: the allocator settles
        assert {status for status, _ in pool.map(ask, range(20))} == {200}
    before = resident_mib(server.process.pid)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20, 220)))  # 200 requests, each option value new
    assert {status for status, _ in answers} == {200}
    grown = resident_mib(server.process.pid) - before
    status, health = server.request("/health", method="GET")
    assert status == 200 and health["programs_compiled_at_start"] > 0
    assert health["compilations_after_ready"] == 0
    assert grown < 50, f"resident memory grew by {grown:.0f} MiB over 200 requests"
    status, answer = server.request("/v1/translate", {"text": "one", "options": {"no_repeat_ngram_size": 3}})
    assert status == 400 and answer["error"].startswith("options.no_repeat_ngram_size 3: this service does not run")
    # /metrics: Prometheus' text format, open as /health is.
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    assert 'jt_requests_total{route="/v1/translate",status="200"} 220.0' in text
    assert "jt_compilations_after_ready 0.0" in text and 'jt_queue_sentences{model="default"}' in text
    lines = [json.loads(line) for line in server.log if line.startswith('{"id"')]
    assert {"id", "route", "status", "sentences", "ms"} <= set(lines[-1]) and "text" not in lines[-1]


@pytest.fixture(scope="module")
def guarded(run):
    found = Server(["--checkpoint", str(run), "--step", "latest", "--beam-size", "1", "--max-tokens", "32",
                    "--max-connections", "16", "--header-timeout-s", "2", "--body-timeout-s", "2",
                    "--req-limit", "30", "--char-limit", "400"])  # fmt: skip
    yield found
    found.stop()


def _connect(server: Server, source: str = "127.0.0.1") -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.settimeout(20)
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    return sock


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (waits up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _all_of(sock: socket.socket) -> bytes:
    """What the server sends until it closes the connection (its head and body may come in separate packets)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _request(server: Server, body: dict) -> tuple[int, dict]:
    return server.request("/translate", {"source": "en", "target": "fr", **body})


def test_slow_sockets_do_not_deny_service(guarded):
    """64 sockets from another address each send half a request head: those past its share of the slots (a quarter
    of --max-connections) are closed at once, the rest once --header-timeout-s passes, and a client from 127.0.0.1
    is answered all the while."""
    slow = [_connect(guarded, "127.0.0.2") for _ in range(64)]
    for sock in slow:
        try:
            sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-")
        except OSError:  # (closed at once, as it should be)
            pass
    status, answer = _request(guarded, {"q": SENTENCES[0]})
    assert status == 200, answer
    assert all(_closed(sock) for sock in slow)  # within the 20 s each socket waits at most: 2 s expected
    # A body that does not arrive in time: 408, the connection closed.
    sock = _connect(guarded)
    sock.sendall(
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    )
    answer = _all_of(sock)
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in answer
    for sock in slow:
        sock.close()


def test_a_client_leaving_mid_body_is_one_quiet_line(guarded):
    before = len(guarded.log)
    for _ in range(8):
        sock = _connect(guarded)
        sock.sendall(
            b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 90\r\n\r\n"
        )
        sock.sendall(b'{"q": "one')
        sock.close()
    status, _ = _request(guarded, {"q": SENTENCES[1]})  # answered after them: their lines are written by now
    assert status == 200
    for _ in range(200):  # (the log is read in a thread; bounded wait for its lines)
        left = [line for line in guarded.log[before:] if "left before its body arrived" in line]
        if len(left) == 8:
            break
        time.sleep(0.05)
    assert len(left) == 8 and not any("Traceback" in line for line in guarded.log[before:])


def test_malformed_bodies_get_a_400_naming_the_fault(guarded):
    deep = b"[" * 100_000 + b"]" * 100_000
    status, answer = guarded.request("/translate", deep[:8000], headers={"Content-Type": "application/json"})
    assert status in (400, 413), answer  # (the default body limit is 1 MB: nesting is refused, not a 500)
    nested = json.dumps({"q": "one", "source": "en", "target": "fr"}).encode()[:-1] + b', "x": ' + deep[:3000]
    status, answer = guarded.request("/translate", nested, headers={"Content-Type": "application/json"})
    assert status == 400 and "not valid JSON" in answer["error"]
    status, answer = guarded.request("/translate", b"q=%ff%fe&source=en&target=fr")
    assert status == 400 and "field 'q' is not UTF-8" in answer["error"]
    status, answer = guarded.request("/translate", b"q=un%C3%A9&source=en&target=fr")  # UTF-8: translated
    assert status == 200


def test_per_client_limits_answer_429_with_retry_after(guarded):
    status, answer = _request(guarded, {"q": "x" * 401})
    assert status == 400 and "exceeds text limit (400)" in answer["error"]
    seen = [_request(guarded, {"q": "one", "api_key": "client-a"})[0] for _ in range(31)]
    assert seen[:30] == [200] * 30 and seen[30] == 429
    import urllib.error
    import urllib.request

    request = urllib.request.Request(guarded.url + "/translate", data=json.dumps(
        {"q": "one", "source": "en", "target": "fr", "api_key": "client-a"}).encode(),
        headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 429 and 1 <= int(refused.value.headers["Retry-After"]) <= 60
    assert _request(guarded, {"q": "one", "api_key": "client-b"})[0] == 200  # another client: its own count


def test_sigterm_with_slow_clients_exits_within_10_s(run):
    """4 clients whose bodies have not arrived and one whose request is being decoded: SIGTERM answers the
    accepted one, drops the 4 (503), and the process exits 0 within 10 s, with no traceback. (The service samples:
    its seed and temperature are arguments of its programs; the same request draws the same again.)"""
    server = Server(["--checkpoint", str(run), "--step", "latest", "--do-sample", "--max-tokens", "32"])
    try:
        sample = {"text": SENTENCES[1], "options": {"temperature": 0.7, "sample_seed": 3}}
        first, again = server.request("/v1/translate", sample), server.request("/v1/translate", sample)
        assert first[0] == 200 and "sampling" in first[1]["decoding"]
        assert first[1]["translations"] == again[1]["translations"]
        partial = []
        for _ in range(4):
            sock = _connect(server)
            sock.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"q\": \"one")  # fmt: skip
            partial.append(sock)
        status, _ = _request(server, {"q": SENTENCES[2]})
        assert status == 200
        began = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=10) == 0, "".join(server.log)
        assert time.monotonic() - began < 10
        for sock in partial:
            assert _all_of(sock).startswith(b"HTTP/1.1 503")
        assert not any("Traceback" in line for line in server.log), "".join(server.log)
    finally:
        server.stop()


def test_constraints_need_a_service_started_with_their_size(options_server):
    """A service without --constraint-size compiled no constrained program: a request's constraints are refused,
    naming the field, before anything is decoded."""
    status, answer = options_server.request("/v1/translate", {"text": SENTENCES[0], "constraints": ["cent"]})
    assert status == 400 and answer["error"].startswith("constraints: this service takes none"), answer
