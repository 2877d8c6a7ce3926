"""The server against hostile clients (loopback only, bounded): stop strings that were quadratic, input that was a
500, DNS rebinding and foreign origins, what a client without the key may learn, and HTTP details.

Each test fails without its fix. A keyless server and a keyed one run in background threads of this process.
"""

from __future__ import annotations

import json
import time
import socket

import httpx
import pytest
import torch

from speculate.server import ServerConfig, create_app, load_models
from speculate.server.background import BackgroundServer
from speculate.server.guard import HostGuard, hostname, is_loopback
from speculate.server.schemas import MAX_STOP, MAX_STOP_CHARS
from speculate.text import Detokenizer, held_back
from speculate.spec import SpeculativeSpec

pytestmark = pytest.mark.filterwarnings("ignore:.*loaded on another thread:RuntimeWarning")

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(tiny_folders, **options):
    config = ServerConfig(model=str(tiny_folders[0]), spec=SpeculativeSpec(k=3), **options)
    target, draft = load_models(config)
    server = BackgroundServer(create_app(config, target, draft))
    server.model, server.target = config.model, target
    return server


@pytest.fixture(scope="module")
def keyless(tiny_folders):
    server = start(tiny_folders, allowed_hosts=("speculate.internal",))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tiny_folders):
    server = start(tiny_folders, api_keys=(KEY,))
    yield server
    server.stop()


def complete(server, body, headers=None, **kw):
    return httpx.post(server.url + "/v1/completions", json={"model": server.model, **body},
                      headers={**AUTH, **(headers or {})}, timeout=60, **kw)


def raw(server, request: bytes) -> bytes:
    """One raw HTTP/1.1 exchange (for headers httpx would not send)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


# ------------------------------------------------------------------------------------------------ stop strings
class CountingStr(str):
    """A stop string that counts how much of it the detokenizer reads: every slice and comparison of it."""
    reads = 0

    def __getitem__(self, key):
        CountingStr.reads += 1
        return super().__getitem__(key)

    def startswith(self, *args):
        CountingStr.reads += 1
        return super().startswith(*args)


def test_the_stop_check_reads_a_long_stop_string_a_bounded_number_of_times_per_token(keyless):
    """The hold-back check tried every prefix length of every stop string after every token (quadratic: 60 s for a
    500,000-character stop string); now it reads it a few times per token, whatever its length."""
    tok = keyless.target.tokenizer
    stop = CountingStr("x" * 20000 + "!")
    detok = Detokenizer(tok, [stop])
    CountingStr.reads = 0
    ids = tok("hello there, x x xx xxx the end")["input_ids"]
    for token in ids:
        detok.add(token)
    assert CountingStr.reads <= 8 * len(ids), CountingStr.reads  # before: ~20,000 a token


@pytest.mark.parametrize("seed", range(30))
def test_held_back_is_the_longest_tail_that_starts_a_stop_string(seed):
    import random

    rng = random.Random(seed)
    text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 12)))
    stop = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 6)))
    end = len(text)
    brute = max((n for n in range(1, len(stop)) if text[:end].endswith(stop[:n])), default=0)
    assert held_back(text, end, stop) == brute, (text, stop)


def test_stop_sequences_are_capped(keyless):
    r = complete(keyless, {"prompt": "hi", "max_tokens": 2, "stop": "x" * 500000})
    assert r.status_code == 400 and str(MAX_STOP_CHARS) in r.json()["error"]["message"]
    r = complete(keyless, {"prompt": "hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOP + 1)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert complete(keyless, {"prompt": "hi", "max_tokens": 2, "stop": ["a" * MAX_STOP_CHARS] * MAX_STOP,
                              "temperature": 0}).status_code == 200


# ------------------------------------------------------------------------------------------------ no 500s
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "a\ud800b"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}], "stream": True}),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}),
])
def test_a_lone_surrogate_is_a_400(keyless, path, body):
    # json.dumps escapes the surrogate as "\ud800", as a hostile client would send it.
    r = httpx.post(keyless.url + path, content=json.dumps({"model": keyless.model, "max_tokens": 3, **body}),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.parametrize("settings", [{"temperature": 5e-324}, {"temperature": 1e-45}, {"temperature": 1e-300},
                                      {"temperature": 1.0, "top_p": 1e-300}])
def test_tiny_temperatures_and_top_p_behave_as_their_limit_greedy(keyless, settings):
    greedy = complete(keyless, {"prompt": "one two one two", "max_tokens": 8, "temperature": 0})
    r = complete(keyless, {"prompt": "one two one two", "max_tokens": 8, "seed": 3, **settings})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# ------------------------------------------------------------------------------------------------ rebinding
def test_a_loopback_server_answers_only_loopback_and_allowed_host_names(keyless):
    port = keyless.url.rsplit(":", 1)[1]
    body = json.dumps({"model": keyless.model, "prompt": "hi", "max_tokens": 1}).encode()

    def post(host, origin=None):
        extra = f"Origin: {origin}\r\n" if origin else ""
        return raw(keyless, (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body)

    assert post(f"attacker.example:{port}", f"http://attacker.example:{port}").startswith(b"HTTP/1.1 400")
    assert b"invalid_host" in post(f"attacker.example:{port}")
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"speculate.internal:{port}"):
        assert post(host).startswith(b"HTTP/1.1 200"), host
    # A foreign Origin on a keyless server, even with a good Host (a page POSTing cross-site), is refused.
    refused = post(f"127.0.0.1:{port}", "http://attacker.example")
    assert refused.startswith(b"HTTP/1.1 403") and b"forbidden_origin" in refused
    assert post(f"127.0.0.1:{port}", "null").startswith(b"HTTP/1.1 403")
    assert post(f"127.0.0.1:{port}", f"http://localhost:{port}").startswith(b"HTTP/1.1 200")


def test_host_rules():
    assert is_loopback("127.3.4.5") and is_loopback("[::1]") and is_loopback("localhost.") and is_loopback("a.localhost")
    assert not is_loopback("attacker.example") and not is_loopback("10.0.0.1") and not is_loopback("127.0.0.1.nip.io")
    assert hostname("[::1]:8000") == "::1" and hostname("example.com:80") == "example.com" and hostname("::1") == "::1"
    open_bind = HostGuard(None, "0.0.0.0")
    assert open_bind.allowed_host("anything.example")  # an open bind without a list serves any name
    listed = HostGuard(None, "0.0.0.0", ("api.example",))
    assert listed.allowed_host("api.example") and not listed.allowed_host("other.example")


# ------------------------------------------------------------------------------------------------ disclosure
def test_a_client_without_the_key_learns_neither_paths_nor_routes(keyed):
    h = httpx.get(keyed.url + "/health")
    assert h.status_code == 200 and h.json()["model"] == "seed0" and "/" not in h.text
    for path in ("/v1/nope", "/v1/models/x/y"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(keyed.url + "/v1/nope", headers=AUTH).status_code == 404
    r = complete(keyed, {"prompt": "hi", "model": "other"})
    assert r.status_code == 404 and keyed.model not in r.text


# ------------------------------------------------------------------------------------------------ HTTP details
def test_http_details(keyed):
    assert httpx.head(keyed.url + "/health").status_code == 200
    assert httpx.head(keyed.url + "/v1/models", headers=AUTH).status_code == 200
    r = httpx.post(keyed.url + "/v1/completions/", headers=AUTH, json={})  # no redirect built from Host
    assert r.status_code == 404 and "location" not in r.headers
    for seed in (-1, 2**64 - 1):
        r = complete(keyed, {"prompt": "hi", "max_tokens": 2, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    body = json.dumps({"model": keyed.model, "prompt": "hi", "max_tokens": 2}).encode("utf-16")
    r = httpx.post(keyed.url + "/v1/completions", content=body,
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


# ------------------------------------------------------------------------------------------------ slow clients
@pytest.fixture(scope="module")
def strict(tiny_folders):
    """A server with short limits, so that slow clients are dropped within a test's patience."""
    server = start(tiny_folders, header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.6, max_connections=6,
                   max_connections_per_client=0)  # (the global cap alone: every test socket has one address)
    yield server
    server.stop()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, if it closed within ``seconds`` (None if it did not)."""
    import time

    s.settimeout(0.2)
    data, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


@pytest.mark.parametrize("send", [b"", b"GET /hea", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"])
def test_a_request_that_never_completes_its_headers_is_dropped(strict, send):
    s = connect(strict)
    s.sendall(send)
    assert closed_within(s, 5) is not None  # before: held open for good
    s.close()


def test_headers_sent_a_byte_at_a_time_are_dropped_at_the_deadline(strict):
    import time

    s = connect(strict)
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    start, dropped = time.monotonic(), False
    for byte in request:
        try:
            s.sendall(bytes([byte]))
        except OSError:
            dropped = True
            break
        time.sleep(0.05)
        if time.monotonic() - start > 3:
            break
    dropped = dropped or closed_within(s, 2) is not None
    assert dropped and time.monotonic() - start < 5
    s.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_that_stops_arriving_is_a_408(strict, chunked):
    s = connect(strict)
    framing = b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":" if chunked else b"Content-Length: 100\r\n\r\n{\"mo"
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + framing)
    answer = closed_within(s, 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    s.close()


def test_open_connections_are_capped_and_the_server_stays_up(strict):
    idle = [connect(strict) for _ in range(6)]
    extra = connect(strict)
    # past the cap the connection idle the longest is closed at once, not the new one
    assert closed_within(idle[0], 2) is not None and closed_within(extra, 0.3) is None
    for s in idle + [extra]:
        s.close()
    from speculate.server.background import wait_healthy

    # the slots free as the sockets close
    assert wait_healthy(strict.url, 10, interval=0.1), "the server did not answer after the idle connections closed"


def connect_from(server, address: str) -> socket.socket:
    """A connection from another loopback address (all of 127/8 is this machine): another client to the server."""
    host, port = server.url.removeprefix("http://").split(":")
    s = socket.socket()
    s.settimeout(10)
    s.bind((address, 0))
    s.connect((host, int(port)))
    return s


def test_one_address_cannot_take_the_whole_connection_cap(tiny_folders):
    """Before: one client holding idle sockets (reopening any that drop) filled the cap, and the idle-first rule
    then closed other clients' connections in turn. Now an address past its own limit loses its own idle ones."""
    server = start(tiny_folders, header_timeout=30.0, max_connections=6, max_connections_per_client=3)
    held = []
    try:
        a = [connect_from(server, "127.0.0.1") for _ in range(3)]
        a.append(connect_from(server, "127.0.0.1"))  # its 4th: its own oldest idle connection goes
        assert closed_within(a[0], 2) is not None and closed_within(a[3], 0.3) is None
        b = [connect_from(server, "127.0.0.2") for _ in range(3)]  # another client: its 3, nobody closed
        held = a + b
        assert [closed_within(s, 0.2) for s in a[1:] + b] == [None] * 6
        c = connect_from(server, "127.0.0.3")  # a third, past the global cap (6): the longest idle goes, not it
        held.append(c)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        answer = closed_within(c, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 200"), answer
        assert closed_within(a[1], 1) is not None  # the longest idle of all: the first client's oldest
    finally:
        for s in held:
            s.close()
        server.stop()


# ------------------------------------------------------------------------------------------------ stopping
def test_a_stop_lets_running_work_end_cleanly_and_answers_the_queue_503(tiny_folders, monkeypatch):
    """On a stop (SIGTERM/Ctrl-C set should_exit, as here): a queued request gets 503 at once, a running stream gets
    the grace period, then an error event and [DONE]; nothing is cut mid-body; new requests are refused."""
    import threading
    import time

    from speculate.engine import Run

    real = Run.take

    def slow(self, logits):  # 20 rounds a second: still running when the stop comes
        time.sleep(0.05)
        return real(self, logits)

    monkeypatch.setattr(Run, "take", slow)
    server = start(tiny_folders, max_batch=1, max_queue=4, shutdown_grace=0.8)
    events, queued = [], {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": server.model, "prompt": "one two", "max_tokens": 400, "stream": True,
                                "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])

    def waiting():
        r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        queued["status"], queued["body"] = r.status_code, r.json()

    a = threading.Thread(target=stream)
    a.start()
    deadline = time.monotonic() + 20
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    b = threading.Thread(target=waiting)
    b.start()
    time.sleep(0.3)  # B is queued behind A
    stop_at = time.monotonic()
    server.server.should_exit = True
    b.join(10)
    a.join(20)
    server.thread.join(20)
    assert queued["status"] == 503 and queued["body"]["error"]["code"] == "shutting_down"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down"
    pieces = [e for e in events[:-2] if "choices" in e]
    assert len(pieces) > 3  # it went on during the grace period
    assert time.monotonic() - stop_at < 10 and not server.thread.is_alive()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)
    server.sock.close()


# ------------------------------------------------------------------------------------------------ model folders
def test_a_damaged_local_model_folder_is_one_clear_error(tiny_folders, tmp_path, capsys):
    """A truncated weights file is one line, not a SafetensorError traceback; a folder with our manifest.json is
    checked against it (flipped bytes of the same size included)."""
    import shutil

    from speculate.cli import main
    from speculate.errors import SpeculateError
    from speculate.models.cache import write_manifest
    from speculate.models.loader import load_model

    truncated = shutil.copytree(tiny_folders[0], tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpeculateError, match="cannot load a model"):
        load_model(str(truncated))
    capsys.readouterr()
    assert main(["generate", "hi", "--model", str(truncated), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speculate: error: cannot load a model"), err

    listed = shutil.copytree(tiny_folders[0], tmp_path / "listed")
    write_manifest(listed)
    load_model(str(listed))  # intact: loads
    data = bytearray((listed / "model.safetensors").read_bytes())
    data[len(data) // 2: len(data) // 2 + 4096] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 4096])
    (listed / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(SpeculateError, match="do not match its manifest.json"):
        load_model(str(listed))


def test_a_request_framed_twice_is_refused_and_the_connection_closed(keyless):
    """Content-Length and Transfer-Encoding together (RFC 9112 §6.3): a 400 and a closed connection, so that a
    request smuggled after the body (as a proxy reading Content-Length would pass it on) is never answered."""
    body = b'{"model": "x"}'
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(chunked + smuggled)) + chunked + smuggled
    answer = raw(keyless, request)
    assert answer.startswith(b"HTTP/1.1 400") and answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    assert b"connection: close" in answer.lower()


def test_idle_sockets_held_by_one_client_do_not_lock_others_out(tiny_folders):
    """A client holding every connection open and idle (reopening any that drop) made /health fail 77 times of 77:
    the cap closed each new connection. Now the longest-idle one goes instead, and the other requests are served."""
    import threading

    server = start(tiny_folders, header_timeout=30.0, max_connections=8)
    held, stop = [], threading.Event()

    def hold():
        while not stop.is_set():
            for s in [s for s in held if closed_within(s, 0) is not None]:
                held.remove(s)
            while len(held) < 8 and not stop.is_set():
                held.append(connect(server))
            stop.wait(0.05)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        import time

        time.sleep(0.5)  # the cap is full of idle sockets
        answered = 0
        for _ in range(10):
            try:
                answered += httpx.get(server.url + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                pass
        assert answered == 10
    finally:
        stop.set()
        holder.join(5)
        for s in held:
            s.close()
        server.stop()


def test_a_low_open_file_limit_caps_connections_without_a_log_flood(tiny_folders, tmp_path):
    """At `ulimit -n 256`, 300 connections gave 1,995 "Too many open files" tracebacks from the accept loop. The cap
    now stays below the limit (the server says so, once), and an accept that still fails is one line per 10 s."""
    import resource
    import subprocess
    import sys
    import time

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "speculate", "serve", "--model", str(tiny_folders[0]), "--port",
                             str(port), "--header-timeout", "30", "--max-connections", "1000"], stdout=log, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
    url, sockets = f"http://127.0.0.1:{port}", []
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            time.sleep(0.2)
        for _ in range(300):
            try:
                sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                pass
        time.sleep(2)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        for s in sockets:
            s.close()
        proc.terminate()
        proc.wait(30)
    text = (tmp_path / "server.log").read_text()
    assert text.count("Too many open files") <= 1 and "Traceback" not in text, text[-3000:]
    assert text.count("--max-connections 1000 lowered to 192") == 1  # (256 open files, less 64 for the rest)


def test_max_tokens_caps_a_request_and_defaults_a_chat(tiny_folders):
    """A chat without max_tokens ran to the end of the context window (8,126 tokens on the default model, a place in
    the batch for ~90 s): --max-tokens is its default and every request's limit."""
    server = start(tiny_folders, max_tokens=5)
    try:
        chat = {"model": server.model, "messages": [{"role": "user", "content": "abc abc abc"}], "temperature": 0}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5, r.text
        assert r.json()["usage"]["completion_tokens"] == 5 or r.json()["choices"][0]["finish_reason"] == "stop"
        over = httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": server.model, "prompt": "abc", "max_tokens": 6})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        assert "--max-tokens" in over.json()["error"]["message"]
        # a completion that names no max_tokens gets OpenAI's 16 within the cap, not a 400 (schemathesis found it)
        r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "abc abc abc",
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 5, r.text
        assert r.json()["usage"]["completion_tokens"] == 5 or r.json()["choices"][0]["finish_reason"] == "stop"
        # and the schema says so: the cap is the new-token fields' maximum
        schema = httpx.get(server.url + "/openapi.json", timeout=60).json()["components"]["schemas"]
        max_tokens = schema["CompletionRequest"]["properties"]["max_tokens"]
        assert [k.get("maximum") for k in max_tokens["anyOf"]] == [5, None] and max_tokens["default"] == 5
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------ long prompts
def test_a_short_request_is_not_starved_by_long_prompts(tiny):
    """Issue 42, point 8: two 600-token prompts and then a 10-token one, all waiting when the generation thread
    starts, 2 places in the batch. Before, both long prompts took the places and the short request waited for one
    of them to finish; now at most one long prompt prefills at a time (max_batch // 2), the short one is admitted
    past the other, and the prompts share a budget of 32 prompt tokens a round, the shortest first."""
    import threading

    from speculate import SamplingParams, SpeculativeDecoder
    from speculate.server.scheduler import Job, Scheduler

    events, lock = [], threading.Lock()

    class Recorded(Job):
        def __init__(self, name, ids, max_new):
            decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("none", verifier="greedy"))
            super().__init__(lambda: (decoder.start(ids, SamplingParams(max_new_tokens=max_new, temperature=0),
                                                    prefill_chunk=16), lambda: None), loop=None,
                             prompt_tokens=len(ids))
            self.name = name

        def emit(self, kind, value=None):
            with lock:
                events.append((self.name, kind))

    sched = Scheduler(max_batch=2, max_queue=8, prefill_chunk=16, prefill_budget=32)
    rows = []
    sched.on_round = lambda n, r, seconds: rows.append(r)
    jobs = [Recorded("long1", [3 + i % 200 for i in range(600)], 2), Recorded("long2", [5 + i % 190 for i in range(600)], 2),
            Recorded("short", list(range(7, 17)), 4)]
    sched.submit(*jobs)
    sched.start()
    try:
        deadline = time.monotonic() + 120
        while sum(kind == "done" for _, kind in events) < 3:
            assert time.monotonic() < deadline and not any(kind == "error" for _, kind in events), events
            time.sleep(0.01)
    finally:
        sched.stop()
    done = [name for name, kind in events if kind == "done"]
    assert done[0] == "short", done
    assert max(rows) <= 32 + 2, max(rows)  # the budget, and one decode row for each of 2 places


# ------------------------------------------------------------------------------------------------ KV memory
def test_admission_by_kv_memory(tiny):
    """--kv-memory: with room for the KV of two requests at once, four requests in a batch of four run two at a time
    (never more reserved than the budget), first come first served, and all four finish with plain decoding's tokens."""
    import threading

    from speculate import SamplingParams, SpeculativeDecoder
    from speculate.server.scheduler import Job, Scheduler

    events, lock = [], threading.Lock()
    params = SamplingParams(max_new_tokens=6, temperature=0)
    prompts = [[3 + i, 4, 5, 6, 7 + i] for i in range(4)]
    plain = [SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(p, params).token_ids for p in prompts]

    class Recorded(Job):
        def __init__(self, name, ids):
            decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="greedy", k=3))
            super().__init__(lambda: (decoder.start(ids, params), lambda: None), loop=None, prompt_tokens=len(ids),
                             kv_bytes=100)
            self.name = name

        def emit(self, kind, value=None):
            with lock:
                events.append((self.name, kind, value))

    sched = Scheduler(max_batch=4, max_queue=8, kv_budget=250)
    most = []
    sched.on_round = lambda n, rows, seconds: most.append((n, sched.kv_reserved))
    jobs = [Recorded(f"r{i}", p) for i, p in enumerate(prompts)]
    assert not sched.too_large(jobs[0]) and sched.too_large(Job(lambda: None, None, kv_bytes=251))
    sched.submit(*jobs)
    sched.start()
    try:
        deadline = time.monotonic() + 60
        while sum(kind == "done" for _, kind, _ in events) < 4:
            assert time.monotonic() < deadline and not any(kind == "error" for _, kind, _ in events), events
            time.sleep(0.01)
    finally:
        sched.stop()
    assert max(n for n, _ in most) == 2 and max(r for _, r in most) == 200  # two at a time: 200 of 250 bytes
    assert [name for name, kind, _ in events if kind == "ready"] == ["r0", "r1", "r2", "r3"]
    assert sched.kv_reserved == 0  # all returned
    done = {name: value.generation.token_ids for name, kind, value in events if kind == "done"}
    assert [done[f"r{i}"] for i in range(4)] == plain


def test_a_request_that_never_fits_the_kv_memory_is_refused(tiny_folders):
    """A request whose prompt and max tokens alone exceed --kv-memory gets a 400 naming the flag, before it queues;
    a smaller one is answered; the budget and the reserved bytes are in /metrics."""
    from speculate.models import load_model
    from speculate.models.kv import position_bytes

    per_token = position_bytes(load_model(str(tiny_folders[0]), dtype="auto"))
    gib = (5 + 40 + 65) * per_token / 2**30  # room for a 5-token prompt and 40 new tokens, with the draft's slack
    server = start(tiny_folders, max_tokens=0, kv_memory_gib=gib)
    try:
        body = {"model": server.model, "prompt": [3, 4, 5, 6, 7], "temperature": 0}
        big = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 41}, timeout=60)
        assert big.status_code == 400 and big.json()["error"]["code"] == "kv_memory_exceeded", big.text
        assert "--kv-memory" in big.json()["error"]["message"]
        ok = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 40}, timeout=60)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert f"speculate_kv_budget_bytes {float(int(gib * 2**30))}" in metrics
        assert "speculate_kv_reserved_bytes 0.0" in metrics
    finally:
        server.stop()


def test_requests_past_the_kv_memory_are_preempted_and_answer_as_alone(tiny_folders):
    """Four concurrent greedy requests at int8 whose caches together need more than --kv-memory: each joins on its
    prompt and a first stretch, the youngest is preempted where another stretch does not fit, and resumes; every
    answer is plain decoding's alone, and /metrics counts the preemptions."""
    from concurrent.futures import ThreadPoolExecutor

    from speculate import SpeculativeDecoder
    from speculate.models import load_model
    from speculate.models.kv import position_bytes
    from speculate.server.scheduler import STRETCH

    target = load_model(str(tiny_folders[0]), dtype="int8")
    prompts = [[3 + i, 4, 5, 6, 7 + i] for i in range(4)]
    plain = [SpeculativeDecoder(target, SpeculativeSpec("none")).generate(p, max_new_tokens=400) for p in prompts]
    assert all(len(gen.token_ids) == 400 for gen in plain)  # (no early end: every answer grows past its first stretch)
    per_token = position_bytes(target)
    first = -(-(5 + STRETCH) // 64) * 64  # a first stretch, in the cache's 64-position blocks
    gib = (4 * first + STRETCH) * per_token / 2**30  # four first stretches and one more: not four whole answers
    server = start(tiny_folders, dtype="int8", max_tokens=0, kv_memory_gib=gib)
    try:
        def ask(prompt):
            body = {"model": server.model, "prompt": prompt, "temperature": 0, "max_tokens": 400}
            out = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert out.status_code == 200, out.text
            return out.json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(ask, prompts))
        assert texts == [gen.text for gen in plain]
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        preempted = [float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("speculate_preemptions_total ")]
        assert preempted and preempted[0] >= 1, metrics
        assert "speculate_kv_reserved_bytes 0.0" in metrics
    finally:
        server.stop()


@pytest.mark.parametrize("dtype", ["fp32", "int8", "q4"])
def test_a_positions_kv_bytes_are_what_the_cache_allocates(tiny_folders, dtype):
    """--kv-memory counts a token as models/kv.position_bytes: the bytes per position of the cache KVModel builds."""
    from speculate.models import load_model
    from speculate.models.kv import KVModel, position_bytes

    loaded = load_model(str(tiny_folders[2 if dtype == "q4" else 0]), dtype=dtype)
    kv = KVModel(loaded)
    kv.reset(300)
    kv.forward(torch.tensor([3, 4, 5]))
    positions = kv.capacity if hasattr(kv, "capacity") else kv.length
    assert kv.nbytes == position_bytes(loaded) * positions


def test_a_runs_held_bytes_count_a_draft_models_cache_however_it_is_held(tiny):
    """The scheduler counts a running request's target cache and its draft model's (scheduler._held): held by the
    drafter itself (model) or by the drafter it wraps (model+lookup)."""
    from speculate import SpeculativeDecoder
    from speculate.engine import step
    from speculate.server.scheduler import _held

    for name in ("model", "model+lookup"):
        d = SpeculativeDecoder(tiny[0], SpeculativeSpec(name, k=3), draft_model=tiny[0])
        run = d.start([3, 4, 5, 3, 4], max_new_tokens=6)
        step([run])
        draft = run.drafter.kv if name == "model" else run.drafter.drafter.kv
        assert draft.nbytes > 0 and _held(run) == run.kv.nbytes + draft.nbytes, name