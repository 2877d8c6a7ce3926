"""``speculate serve --ray``: the same app behind Ray Serve, on a local Ray instance on loopback.

Every answer is compared with the plain server's answer to the same request (greedy: exact text), both replicas
must have served, a replica killed mid-load must be replaced without losing a request that had not begun its
answer, and requests that share a long prefix must land where that prefix is cached.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import serve_subprocess, torch_threads

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from speculate.server.ray_serve import (  # noqa: E402
    APP_NAME, BLOCK_CHARS, HTTPCall, RayOptions, build, prefix_keys, prompt_text, start_ray)
from speculate.server.background import BackgroundServer, free_port  # noqa: E402
from speculate.server.config import ServerConfig  # noqa: E402
from speculate.server.main import build_app  # noqa: E402
from speculate.spec import SpeculativeSpec  # noqa: E402

KEY = "sk-ray-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEMS = [f"You are assistant number {i}. " + " ".join(f"rule {i}.{j}: answer in plain words." for j in range(24))
           for i in range(4)]


def _chat(model: str, system: str, question: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, **extra}


# --- pure parts, no Ray instance --------------------------------------------------------------------------------
def test_prefix_keys_name_shared_leading_blocks_only():
    a = "x" * (BLOCK_CHARS * 3) + "tail a"
    b = "x" * (BLOCK_CHARS * 2) + "y" * BLOCK_CHARS
    ka, kb = prefix_keys(a), prefix_keys(b)
    assert len(ka) == 3 and len(kb) == 3  # whole blocks only: "tail a" makes none
    assert ka[:2] == kb[:2] and ka[2] != kb[2]
    assert prefix_keys("x" * (BLOCK_CHARS - 1)) == ()
    assert len(set(ka)) == 3  # a chain: equal blocks at different depths are different keys


def test_prompt_text_reads_chats_and_completions_and_tolerates_anything():
    chat = json.dumps(_chat("m", "sys", "hi")).encode()
    assert prompt_text(chat) == "system\nsys\nuser\nhi\n"
    parts = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"x": 1}]}]})
    assert prompt_text(parts.encode()) == "user\na\n"
    assert prompt_text(b'{"prompt": "abc"}') == "abc"
    assert prompt_text(b'{"prompt": ["first", "second"]}') == "first"
    assert prompt_text(b'{"prompt": [1, 2, 3]}') == "[1, 2, 3]"
    for junk in (b"", b"not json", b"[1]", b'{"messages": 3}', b'{"prompt": null}', b"[" * 100000):
        assert prompt_text(junk) == ""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "extra": object()}
    call = HTTPCall.of(scope, chat)
    assert "extra" not in call.scope and call.scope["path"] == "/v1/chat/completions" and call.body == chat


@pytest.mark.parametrize("bad, message", [
    (dict(replicas=0), "--replicas"), (dict(replica_threads=0), "--replica-threads"),
    (dict(min_replicas=1), "go together"), (dict(min_replicas=3, max_replicas=2), "min-replicas"),
    (dict(target_ongoing=0), "--target-ongoing"), (dict(router="nearest"), "--router")])
def test_ray_options_are_checked_once(bad, message):
    from speculate.errors import SpeculateError

    with pytest.raises(SpeculateError, match=message):
        RayOptions(**bad)


def test_the_serve_config_builder_parses_as_the_command_line_does(tiny_folders):
    from speculate.errors import SpeculateError
    from speculate.serve_ray import app

    assert app({"model": str(tiny_folders[0]), "replicas": 3, "max_batch": 2, "no_prefix_cache": True}) is not None
    with pytest.raises(SpeculateError, match="--replicas"):
        app({"model": str(tiny_folders[0]), "replicas": 0})
    with pytest.raises(SpeculateError, match="unrecognized arguments: --replica-count"):
        app({"model": str(tiny_folders[0]), "replica_count": 2})
    with pytest.raises(SpeculateError, match="--max-batch must be >= 1"):
        app({"model": str(tiny_folders[0]), "max-batch": 0})


# --- the command, as a user runs it (its own local Ray instance) -------------------------------------------------
def test_serve_ray_command_answers_and_stops_cleanly_on_sigterm(tiny_folders):
    with serve_subprocess(["--ray", "--model", str(tiny_folders[0]), "--replicas", "1", "--shutdown-grace", "1"],
                          dict(os.environ), seconds=120) as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"model": str(tiny_folders[0]), "prompt": "hello",
                                                      "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert r.headers["x-speculate-replica"]
        # a stream running when the stop comes ends cleanly: its whole answer, or (past --shutdown-grace) the
        # plain server's shutting_down error event; then [DONE], not a cut connection
        first, streamed = threading.Event(), {}
        body = {"model": str(tiny_folders[0]), "messages": [{"role": "user", "content": "count"}],
                "max_tokens": 900, "temperature": 0}
        stream = threading.Thread(target=_stream_chat, args=(url, body, first, streamed, {}))
        stream.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        stream.join(90)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert streamed["events"][-1] == "[DONE]", (streamed["events"][-3:], out[-3000:])
    last = json.loads(streamed["events"][-2])
    assert ("error" in last and last["error"]["code"] == "shutting_down"
            or last["choices"][0]["finish_reason"] == "length"), last


def test_serve_ray_without_ray_address_refuses_a_taken_port(tiny_folders):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = subprocess.run([sys.executable, "-m", "speculate", "serve", "--ray", "--model", str(tiny_folders[0]),
                               "--port", str(busy.getsockname()[1])], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("speculate: error: cannot listen on"), done.stderr


def test_serve_ray_refuses_an_unknown_model_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "speculate", "serve", "--ray", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("speculate: error: unknown model") and done.stderr.count("\n") == 1, done.stderr


def test_bench_sharded_over_ray_reproduces_the_single_process_run(tmp_path, tiny_folders):
    """Two Ray workers, each a shard of the samples: the same records, token for token (quality and calls), as one
    process; every pair timed by one worker; a speed line per worker; a rerun resumes (generates nothing)."""
    from speculate.bench.methods import engine_method
    from speculate.bench.records import read_records
    from speculate.bench.runner import BenchConfig, run_bench
    from speculate.bench.sharded import run_sharded

    method = engine_method("lookup", "greedy", 3)
    cfg = dict(model=str(tiny_folders[0]), methods=[method], datasets=["copy"], limit=6, max_new_tokens=12,
               calibrate=False)
    with torch_threads(1):  # as each worker runs (fp32: a row's last bits may follow the thread count)
        one = run_bench(BenchConfig(out=tmp_path / "one", **cfg), progress=False)
    sharded = run_sharded(BenchConfig(out=tmp_path / "ray", **cfg), None, workers=2)

    def tokens(folder):
        return {(r["method"], r["id"]): [t["token_ids"] for t in r["turns"]] for r in read_records(folder / "samples.jsonl")}

    assert tokens(sharded) == tokens(one) and len(tokens(one)) == 12
    records = read_records(sharded / "samples.jsonl")
    starts = {r["started"] for r in records}
    assert len(starts) == 2 and all(s.endswith(("shard 1/2", "shard 2/2")) for s in starts)
    for r in records:  # every method of a sample timed by the worker that ran it
        assert {o["started"] for o in records if o["id"] == r["id"]} == {r["started"]}
    summary = (sharded / "summary.md").read_text()
    assert "## Speed per worker" in summary and "shards/1-of-2" in summary and "shards/2-of-2" in summary
    rows = {(r["method"], r["dataset"]): r for r in json.loads((sharded / "summary.json").read_text())}
    assert rows[method.name, "copy"]["identical_to_plain"] == "6/6"
    before = (sharded / "samples.jsonl").read_text()
    run_sharded(BenchConfig(out=tmp_path / "ray", **cfg), None, workers=2)  # resumed: nothing left to run
    assert (sharded / "samples.jsonl").read_text() == before


# --- one local Ray instance for the rest ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_url():
    start_ray(RayOptions(replicas=2))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _deploy(config: ServerConfig, options: RayOptions) -> None:
    serve.run(build(config, options), name=APP_NAME, route_prefix="/")


def _plain_answers(config: ServerConfig, bodies: list[dict]) -> list[str]:
    server = BackgroundServer(build_app(config))  # (as `speculate serve` builds it: loaded on its thread)
    try:
        return [httpx.post(server.url + "/v1/chat/completions", json=b, headers=AUTH, timeout=120)
                .json()["choices"][0]["message"]["content"] for b in bodies]
    finally:
        server.stop()


def _post_all(url: str, bodies: list[dict], concurrency: int = 8) -> list[httpx.Response]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda b: httpx.post(url + "/v1/chat/completions", json=b, headers=AUTH, timeout=120),
                             bodies))


@pytest.mark.parametrize("model", ["tiny", "default"])
def test_two_replicas_answer_exactly_as_the_plain_server(ray_url, tiny_folders, model):
    name = str(tiny_folders[0]) if model == "tiny" else "smollm2-135m-instruct"
    config = ServerConfig(model=name, api_keys=(KEY,), max_batch=4, spec=SpeculativeSpec(k=3))
    bodies = [_chat(name, "Be brief.", f"Question {i}: name a colour and a number.", max_tokens=12) for i in range(16)]
    expected = _plain_answers(config, bodies)
    _deploy(config, RayOptions(replicas=2, router="default"))
    responses = _post_all(ray_url, bodies)
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == expected
    assert len({r.headers["x-speculate-replica"] for r in responses}) == 2  # both replicas served
    # the same app behind the hop: its streaming, its errors, its API key, the front's body limit
    with httpx.stream("POST", ray_url + "/v1/chat/completions", json={**bodies[0], "stream": True}, headers=AUTH,
                      timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == expected[0]
    bad = httpx.post(ray_url + "/v1/chat/completions", json={**bodies[0], "temperature": -1}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert httpx.post(ray_url + "/v1/chat/completions", json=bodies[0]).status_code == 401
    big = httpx.post(ray_url + "/v1/chat/completions", content=b"x" * (config.max_body_bytes + 1), headers=AUTH)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert httpx.get(ray_url + "/health").json()["status"] == "ok"


def _affinity_hits(url: str, router: str, tiny_folders) -> float:
    """Share of requests, after one warm-up request per system prompt, whose whole system prompt was cached.
    (--max-batch 8 for 8 clients: affinity yields to load only past --max-batch requests of imbalance, and the
    warm-ups may put all 4 prompts on one replica.)"""
    config = ServerConfig(model=str(tiny_folders[0]), api_keys=(KEY,), max_batch=8, spec=SpeculativeSpec(k=3))
    _deploy(config, RayOptions(replicas=2, router=router))
    for system in SYSTEMS:
        assert _post_all(url, [_chat(config.model, system, "warm up")])[0].status_code == 200
    bodies = [_chat(config.model, SYSTEMS[i % len(SYSTEMS)], f"question {i}") for i in range(24)]
    responses = _post_all(url, bodies)
    assert all(r.status_code == 200 for r in responses)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
    return sum(c >= len(SYSTEMS[0]) - 32 for c in cached) / len(cached)  # (one byte a token: the system prompt)


def test_affinity_routing_sends_a_shared_prefix_where_it_is_cached(ray_url, tiny_folders):
    hits = _affinity_hits(ray_url, "affinity", tiny_folders)
    assert hits >= 0.9, hits
    baseline = _affinity_hits(ray_url, "default", tiny_folders)
    assert baseline < hits, (baseline, hits)  # Ray's default router: where the two replicas happen to fall


def _stream_chat(url: str, body: dict, first: threading.Event, out: dict, headers: dict = AUTH) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        out["replica"] = r.headers.get("x-speculate-replica")
        out["events"] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                first.set()


def _replica_actor(replica: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith("#" + replica):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no replica actor named {replica}")


def test_a_killed_replica_is_replaced_and_no_unbegun_request_is_lost(ray_url, tiny_folders):
    config = ServerConfig(model=str(tiny_folders[0]), api_keys=(KEY,), max_batch=8, spec=SpeculativeSpec(k=3))
    bodies = [_chat(config.model, "Be brief.", f"item {i}", max_tokens=48) for i in range(8)]
    expected = _plain_answers(config, bodies)
    from speculate.serve_ray import app  # (as `serve run speculate.serve_ray:app` deploys it)

    serve.run(app({"model": config.model, "api_key": KEY, "max_batch": 8, "k": 3, "router": "default"}),
              name=APP_NAME, route_prefix="/")
    # a stream that has begun on the replica to be killed, and whole answers in flight on both
    first, streamed = threading.Event(), {}
    slow = _chat(config.model, "Be brief.", "count", max_tokens=900)
    stream = threading.Thread(target=_stream_chat, args=(ray_url, slow, first, streamed))
    stream.start()
    assert first.wait(60)
    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(httpx.post, ray_url + "/v1/chat/completions", json=b, headers=AUTH, timeout=120)
                   for b in bodies]
        ray.kill(_replica_actor(streamed["replica"]), no_restart=True)
        responses = [f.result() for f in pending]
    stream.join(60)
    # not begun: sent again, to the other replica; every one answered, exactly
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == expected
    # begun: ended with a clear error event, then [DONE]
    assert streamed["events"][-1] == "[DONE]"
    assert json.loads(streamed["events"][-2])["error"]["code"] == "replica_failed", streamed["events"][-3:]
    # Ray starts a new replica; then both serve again
    deadline = time.monotonic() + 90
    while True:
        names = {r.headers["x-speculate-replica"] for r in _post_all(ray_url, bodies[:6])}
        if len(names) == 2 and streamed["replica"] not in names:
            break
        assert time.monotonic() < deadline, names
        time.sleep(1)
