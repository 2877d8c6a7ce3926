"""Log-probabilities from the target's own rows (SamplingParams.logprobs / prompt_logprobs): the same values with and
without speculation at int8 and q4, and the values teacher forcing gives."""

from __future__ import annotations

import random

import pytest
import torch

from speculate import SamplingParams, SpeculateError, SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.models import quality


@pytest.fixture(scope="module", params=["int8", "q4"])
def target(request, tiny_folders):
    folder = tiny_folders[0] if request.param == "int8" else tiny_folders[2]
    return load_model(str(folder), dtype=request.param)


def prompt(seed, n=24):
    rng = random.Random(seed)
    base = [rng.randrange(3, 259) for _ in range(8)]
    return (base * 4)[:n]  # repeats: lookup drafts and some drafts are accepted


def teacher_forced(target, ids: list[int]) -> list[torch.Tensor]:
    """The log-softmax rows of the model over ``ids`` in one plain forward (row j scores ids[j + 1])."""
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([ids])).logits[0].float()
    return [row.log_softmax(-1) for row in logits[:-1]]


@pytest.mark.parametrize("drafter, k", [("model", 4), ("model-tree", 3), ("lookup", 4)])
def test_new_tokens_logprobs_equal_plain_decodings_and_teacher_forcing(target, drafter, k):
    """The target as its own draft model: every draft is accepted, so most values come from drafts' rows (a chain's
    and a tree's); lookup's drafts are rejected on this random model: the correction tokens' rows."""
    params = SamplingParams(max_new_tokens=20, logprobs=3)
    draft = target if drafter.startswith("model") else None
    for seed in range(3):
        ids = prompt(seed)
        plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(ids, params)
        spec = SpeculativeDecoder(target, SpeculativeSpec(drafter, k=k), draft_model=draft).generate(ids, params)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted_draft_tokens > (10 if draft is not None else -1)
        assert spec.logprobs == plain.logprobs  # bit for bit, the top alternatives included
        assert [e.token for e in plain.logprobs] == plain.token_ids
        rows = teacher_forced(target, ids + plain.token_ids)[len(ids) - 1:]
        for entry, row in zip(plain.logprobs, rows):
            assert entry.logprob == pytest.approx(float(row[entry.token]), abs=2e-3)
            assert len(entry.top) == 3 and entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
            assert entry.top[0][0] == int(row.argmax())  # greedy: the chosen token is the most likely one
        total = sum(e.logprob for e in plain.logprobs)
        forced = quality.answer_nll(target.model, ids, plain.token_ids).sum()  # (the gate's teacher forcing)
        assert total == pytest.approx(-float(forced), abs=2e-2)


def test_prompt_logprobs_score_every_prompt_token_and_skip_caches(target):
    from speculate.models.prefix_store import PrefixStore

    ids = prompt(7, 30)
    store = PrefixStore(1 << 30, block=4)
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3), prefix_cache=True, prefix_store=store)
    decoder.generate(ids, max_new_tokens=2)  # the prompt is now cached twice over
    out = decoder.generate(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=2), chat=False)
    assert out.stats.reused_prompt_tokens == 0 and out.token_ids == []
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    rows = teacher_forced(target, ids)
    for entry, token, row in zip(out.prompt_logprobs[1:], ids[1:], rows):
        assert entry.token == token and entry.logprob == pytest.approx(float(row[token]), abs=2e-3)
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()
    # In chunks (the server's prefill_chunk) the values are the same bits.
    run = decoder.start(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=2), prefill_chunk=7)
    from speculate.engine import step
    while not run.done:
        step([run])
    assert run.generation.prompt_logprobs == out.prompt_logprobs


def test_bad_logprobs_are_refused():
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(SpeculateError, match="logprobs must be an integer in 0..20"):
            SamplingParams(logprobs=bad)


# ------------------------------------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def served(target):
    from speculate.server import ServerConfig, create_app
    from speculate.server.background import BackgroundServer
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(target.path), dtype=target.dtype, spec=SpeculativeSpec("lookup", k=4), max_batch=2)
    server = BackgroundServer(create_app(config, target))
    yield server, config.model
    server.stop()


def test_the_openai_client_gets_logprobs_equal_with_and_without_speculation(served, target):
    import openai

    server, model = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    ids = prompt(11)
    got = {}
    for drafter in ("none", "lookup"):
        c = client.completions.create(model=model, prompt=ids, max_tokens=12, logprobs=2, temperature=0,
                                      extra_body={"speculative": {"drafter": drafter}}).choices[0]
        got[drafter] = c
        # (Each token's own text: on this byte-level model they do not join into the answer's text, as a character
        # split between tokens decodes to U+FFFD alone, and special tokens have texts the answer leaves out.)
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 12
        # Greedy: the chosen token is the most likely. (Texts are the keys: on this byte-level model several tokens
        # decode to the same replacement character, so a dict may hold fewer than 2 + 1 texts.)
        assert all(max(top.values()) == pytest.approx(value)
                   for value, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs))
    assert got["none"].logprobs.token_logprobs == got["lookup"].logprobs.token_logprobs
    assert got["none"].text == got["lookup"].text
    # The engine's own values, and teacher forcing's.
    out = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(ids, max_new_tokens=12, logprobs=0)
    assert got["none"].logprobs.token_logprobs == [e.logprob for e in out.logprobs]

    chats = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": "abc abc abc"}],
                                            max_tokens=8, logprobs=True, top_logprobs=3, temperature=0,
                                            extra_body={"speculative": {"drafter": d}}).choices[0]
             for d in ("none", "lookup")]
    for c in chats:
        assert len(c.logprobs.content) == 8 and all(len(e.top_logprobs) == 3 for e in c.logprobs.content)
        assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in c.logprobs.content)
    assert [e.logprob for e in chats[0].logprobs.content] == [e.logprob for e in chats[1].logprobs.content]
    # Streamed: each round's values in a chunk after its text; added up, the same list.
    streamed = [ch for ch in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "abc abc abc"}], max_tokens=8, logprobs=True,
        top_logprobs=3, temperature=0, stream=True, extra_body={"speculative": {"drafter": "lookup"}})]
    content = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in content] == [(e.token, e.logprob) for e in chats[1].logprobs.content]
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert text == chats[1].message.content
    pieces = [ch for ch in client.completions.create(model=model, prompt=ids, max_tokens=12, logprobs=2,
                                                      temperature=0, stream=True) if ch.choices]
    values = [v for ch in pieces if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert values == got["lookup"].logprobs.token_logprobs


def test_echo_scores_the_prompt_as_lm_eval_asks(served, target):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one new token; it sums the
    continuation's token_logprobs and checks that each was the most likely token."""
    import httpx

    server, model = served
    ids = prompt(12, 20)
    body = {"model": model, "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert choice["text"] == target.tokenizer.decode(ids) + lp["tokens"][-1]
    rows = teacher_forced(target, ids)
    expected = [float(row[t]) for row, t in zip(rows, ids[1:])]
    assert lp["token_logprobs"][1:-1] == pytest.approx(expected, abs=2e-3)
    assert sum(lp["token_logprobs"][1:-1]) == pytest.approx(sum(expected), abs=1e-2)
    # Scoring only (max_tokens 0, with echo), and what is refused.
    r = httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == lp["token_logprobs"][1:-1]
    for bad, param in (({"max_tokens": 0, "echo": False}, "max_tokens"), ({"logprobs": 21}, "logprobs")):
        r = httpx.post(server.url + "/v1/completions", json={**body, **bad}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # Streamed with echo (as vLLM streams it): the prompt first, with its values, then the answer's, the same lists
    # as the whole answer's; without logprobs the echo is the first chunk's text. Several prompts: each its own echo.
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for extra in ({"logprobs": 1}, {}):
        kwargs = {"model": model, "prompt": ids, "max_tokens": 3, "echo": True, "temperature": 0, **extra}
        whole = client.completions.create(**kwargs).choices[0]
        chunks = [ch.choices[0] for ch in client.completions.create(stream=True, **kwargs) if ch.choices]
        assert chunks[0].text == target.tokenizer.decode(ids) and "".join(c.text for c in chunks) == whole.text
        if extra:
            streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
            assert streamed == whole.logprobs.token_logprobs and streamed[0] is None
            assert chunks[0].logprobs.tokens == whole.logprobs.tokens[: len(ids)]
        else:
            assert all(c.logprobs is None for c in chunks)
    texts = ["abc abc", "x y z"]
    chunks = [ch.choices[0] for ch in client.completions.create(model=model, prompt=texts, max_tokens=2, echo=True,
                                                                 temperature=0, stream=True) if ch.choices]
    assert [c.text for c in chunks[:2]] == texts and [c.index for c in chunks[:2]] == [0, 1]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
