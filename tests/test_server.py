"""`speculate serve`: a real uvicorn server on a loopback port, driven by the real `openai` client and httpx.

Servers run in a background thread of this process (so a test can monkeypatch the engine under them),
except one test that starts `speculate serve` as a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculate.engine import Run
from speculate.errors import SpeculateError
from speculate import SpeculativeDecoder
from speculate.cli import _parser, main
from speculate.models.fast import FastKVModel
from speculate.models.kv import HFKVModel
from speculate.server import ServerConfig, create_app, load_models
from speculate.server.background import BackgroundServer
from speculate.server.errors import APIError
from speculate.spec import SpeculativeSpec

from conftest import serve_subprocess

# The shared server's models are loaded on this thread and generate on the server's generation thread, which the
# engine warns about (several threads running torch: models/loader.py check_thread); expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.*loaded on another thread:RuntimeWarning")

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello hello hello"}]


class Served(BackgroundServer):
    """The shared background server, with the model id and target the tests compare against."""


@pytest.fixture(scope="module")
def served(tiny_folders):
    config = ServerConfig(model=str(tiny_folders[0]), api_keys=(KEY,), max_batch=4, max_queue=64, spec=SpeculativeSpec(k=3))
    target, draft = load_models(config)
    s = Served(create_app(config, target, draft))
    s.model, s.target = config.model, target
    yield s
    s.stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def scrape(url) -> dict:
    metrics = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            metrics[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return metrics


def metric(m, name, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def post(served, path, body, **kw):
    return httpx.post(served.url + path, json=body, headers=kw.pop("headers", AUTH), timeout=kw.pop("timeout", 60),
                      **kw)


def read_sse(response) -> tuple[str, list[dict]]:
    """(concatenated text, every JSON event) of an SSE response; asserts it ends with [DONE]."""
    events, done = [], False
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        events.append(json.loads(data))
    assert done, "the stream did not end with data: [DONE]"
    text = ""
    for e in events:
        for c in e.get("choices", []):
            text += c["delta"].get("content") or "" if "delta" in c else c["text"]
    return text, events


def wait_idle(url, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if metric(m, "speculate_requests_in_flight") == 0 and metric(m, "speculate_requests_queued") == 0:
            return m
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------------
def test_health_models_and_auth(served):
    h = httpx.get(served.url + "/health")
    assert h.status_code == 200 and h.json() == {"status": "ok", "model": os.path.basename(served.model)}  # no path
    models = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [served.model]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(served.url + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0).completions.create(
            model=served.model, prompt="hi", max_tokens=2)


def test_the_benchmarks_chat_client_rebuilds_a_streamed_answer_as_the_whole_one(served, client):
    """bench/client.py, which serve_load and shared_prefix time the server with: a streamed answer read back is the
    whole answer's text and usage, with a first-text time and one gap between each two text chunks."""
    from speculate.bench.client import chat, percentile

    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    with httpx.Client(headers=AUTH) as http:
        whole, _ = chat(http, served.url, body)
        streamed, seconds = chat(http, served.url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"] != ""
    assert streamed["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    chunks = [c for c in client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24,
                                                        temperature=0, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(streamed["gaps"]) == len(chunks) - 1 and 0 < streamed["ttft"] <= seconds
    # the nearest-rank rule: the smallest value with at least the share at or below it
    assert [percentile(range(1, 21), 0.95), percentile(range(1, 101), 0.95), percentile([4, 1], 0.5)] == [19, 95, 1]
    assert percentile([], 0.95) is None


def test_openai_client_streamed_text_equals_whole_text(served, client):
    whole = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    bare = list(client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=24,
                                               temperature=0, stream=True))
    # usage as OpenAI sends it: once, in a last chunk without choices, and only when asked for
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True] and chunks[-1].choices == []
    assert all(c.usage is None for c in bare) and bare[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(chunks[-1].usage, n) for n in counts] == [getattr(whole.usage, n) for n in counts]
    # The same prompt again: all of it but its last token (fed with the first draft) came from the store.
    cached = chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == whole.usage.prompt_tokens - 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stats = whole.to_dict()["speculative_stats"]
    again = bare[-1].to_dict()["speculative_stats"]
    timings = ("wall_seconds", "prefill_seconds", "tokens_per_second", "target_seconds", "draft_seconds",
               "first_draft_seconds")
    assert stats == {**again, **{key: stats[key] for key in timings}, "reused_prompt_tokens": stats["reused_prompt_tokens"]}
    assert again["reused_prompt_tokens"] == cached  # (the stats and usage say the same)
    assert stats["new_tokens"] == whole.usage.completion_tokens
    assert stats["drafter"] == "lookup" and stats["verifier"] == "greedy" and stats["k"] == 3

    prompt = "the cat sat on the mat, the cat sat on the"
    t_whole = client.completions.create(model=served.model, prompt=prompt, max_tokens=20, temperature=0)
    t_chunks = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=20, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert t_whole.choices[0].text and "".join(c.choices[0].text for c in t_chunks if c.choices) == \
        t_whole.choices[0].text
    assert t_whole.usage.completion_tokens == 20 and t_whole.choices[0].finish_reason == "length"
    assert t_whole.usage.prompt_tokens == len(prompt.encode())  # the tiny tokenizer: one token per byte
    assert t_chunks[-1].choices == [] and t_chunks[-1].usage.completion_tokens == 20  # include_usage
    assert t_chunks[-2].choices[0].finish_reason == "length"
    assert t_chunks[-2].to_dict()["speculative_stats"]["new_tokens"] == 20


def test_greedy_output_equals_the_engine(served, client, tiny):
    prompt = "abc abc abc abc"
    for spec in ({"drafter": "lookup", "k": 4}, {"drafter": "none"}, {"drafter": "lookup", "verifier": "consultant",
                                                                       "eps": 2.0, "beta": 0.2, "k": 2}):
        r = client.completions.create(model=served.model, prompt=prompt, max_tokens=30, temperature=0,
                                      extra_body={"speculative": spec})
        params = {key: spec[key] for key in ("eps", "beta") if key in spec}
        settings = SpeculativeSpec(spec["drafter"], verifier=spec.get("verifier", "greedy"), params=params,
                                   k=spec.get("k", 3))
        engine = SpeculativeDecoder(tiny[0], settings).generate(prompt, max_new_tokens=30, chat=False)
        assert r.choices[0].text == engine.text, spec
        assert r.usage.completion_tokens == len(engine.token_ids)
        stats = r.to_dict()["speculative_stats"]
        assert stats["target_calls"] == engine.stats.target_calls
        assert stats["acceptance_by_position"] == engine.stats.to_dict()["acceptance_by_position"]

    chat = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=25, temperature=0)
    engine = SpeculativeDecoder(tiny[0],
                                SpeculativeSpec("lookup", verifier="greedy", k=3)).generate(MESSAGES, max_new_tokens=25)
    assert chat.choices[0].message.content == engine.text
    # top_k (an extension, as vLLM's): at top_k = 1 sampling at temperature 1 can only take the argmax.
    sampled = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=25, temperature=1.0,
                                             seed=3, extra_body={"top_k": 1})
    assert sampled.choices[0].message.content == engine.text
    for off in (-1, None, 0):  # how vLLM's and llama.cpp's clients say "no top-k"
        r = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=5, temperature=0,
                                           extra_body={"top_k": off})
        assert r.choices[0].message.content == engine.text[:len(r.choices[0].message.content)]
    assert chat.usage.prompt_tokens == engine.prompt_tokens

    # stop: the server stops where the engine does
    full = SpeculativeDecoder(tiny[0],
                              SpeculativeSpec("lookup", verifier="greedy",
                                              k=3)).generate(prompt, max_new_tokens=30, chat=False)
    stop = full.text[6:8]
    engine = SpeculativeDecoder(tiny[0],
                                SpeculativeSpec("lookup", verifier="greedy",
                                                k=3)).generate(prompt, max_new_tokens=30, chat=False,
                                                                           stop=[stop])
    r = client.completions.create(model=served.model, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == engine.text == full.text[:full.text.index(stop)]
    assert r.choices[0].finish_reason == "stop"

    # seed, temperature and top_p are honoured: the seeded sample equals the engine's
    engine = SpeculativeDecoder(tiny[0],
                                SpeculativeSpec("lookup", k=3)).generate(prompt, max_new_tokens=30, temperature=0.8,
                                                                       top_p=0.9, seed=11, chat=False)
    r = client.completions.create(model=served.model, prompt=prompt, max_tokens=30, temperature=0.8, top_p=0.9,
                                  seed=11)
    assert r.choices[0].text == engine.text and r.to_dict()["speculative_stats"]["verifier"] == "sample"


BAD = [  # (body for /v1/completions unless "path" is given, status, param, code)
    ({"prompt": "hi"}, 400, "model", "missing_required_parameter"),
    ({"model": "M", "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "invalid_value"),
    ({"model": "M", "prompt": 5}, 400, "prompt", "invalid_value"),
    ({"model": "M", "prompt": "hi", "stream": "yes"}, 400, "stream", "invalid_value"),
    ({"model": "M", "prompt": "hi", "temperature": "hot"}, 400, "temperature", "invalid_value"),
    ({"model": "other-model", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": "M", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"model": "M", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": "M", "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "invalid_value"),
    ({"model": "M", "prompt": "hi", "temperature": -0.1}, 400, "temperature", "invalid_value"),
    ({"model": "M", "prompt": "hi", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"model": "M", "prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": "M", "prompt": "hi", "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"model": "M", "prompt": "hi", "n": 0}, 400, "n", "invalid_value"),
    ({"model": "M", "prompt": ["a", "b"], "n": 33}, 400, "n", "invalid_value"),  # 66 choices > MAX_CHOICES
    ({"model": "M", "prompt": "x" * 1100}, 400, "prompt", "context_length_exceeded"),
    ({"model": "M", "prompt": "x" * 1000, "max_tokens": 100}, 400, "prompt", "context_length_exceeded"),
    ({"model": "M", "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": "M", "prompt": [999999]}, 400, "prompt", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"foo": 1}}, 400, "speculative.foo", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"drafter": "magic"}}, 400, "speculative.drafter", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"k": 0}}, 400, "speculative.k", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"k": "6"}}, 400, "speculative.k", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"k": "fast"}}, 400, "speculative.k", "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"verifier": "greedy", "eps": "auto"}}, 400, "speculative",
     "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"verifier": "consultant", "eps": -1}}, 400, "speculative",
     "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"verifier": "greedy", "tol": 1}}, 400, "speculative",
     "invalid_value"),
    # Settings the engine refuses are found on the generation thread (generation.open_run): a stream still gets the 400.
    ({"model": "M", "prompt": "hi", "stream": True, "speculative": {"verifier": "consultant", "eps": -1}}, 400,
     "speculative", "invalid_value"),
    ({"model": "M", "prompt": "hi", "stream": True, "temperature": 0.7, "speculative": {"verifier": "greedy"}}, 400,
     None, "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": {"drafter": "model"}}, 400, "speculative", "invalid_value"),
    ({"model": "M", "prompt": "hi", "temperature": 0.7, "speculative": {"verifier": "greedy"}}, 400, None,
     "invalid_value"),
    ({"model": "M", "prompt": "hi", "speculative": "fast"}, 400, "speculative", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M"}, 400, "messages", "missing_required_parameter"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": "hi"}, 400, "messages", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": []}, 400, "messages", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": [{"role": "user"}]}, 400, "messages.0.content",
     "missing_required_parameter"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": [{"role": "user", "content": "x" * 1100}]}, 400,
     "messages", "context_length_exceeded"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES, "max_completion_tokens": 5000}, 400,
     "max_completion_tokens", "invalid_value"),
    # What the engine cannot honour is refused, not ignored:
    ({"model": "M", "prompt": "hi", "suffix": "bye"}, 400, "suffix", "unsupported_parameter"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES, "response_format": {"type": "yaml"}},
     400, "response_format", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     400, "response_format", "invalid_value"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES, "tool_choice": "required"}, 400,
     "tool_choice", "unsupported_parameter"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES, "functions": [{"name": "f"}]}, 400,
     "functions", "unsupported_parameter"),
    ({"path": "/v1/chat/completions", "model": "M", "messages": MESSAGES, "modalities": ["text", "audio"]}, 400,
     "modalities", "unsupported_parameter"),
]


def test_bad_inputs_get_4xx_with_an_openai_error_object(served):
    before = scrape(served.url)
    for case in BAD:
        body, status, param, code = case
        body = {k: (served.model if v == "M" and k == "model" else v) for k, v in body.items()}
        path = body.pop("path", "/v1/completions")
        r = post(served, path, body)
        assert r.status_code == status, (case, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], case
        assert (err["param"], err["code"]) == (param, code), (case, err)
        assert err["type"] == "invalid_request_error"

    raw = [  # (raw body, headers, status, code)
        (b"{not json", {}, 400, "invalid_json"),
        (b"[1, 2]", {}, 400, "invalid_json"),
        (b"", {}, 400, "invalid_json"),
        (b"\xff\xfe", {}, 400, "invalid_json"),
        (b'{"model": ' + b"[" * 100000 + b"]" * 100000 + b"}", {}, 400, "invalid_json"),  # nested too deeply
        (json.dumps({"model": served.model, "prompt": "y" * (1 << 20)}).encode(), {}, 413, "request_too_large"),
        (b'{"model": "x", "prompt": "hi"}', {"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
        (b'{"model": "x", "prompt": "hi"}', {"Authorization": ""}, 401, "invalid_api_key"),
    ]
    for content, headers, status, code in raw:
        r = httpx.post(served.url + "/v1/completions", content=content,
                       headers={**AUTH, "Content-Type": "application/json", **headers}, timeout=30)
        assert r.status_code == status, (content[:40], r.text)
        assert r.json()["error"]["code"] == code

    def chunked():  # an oversized body without Content-Length
        for _ in range(20):
            yield b"x" * 65536

    r = httpx.post(served.url + "/v1/completions", content=chunked(), timeout=30,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    for content_type in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = httpx.post(served.url + "/v1/completions", headers={**AUTH, **content_type},
                       content=json.dumps({"model": served.model, "prompt": "hi"}).encode())
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"

    r = httpx.get(served.url + "/v1/nope", headers=AUTH)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(served.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"

    after = scrape(served.url)  # every mistake was counted by its status, none as a 500, and the server serves on

    def delta(status):
        return sum(metric(after, "speculate_requests_total", endpoint=e, status=status) -
                   metric(before, "speculate_requests_total", endpoint=e, status=status)
                   for e in ("/v1/completions", "/v1/chat/completions", "/v1/models", "other"))

    assert delta("400") == sum(1 for _, s, _, _ in BAD if s == 400) + 5
    assert (delta("401"), delta("404"), delta("405"), delta("413"), delta("415"), delta("500")) == (2, 2, 1, 2, 3, 0)
    assert httpx.get(served.url + "/health").status_code == 200
    ok = post(served, "/v1/completions", {"model": served.model, "prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3  # greedy: no early EOS to draw


def test_a_seed_follows_one_rule_on_the_command_line_and_in_a_request(served, capsys):
    """sampling.check_seed for both: a negative seed (the same draws as its 2^64 complement) or one of 2^63 and more
    is a 400 in a request and one line, exit 2, from `speculate generate` (before its model loads); 0 and 2^63 - 1
    are taken by both."""
    from speculate.sampling import check_seed

    for seed in (-1, 2**63):
        with pytest.raises(ValueError) as refused:
            check_seed(seed)
        r = post(served, "/v1/completions", {"model": served.model, "prompt": "hi", "max_tokens": 2, "seed": seed,
                                             "temperature": 0.7})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"seed: {refused.value}", r.text
        assert main(["generate", "hi", "--model", served.model, "--seed", str(seed), "--temperature", "0.7"]) == 2
        assert capsys.readouterr().err.strip() == f"speculate: error: {refused.value}"
    for seed in (0, 2**63 - 1):
        r = post(served, "/v1/completions", {"model": served.model, "prompt": "hi", "max_tokens": 2, "seed": seed,
                                             "temperature": 0.7})
        assert r.status_code == 200, r.text
        assert main(["generate", "hi", "--model", served.model, "--seed", str(seed), "--temperature", "0.7",
                     "--max-new-tokens", "2"]) == 0
    capsys.readouterr()


def test_metrics_add_up(served):
    before = scrape(served.url)
    usages, stats = [], []
    for i in range(3):
        r = post(served, "/v1/completions", {"model": served.model, "prompt": f"{i} abc abc abc", "max_tokens": 12,
                                             "temperature": 0, "speculative": {"k": 2 + i}})
        usages.append(r.json()["usage"])
        stats.append(r.json()["speculative_stats"])
    for i in range(2):
        with httpx.stream("POST", served.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"model": served.model, "messages": MESSAGES, "max_tokens": 9 + i, "stream": True,
                                "temperature": 0, "stream_options": {"include_usage": True}}) as r:
            _, events = read_sse(r)
        usages.append(events[-1]["usage"])
        stats.append(events[-2]["speculative_stats"])
    after = wait_idle(served.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("speculate_generated_tokens_total") == sum(u["completion_tokens"] for u in usages) == 12 * 3 + 9 + 10
    assert delta("speculate_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("speculate_target_forward_passes_total") == sum(s["target_calls"] for s in stats)
    assert delta("speculate_drafted_tokens_total") == sum(s["drafted_tokens"] for s in stats)
    assert delta("speculate_accepted_tokens_total") == sum(s["accepted_draft_tokens"] for s in stats)
    assert delta("speculate_peeked_rounds_total") == sum(s["peeked_rounds"] for s in stats)
    assert delta("speculate_peek_hits_total") == sum(s["peek_hits"] for s in stats)
    by_position = sum(delta("speculate_accepted_tokens_by_position_total", position=str(p)) for p in range(1, 7))
    assert by_position == delta("speculate_accepted_tokens_total")
    assert delta("speculate_drafted_tokens_by_position_total", position="1") > 0
    assert delta("speculate_requests_total", endpoint="/v1/completions", status="200") == 3
    assert delta("speculate_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert delta("speculate_time_to_first_token_seconds_count") == 5
    assert delta("speculate_request_latency_seconds_count") == 5
    assert delta("speculate_request_latency_seconds_sum") > 0
    tokens = metric(after, "speculate_generated_tokens_total")
    calls = metric(after, "speculate_target_forward_passes_total")
    assert metric(after, "speculate_mean_accepted_length") == pytest.approx(tokens / calls)
    # An fp32 target runs through the kernel's F32 layers: batched verification is exact, in each answer's statistics
    # and in /metrics.
    assert {s["exactness"] for s in stats} == {"batched"}
    assert [metric(after, "speculate_exactness", mode=m) for m in ("batched", "row-by-row", "none")] == [1, 0, 0]


def test_load_many_clients_lose_nothing(served):
    prompts = ["one two one two", "abc abc abc", "the the the", "xyz"]
    kinds = [("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", False),
             ("/v1/chat/completions", True)]

    def body(prompt, path, stream):
        b = {"model": served.model, "max_tokens": 6, "temperature": 0, "stream": stream}
        if path == "/v1/completions":
            return {**b, "prompt": prompt}
        return {**b, "messages": [{"role": "user", "content": prompt}]}

    def ask(http, prompt, path, stream):
        """(status list, text) of one request, retrying on 429."""
        statuses = []
        while True:
            if stream:
                with http.stream("POST", path, json=body(prompt, path, stream)) as r:
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        return statuses, read_sse(r)[0]
                    r.read()
            else:
                r = http.post(path, json=body(prompt, path, stream))
                statuses.append(r.status_code)
                if r.status_code == 200:
                    c = r.json()["choices"][0]
                    return statuses, c["text"] if "text" in c else c["message"]["content"]
            assert r.status_code == 429, r.text
            time.sleep(0.05)

    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as http:
        expected = {(p, path): ask(http, p, path, False)[1] for p in prompts for path, _ in kinds}

    def client_run(c):
        results = []
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=120) as http:
            for i in range(25):
                prompt, (path, stream) = prompts[(c + i) % 4], kinds[(c * 7 + i) % 4]
                results.append((prompt, path, *ask(http, prompt, path, stream)))
        return results

    before = scrape(served.url)
    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(client_run, range(8)) for r in rs]
    assert len(results) == 200
    statuses = [s for _, _, ss, _ in results for s in ss]
    assert all(s in (200, 429) for s in statuses) and statuses.count(200) == 200
    mismatches = [(p, path, text) for p, path, _, text in results if text != expected[(p, path)]]
    assert not mismatches
    after = wait_idle(served.url)
    served_ok = sum(metric(after, "speculate_requests_total", endpoint=e, status="200") -
                    metric(before, "speculate_requests_total", endpoint=e, status="200")
                    for e in ("/v1/completions", "/v1/chat/completions"))
    assert served_ok == 200
    assert metric(after, "speculate_generated_tokens_total") - metric(before, "speculate_generated_tokens_total") \
        == 200 * 6


def test_generation_failure_is_a_500_and_the_server_stays_healthy(served, monkeypatch):
    def boom(self, *args, **kwargs):
        raise RuntimeError("boom in the engine")

    body = {"model": served.model, "prompt": "hi there", "max_tokens": 5}
    monkeypatch.setattr(Run, "take", boom)
    r = post(served, "/v1/completions", body)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and "boom in the engine" in err["message"] and err["code"]
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, headers=AUTH) as s:
        assert s.status_code == 200  # headers were sent before the failure: the error comes as an event
        _, events = read_sse(s)
    assert "boom in the engine" in events[-1]["error"]["message"]
    monkeypatch.undo()
    assert httpx.get(served.url + "/health").status_code == 200
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    m = wait_idle(served.url)
    assert metric(m, "speculate_requests_total", endpoint="/v1/completions", status="500") == 2


@pytest.fixture
def slow_forward(monkeypatch):
    """Every forward of any model sleeps 10 ms, so a long generation really is long; counts forwards. (The engine's
    forwards go through ``forward_many``, one call a round, whatever the path.)"""
    calls = [0]
    for cls in (FastKVModel, HFKVModel):
        def forward_many(self, *args, _original=cls.forward_many, **kwargs):
            calls[0] += 1
            time.sleep(0.01)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward_many", forward_many)
    return calls


def test_queue_full_then_disconnects_free_the_slot(served, slow_forward):
    config = ServerConfig(model=served.model, max_batch=1, max_queue=0)
    one = Served(create_app(config, served.target))
    try:
        long = {"model": served.model, "messages": MESSAGES, "max_tokens": 900, "temperature": 0, "stream": True,
                "speculative": {"drafter": "none"}}
        # Greedy: how long a sampled generation runs depends on the draw (an early EOS would end it).
        short = {"model": served.model, "prompt": "hi", "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", one.url + "/v1/chat/completions", json=long) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                pieces = 0
                while pieces < 3:
                    pieces += next(lines).startswith("data: ")
                # the only worker is busy and the queue holds nothing: back-pressure
                busy = httpx.post(one.url + "/v1/completions", json=short, timeout=30)
                assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
                assert busy.json()["error"]["type"] == "rate_limit_error"
                assert metric(scrape(one.url), "speculate_requests_in_flight") == 1
        # the client hung up mid-stream: the generation stops and frees the worker
        m = wait_idle(one.url, timeout=5)
        stopped_at = slow_forward[0]
        assert stopped_at < 300  # far fewer forwards than the 900 tokens it asked for
        assert metric(m, "speculate_requests_total", endpoint="/v1/chat/completions", status="499") == 1
        ok = httpx.post(one.url + "/v1/completions", json=short, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert slow_forward[0] - stopped_at < 10  # nothing else ran meanwhile (the short request: ~4 forwards)

        # a non-streamed request whose client gives up is cancelled too
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(one.url + "/v1/completions", json={**short, "max_tokens": 900},
                       timeout=httpx.Timeout(5, read=0.5))
        m = wait_idle(one.url, timeout=5)
        assert metric(m, "speculate_requests_total", endpoint="/v1/completions", status="499") == 1
        assert httpx.post(one.url + "/v1/completions", json=short, timeout=30).status_code == 200
    finally:
        one.stop()


def test_api_keys_from_flags_or_the_environment(monkeypatch):
    """--api-key is repeatable; $SPECULATE_API_KEY holds one key or several, comma-separated; a flag wins."""
    def keys(*flags):
        return ServerConfig.from_cli(_parser().parse_args(["serve", "--model", "m", *flags])).api_keys

    monkeypatch.delenv("SPECULATE_API_KEY", raising=False)
    assert keys() == () and keys("--api-key", "a", "--api-key", "b", "--api-key", "a") == ("a", "b")
    monkeypatch.setenv("SPECULATE_API_KEY", "one, two,")
    assert keys() == ("one", "two") and keys("--api-key", "flag") == ("flag",)
    assert ServerConfig(model="m", api_keys="solo").api_keys == ("solo",)  # (a str is one key, not its letters)
    with pytest.raises(SpeculateError, match="--api-key must not be empty"):
        ServerConfig(model="m", api_keys=("a", " "))


def test_cli_serve_flags_and_a_real_subprocess(tiny_folders, capsys):
    args = _parser().parse_args(["serve", "--model", "m"])
    assert (args.host, args.port, args.max_batch, args.prefill_chunk, args.api_key) == ("127.0.0.1", 8000, 8, 128, None)
    assert args.no_prefix_cache is False and _parser().parse_args(["serve", "--model", "m", "--no-prefix-cache"]).no_prefix_cache
    gated = [ServerConfig.from_cli(_parser().parse_args(["serve", "--model", "m", *f])).draft_gate
             for f in ([], ["--no-draft-gate"])]
    assert gated == [True, False]
    assert main(["serve", "--model", str(tiny_folders[0]), "--max-batch", "0"]) == 2
    assert main(["serve", "--model", str(tiny_folders[0]), "--prefill-chunk", "0"]) == 2
    assert main(["serve", "--model", str(tiny_folders[0]), "--verifier", "consultant", "--eps", "-1",
                 "--port", "1"]) == 2  # refused before serving anything
    with socket.socket() as busy:  # a port another process listens on: one line, before the models load
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        capsys.readouterr()
        assert main(["serve", "--model", "/no/such/model", "--port", str(busy.getsockname()[1])]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0], lines

    env = {**os.environ, "SPECULATE_API_KEY": "env-key"}
    with serve_subprocess(["--model", str(tiny_folders[1])], env) as (proc, url):
        c = openai.OpenAI(base_url=url + "/v1", api_key="env-key", max_retries=0)
        r = c.completions.create(model=str(tiny_folders[1]), prompt="abc abc", max_tokens=7, temperature=0)
        assert r.usage.completion_tokens == 7
        assert httpx.get(url + "/v1/models").status_code == 401
        proc.terminate()  # SIGTERM: a graceful stop, exit status 0 (uvicorn's own would re-raise it: 143)
        assert proc.wait(30) == 0, proc.stdout.read()


def test_the_servers_drafter_options_apply_to_its_drafter_only(tiny):
    """--drafter-opt at startup: requests that use the server's drafter get its options, a request naming
    another drafter gets that one's defaults; an option the drafter does not take stops the start."""
    from speculate.errors import SpeculateError
    from speculate.server.generation import build_decoder, request_spec
    from speculate.server.schemas import SpeculativeSettings

    config = ServerConfig(model="m", spec=SpeculativeSpec("lookup", ["max_ngram=5"]))
    assert config.spec.drafter_options == {"max_ngram": 5}
    decoder = build_decoder(tiny[0], None, request_spec(config, None))
    assert decoder.drafter.max_ngram == 5
    other = request_spec(config, SpeculativeSettings(drafter="none"))
    assert other.drafter_options == {} and build_decoder(tiny[0], None, other).drafter.name == "none"
    with pytest.raises(SpeculateError, match="no option 'base_k'"):
        ServerConfig(model="m", spec=SpeculativeSpec("lookup", ["base_k=2"]))


def test_k_and_eps_auto_in_the_server(served, client, tiny, tmp_path, monkeypatch):
    """`serve --k auto --eps auto` and a request's "k": "auto" / "eps": "auto", as `generate` takes them: the
    engine sizes each round, Consultant Decoding's ε is the target's calibrated NLL; greedy output stays plain
    decoding's."""
    from speculate.policy.auto import calibrate_eps
    from speculate.cli import _parser
    from speculate.errors import SpeculateError
    from speculate.server.generation import build_decoder, request_spec

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))  # the cost profile that k = auto measures once
    args = _parser().parse_args(["serve", "--k", "auto", "--eps", "auto", "--verifier", "consultant"])
    config = ServerConfig(model="m", spec=SpeculativeSpec("lookup", (), args.verifier, {"eps": args.eps}, args.k))
    decoder = build_decoder(tiny[0], None, request_spec(config, None))
    assert decoder.spec.k == "auto" and decoder.spec.verifier_params["eps"] == calibrate_eps(tiny[0])
    for bad in ("fast", 0, True):
        with pytest.raises(SpeculateError, match="k must be an integer in 1..64"):
            ServerConfig(model="m", spec=SpeculativeSpec(k=bad))

    # A request's own "auto" measures the cost profile / calibrates ε on the generation worker that runs it
    # (generation.open_run), not in the thread that prepared it: that thread would keep a second OpenMP team.
    import speculate.engine as engine_module

    prompt = "abc abc abc abc"
    plain = SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(prompt, max_new_tokens=30, chat=False)
    consultant = SpeculativeDecoder(tiny[0],
                                    SpeculativeSpec("lookup", verifier="consultant", k=3,
                                                    params={"eps": "auto", "beta": 0.2}))
    threads = []
    for name in ("profile_for", "calibrate_eps"):
        real = getattr(engine_module, name)
        monkeypatch.setattr(engine_module, name, lambda *a, _real=real: threads.append(
            threading.current_thread().name) or _real(*a))
    r = client.completions.create(model=served.model, prompt=prompt, max_tokens=30, temperature=0,
                                  extra_body={"speculative": {"drafter": "lookup", "k": "auto"}})
    assert r.choices[0].text == plain.text and r.to_dict()["speculative_stats"]["k"] == "auto"
    r = client.completions.create(model=served.model, prompt=prompt, max_tokens=30, temperature=0, extra_body={
        "speculative": {"drafter": "lookup", "verifier": "consultant", "eps": "auto", "beta": 0.2, "k": 3}})
    assert r.choices[0].text == consultant.generate(prompt, max_new_tokens=30, chat=False).text
    assert len(threads) == 2 and all(name == "speculate-generation" for name in threads), threads


def _fail(*args):
    raise AssertionError("called")


def test_a_request_may_ask_for_model_lookup_with_the_servers_draft_model(tiny, monkeypatch):
    """model+lookup is a draft-model drafter for the server too: a request naming it gets the server's
    draft model (and the server's options when it is the server's own drafter), and the same tokens as plain
    decoding; without a draft model it is a 400."""
    from speculate.server.generation import build_decoder, request_spec
    from speculate.server.schemas import SpeculativeSettings

    config = ServerConfig(model="m", spec=SpeculativeSpec("model+lookup", ["lookup_k=4"]), draft_model="d")
    # The tokenizers were compared at startup (load_models); a request does not compare them again (~0.25 s on
    # Qwen's): the comparison is remembered.
    from speculate.drafters.model import check_same_tokenizer

    check_same_tokenizer(tiny[0].tokenizer, tiny[0].tokenizer)
    monkeypatch.setattr(tiny[0].tokenizer, "get_vocab", _fail)
    decoder = build_decoder(tiny[0], tiny[0], request_spec(config, None))
    assert decoder.drafter.name == "model+lookup" and decoder.drafter.lookup_k == 4
    prompt = [5, 6, 7, 8] * 3
    plain = SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(prompt, max_new_tokens=12).token_ids
    assert decoder.generate(prompt, max_new_tokens=12).token_ids == plain
    asked = request_spec(ServerConfig(model="m"), SpeculativeSettings(drafter="model+lookup"))
    with pytest.raises(APIError, match="needs a draft model"):
        build_decoder(tiny[0], None, asked)
    assert build_decoder(tiny[0], tiny[0], asked).drafter.lookup_k == 10
    # A request naming a drafter that takes no draft model works on a server that has one.
    lookup = request_spec(config, SpeculativeSettings(drafter="lookup"))
    assert build_decoder(tiny[0], tiny[0], lookup).drafter.name == "lookup"


def test_one_decoder_per_settings_is_kept_and_shared(tiny):
    """server/decoders.py: the decoder built for some settings is handed out again for the same settings, to any
    number of requests at once (each run has its own cache), never for other settings; at most ``keep`` are kept,
    the least recently used leaving first."""
    from speculate.engine import step
    from speculate.server.decoders import Decoders

    built = []

    def build(spec):
        built.append(SpeculativeDecoder(tiny[0], spec))
        return built[-1]

    pool = Decoders(build, keep=2)
    lookup, plain, tree = SpeculativeSpec("lookup"), SpeculativeSpec("none"), SpeculativeSpec("lookup", k=2)
    a, b = pool.get(lookup), pool.get(SpeculativeSpec("lookup"))
    assert a is b and len(built) == 1  # equal settings: one decoder
    runs = [a.start([5, 6, 7, 8, 9], max_new_tokens=6), b.start([5, 6, 40, 41], max_new_tokens=6)]
    while not all(r.done for r in runs):
        step(runs)
    alone = [SpeculativeDecoder(tiny[0], lookup).generate(p, max_new_tokens=6).token_ids
             for p in ([5, 6, 7, 8, 9], [5, 6, 40, 41])]
    assert [r.generation.token_ids for r in runs] == alone
    assert pool.get(plain) is built[1]  # other settings: a new decoder
    assert pool.get(lookup) is a  # (now the most recently used)
    assert pool.get(tree) is built[2]  # a third: the least recently used (plain) goes
    assert pool.get(lookup) is a and pool.get(plain) is built[3]


def test_serve_loads_its_models_on_the_generation_thread(tiny_folders, tiny, monkeypatch):
    """`speculate serve` loads its models (and checks its settings) on the generation thread, not on the main
    thread: with GNU OpenMP, a second thread holding a team of OpenMP threads made every forward 1.47x slower
    (scheduler.py, Scheduler.call). The app then serves with that scheduler; a load that fails is one error and
    leaves no thread behind."""
    from speculate.errors import SpeculateError
    from speculate.server import main as server_main

    threads = []
    real = server_main.load_models

    def spy(config):
        threads.append(threading.current_thread().name)
        return real(config)

    monkeypatch.setattr(server_main, "load_models", spy)

    def workers_started_since(before):
        return [t for t in set(threading.enumerate()) - before if t.name.startswith("speculate-generation")]

    before = set(threading.enumerate())
    app = server_main.build_app(ServerConfig(model=str(tiny_folders[0]), spec=SpeculativeSpec("lookup")))
    assert threads == ["speculate-generation"] and app.state.scheduler.started
    server = BackgroundServer(app)
    try:
        body = {"model": str(tiny_folders[0]), "prompt": "abc abc abc", "max_tokens": 12, "temperature": 0}
        text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        server.stop()
    plain = SpeculativeDecoder(tiny[0], SpeculativeSpec("none"))
    assert text == plain.generate("abc abc abc", max_new_tokens=12, chat=False).text
    assert workers_started_since(before) == []  # stopped with the server

    with pytest.raises(SpeculateError, match="unknown model"):
        server_main.build_app(ServerConfig(model=str(tiny_folders[0]) + "-missing", spec=SpeculativeSpec("lookup")))
    assert workers_started_since(before) == []


def test_a_q4_server_answers_exactly_what_the_engine_decodes(tiny_folders, tmp_path, monkeypatch):
    """dtype q4 through the server (models loaded on its generation worker): the greedy answer of a lookup request
    is the engine's plain q4 answer, and the request's stats say the rows were verified batched and exact."""
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
    config = ServerConfig(model=str(tiny_folders[2]), dtype="q4", spec=SpeculativeSpec("lookup", k=4), max_batch=1)
    target, draft = load_models(config)
    assert target.dtype == "q4"
    s = BackgroundServer(create_app(config, target, draft))
    try:
        body = {"model": config.model, "prompt": "abc abc abc abc", "max_tokens": 24, "temperature": 0}
        got = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
    finally:
        s.stop()
    stats = got["speculative_stats"]
    assert stats["exactness"] == "batched" and stats["drafted_tokens"] > 0
    ids = target.tokenizer("abc abc abc abc")["input_ids"]
    plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(ids, max_new_tokens=24)
    assert got["choices"][0]["text"] == plain.text


def test_batched_requests_answer_exactly_what_each_gets_alone(tiny_folders, monkeypatch):
    """Continuous batching (server/scheduler.py) on an int8 model: six concurrent requests with different drafters
    and lengths share forwards (the batch-size histogram says so), one client leaves mid-stream, one request fails
    mid-batch (a 500 for it alone) and one arrives while the others run: every other answer is token for token what
    the request gets alone from the engine."""
    from speculate.engine import Run

    config = ServerConfig(model=str(tiny_folders[0]), dtype="int8", max_batch=4, max_queue=8, spec=SpeculativeSpec(k=3))
    target, draft = load_models(config)
    real = Run.take

    def take(self, logits):  # a little slower, so that the requests overlap; one prompt's request fails mid-way
        time.sleep(0.003)
        if self.tokens[:4] == failing[:4] and self.produced >= 5:
            raise RuntimeError("boom mid-batch")
        return real(self, logits)

    monkeypatch.setattr(Run, "take", take)
    app = create_app(config, target, draft)
    s = BackgroundServer(app)
    prompts = [(f"{w} " * 6).strip() + f" {i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta", "eps"])]
    failing = list(range(3, 40))  # token ids, known by its first four
    specs = [("lookup", prompts[0], 40), ("none", prompts[1], 25), ("lookup", prompts[2], 33), ("none", prompts[3], 30)]
    results, left = {}, []

    def ask(i, drafter, prompt, n, stream=False):
        body = {"model": config.model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                "speculative": {"drafter": drafter}, "stream": stream}
        if not stream:
            results[i] = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            return
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for j, _ in enumerate(r.iter_lines()):
                if j == 3:
                    left.append(i)
                    return  # the client leaves mid-stream

    try:
        threads = [threading.Thread(target=ask, args=(i, *spec)) for i, spec in enumerate(specs)]
        threads.append(threading.Thread(target=ask, args=(4, "lookup", prompts[4], 200, True)))
        threads.append(threading.Thread(target=ask, args=(5, "none", failing, 30)))
        for t in threads:
            t.start()
        time.sleep(0.05)
        late = threading.Thread(target=ask, args=(6, "lookup", prompts[0] + " again", 20))  # joins a running batch
        late.start()
        for t in threads + [late]:
            t.join(60)
        m = wait_idle(s.url)
    finally:
        s.stop()
    monkeypatch.undo()
    # The planner's gate (speculate/policy/gate.py) timed rounds both ways: drafted as planned, and plain; /metrics
    # shows it, per bucket, drafters and arm.
    gate = app.state.planner.gate
    assert gate.enabled and any(both[True].rounds and both[False].rounds for both in gate.arms.values())
    for (size, drafters), both in gate.arms.items():
        for drafted, arm in both.items():
            labels = {"batch": str(size), "drafters": "+".join(drafters), "arm": "draft" if drafted else "plain"}
            assert metric(m, "speculate_draft_gate_rounds", **labels) == arm.rounds
            assert metric(m, "speculate_draft_gate_tokens_per_second", **labels) == pytest.approx(arm.rate)
    assert metric(m, "speculate_draft_gate_withheld_rounds") == gate.withheld
    assert left == [4]
    assert results[5].status_code == 500 and "boom mid-batch" in results[5].json()["error"]["message"]
    for i, (drafter, prompt, n) in [*enumerate(specs), (6, ("lookup", prompts[0] + " again", 20))]:
        alone = SpeculativeDecoder(target,
                                   SpeculativeSpec(drafter, verifier="greedy",
                                                   k=3)).generate(prompt, max_new_tokens=n, chat=False)
        assert results[i].status_code == 200 and results[i].json()["choices"][0]["text"] == alone.text, i
    # Rounds shared forwards: on average more than one generation per forward, and the metrics are there.
    count, total = metric(m, "speculate_batch_size_count"), metric(m, "speculate_batch_size_sum")
    assert count > 0 and total / count > 1.5
    assert metric(m, "speculate_batch_rows_sum") >= total and metric(m, "speculate_queue_seconds_count") == 7
    assert metric(m, "speculate_time_per_output_token_seconds_count") == 5


def test_tokenizer_endpoints_in_vllms_shapes(served, client):
    """GET /tokenizer_info, POST /tokenize, POST /detokenize as vLLM serves them and lm-evaluation-harness's
    local-completions calls them (a prompt without a model name; add_special_tokens false)."""
    tok = served.target.tokenizer
    info = httpx.get(served.url + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["eos_token"] == tok.eos_token and info["model_max_length"] == served.target.context_window
    assert info["chat_template"] == tok.chat_template and info["vocab_size"] == len(tok)
    text = "the cat sat on the mat"
    r = post(served, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tok(text, add_special_tokens=False)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == served.target.context_window and "token_strs" not in r
    strs = post(served, "/tokenize", {"model": served.model, "prompt": text, "return_token_strs": True}).json()
    assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"])
    assert post(served, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    # a chat's messages count as the chat request's prompt tokens
    counted = post(served, "/tokenize", {"model": served.model, "messages": MESSAGES}).json()["count"]
    chat = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=1, temperature=0)
    assert counted == chat.usage.prompt_tokens
    # bad input: one clear 4xx each
    assert post(served, "/tokenize", {"prompt": text, "messages": MESSAGES}).status_code == 400
    assert post(served, "/tokenize", {"model": "other", "prompt": text}).status_code == 404
    bad = post(served, "/detokenize", {"tokens": [1, len(tok) + 5]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    assert post(served, "/tokenize", {"prompt": text}, headers={}).status_code == 401


def test_null_is_not_given_as_at_openai(served):
    """"temperature": null, "top_p": null, "n": null (and every other optional field) were a 400; OpenAI reads null
    as "not given". The answer equals the one without them; a required field sent as null is still missing."""
    optional = ["max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream", "stream_options",
                "presence_penalty", "frequency_penalty", "logit_bias", "user", "speculative"]
    plain = {"model": served.model, "prompt": "abc abc abc", "max_tokens": 6, "temperature": 0}
    nulls = {**{key: None for key in optional}, **plain}  # (max_tokens and temperature given: a greedy answer)
    a, b = post(served, "/v1/completions", plain), post(served, "/v1/completions", nulls)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    chat = post(served, "/v1/chat/completions", {"model": served.model, "messages": MESSAGES, "max_tokens": 3,
                                                  "temperature": None, "top_p": None, "n": None, "seed": 1,
                                                  "max_completion_tokens": None, "response_format": None})
    assert chat.status_code == 200, chat.text
    missing = post(served, "/v1/completions", {**plain, "model": None})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_a_list_of_prompts_and_n_give_a_choice_each_equal_to_the_request_alone(served, client):
    """lm-eval's local-completions sends a batch of prompts in one request: one choice per prompt (index set, all in
    the batch together), each equal to that prompt sent alone; n samples per prompt, prompt-major, the j-th drawn
    with seed + j, so a seeded request is reproducible and each sample equals a request with its seed."""
    prompts = ["abc abc abc", "the cat sat on the", "1 2 3 4", "hello hello"]
    alone = [client.completions.create(model=served.model, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    many = client.completions.create(model=served.model, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    ids = [served.target.tokenizer(p)["input_ids"] for p in prompts[:2]]
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone[:2]]

    sampled = dict(model=served.model, prompt=prompts[:2], max_tokens=8, temperature=1.0, seed=11, n=3)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.text for c in first.choices] == [c.text for c in again.choices] and len(first.choices) == 6
    for i, choice in enumerate(first.choices):
        prompt, j = divmod(i, 3)
        single = client.completions.create(model=served.model, prompt=prompts[prompt], max_tokens=8, temperature=1.0,
                                           seed=11 + j)
        assert choice.text == single.choices[0].text, (i, choice.text)
    assert len({c.text for c in first.choices[:3]}) > 1  # the samples of one prompt differ
    assert first.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone[:2])  # a prompt counts once

    chunks = list(client.completions.create(model=served.model, prompt=prompts, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [a.choices[0].text for a in alone]
    assert sum(c.usage is not None for c in chunks) == 1 and chunks[-1].usage.to_dict() == many.usage.to_dict()
    chat = client.chat.completions.create(model=served.model, messages=MESSAGES, max_tokens=6, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_openapi_json_describes_the_request_bodies_and_validates(served):
    """/openapi.json (behind the key, as the routes) is a valid OpenAPI 3 document whose request bodies are the
    models that validate the requests, the `speculative` extension among the fields, and `model` the served name."""
    from openapi_spec_validator import validate

    assert httpx.get(served.url + "/openapi.json", timeout=30).status_code == 401
    schema = httpx.get(served.url + "/openapi.json", headers=AUTH, timeout=30).json()
    validate(schema)
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    completion = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"model", "prompt", "max_tokens", "speculative", "n"} <= set(completion["properties"])
    assert "prompt" in completion["required"] and "model" in completion["required"]
    # the one model name the server answers to (any other is a 404), so a schema-driven client reaches the handlers
    served_ids = [m["id"] for m in httpx.get(served.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]]
    assert completion["properties"]["model"]["enum"] == served_ids
    assert "/v1/chat/completions" in schema["paths"] and "/tokenize" in schema["paths"]
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"bearer": []}]


RELEASE = """
import os, sys, torch
torch.set_num_threads(2)
from speculate.models.kernel import release_openmp_threads
from speculate.server.scheduler import Scheduler
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
torch.randn(4_000_000).exp_()  # a parallel op: this thread now holds an OpenMP team (one more thread)
team = tasks()
released = release_openmp_threads()
after = tasks()
torch.randn(4_000_000).exp_()  # the team again...
scheduler = Scheduler(max_batch=1, max_queue=0)
scheduler.start()  # ...given back as the generation thread starts (one thread more: the generation thread)
started = tasks()
working = scheduler.call(lambda: (torch.randn(4_000_000).exp_(), tasks())[1])  # its own team: one more...
import time
deadline = time.monotonic() + 10
while tasks() > started and time.monotonic() < deadline:  # ...given back once it waits for work
    time.sleep(0.01)
idle = tasks()
scheduler.stop()
print(before, team, released, after, started, working, idle)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="Linux, 2+ cores")
def test_the_thread_that_starts_generation_gives_back_its_openmp_team():
    """Two threads holding OpenMP teams on a small machine slow every forward ~2x (GNU OpenMP stops spinning between
    regions once its teams hold more threads than cores): the scheduler's starting thread gives its team back, and so
    does the generation thread while it waits for work. Counted in threads, in a fresh process: a parallel op adds a
    worker, releasing it removes it, Scheduler.start removes it again (its own thread is the one left), and the
    generation thread's worker goes once it is idle."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout.split()
    before, team, released, after, started, working, idle = (int(x) if x.isdigit() else x for x in out)
    assert (team, released, after, started) == (before + 1, "True", before, before + 1)
    assert (working, idle) == (before + 2, before + 1)  # the generation thread's team, gone when it waits
