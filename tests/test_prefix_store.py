"""The prompt-prefix store shared by every generation on a model (models/prefix_store.py): a prompt's cached blocks
are mapped in (paged caches) or copied in (contiguous ones) whoever computed them and whatever their speculative
settings, and the answer is the one a fresh decoder gives (int8 and q4: a row's KV does not depend on the forward that
computed it)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.models.paged import BLOCK, CopiedBlock
from speculate.models.prefix_store import PrefixStore

from test_prefix_cache import Counted


@pytest.fixture(scope="module", params=["int8", "q4"])
def target(request, tiny_folders):
    folder = tiny_folders[0] if request.param == "int8" else tiny_folders[2]
    return load_model(str(folder), dtype=request.param)


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


SETTINGS = [("none", "greedy", 1), ("lookup", "greedy", 3), ("lookup", "consultant", 4)]


def test_a_prefix_any_request_computed_is_taken_and_the_tokens_are_a_fresh_decoders(target):
    """Three decoders of different settings share one store (blocks of 64 tokens; 130 shared, so that the shared
    prefix ends inside a block): each later prompt takes the shared prefix's full blocks and computes only the rest,
    and every answer is token-identical to a fresh decoder's without the store."""
    store = PrefixStore(1 << 30)
    shared = ids(0, 2 * BLOCK + 2)
    prompts = [shared + ids(i + 1, 70) for i in range(3)]
    decoders = [SpeculativeDecoder(target, SpeculativeSpec(d, verifier=v, k=k), prefix_store=store) for d, v,
                k in SETTINGS]
    fed = [Counted(d) for d in decoders]
    for i, (decoder, prompt) in enumerate(zip(decoders, prompts)):
        out = decoder.generate(prompt, max_new_tokens=12, temperature=0)
        d, v, k = SETTINGS[i]
        alone = SpeculativeDecoder(target, SpeculativeSpec(d, verifier=v, k=k))
        alone_kv = Counted(alone)
        fresh = alone.generate(prompt, max_new_tokens=12)
        assert out.token_ids == fresh.token_ids
        # The same bits, not only the same argmax: the cache (taken blocks, and every row computed over them).
        n = min(fed[i].kv.length, alone_kv.kv.length)
        assert n >= len(prompt) - 1
        for mine, fresh in zip(fed[i].kv.rows(0, n), alone_kv.kv.rows(0, n)):
            assert torch.equal(mine, fresh)
        # The first prompt was computed whole; the later ones took the 128 tokens of the shared prefix's full blocks
        # (130 shared: the rest is in a block that differs). The first forward fed the rest of the prompt and the
        # first draft beside it (Run.joins; these prompts draw no draft from lookup).
        assert out.stats.reused_prompt_tokens == (0 if i == 0 else 2 * BLOCK)
        assert fed[i].fed[0] == len(prompt) - out.stats.reused_prompt_tokens
        if i and fed[i].kv.paged is not None:  # mapped, not copied: the very blocks the first request computed
            assert all(fed[i].kv.paged.table[j] is fed[0].kv.paged.table[j] for j in range(2))
    # The shared 128 tokens, each prompt's own third block, and each generation's tail (its last 14 positions).
    assert store.blocks == 2 + 3 + 3
    assert store.hit_rate == pytest.approx(2 * 2 * BLOCK / (3 * (len(prompts[0]) - 1)))


def test_a_tree_drafter_and_a_sampled_run_use_the_store_too(target):
    """Sampling with a seed draws the same tokens with a stored prefix as without (the same bits, the same draws)."""
    store = PrefixStore(1 << 30)
    shared = ids(3, BLOCK + 1)
    SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store).generate(shared + [7], max_new_tokens=2)
    prompt = shared + ids(4, 5)
    for kwargs in ({"temperature": 0.9, "seed": 5}, {"temperature": 0}):
        with_store = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3),
                                        prefix_store=store).generate(prompt, max_new_tokens=16,
                                                                                           **kwargs)
        alone = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3)).generate(prompt, max_new_tokens=16, **kwargs)
        assert with_store.token_ids == alone.token_ids and with_store.stats.reused_prompt_tokens == BLOCK


class FakeKV:
    """Rows of a cache as plain numbers: position p holds the value tokens[p], to see which block went where.
    ``model``: the model it stands for (a store keys each model's blocks apart)."""

    MODEL = torch.nn.Module()

    def __init__(self, tokens=(), model=None):
        self.loaded = SimpleNamespace(model=model or self.MODEL)
        self.rows = torch.tensor(list(tokens), dtype=torch.float64).reshape(1, 1, -1, 1)
        self.length = len(tokens)

    def export_block(self, start, n):
        return CopiedBlock(self.rows[:, :, start: start + n].clone(), self.rows[:, :, start: start + n].clone())

    def import_block(self, start, block, n=None):
        values = block.values[:, :, :n]
        n = values.shape[2]
        if self.rows.shape[2] < start + n:
            self.rows = torch.cat([self.rows, torch.zeros(1, 1, start + n - self.rows.shape[2], 1)], dim=2)
        self.rows[:, :, start: start + n] = values
        self.length = max(self.length, start + n)


def test_colliding_keys_never_give_another_prefixs_rows():
    """A one-byte key: 256 keys for thousands of blocks. Whatever collides, a prompt gets only rows computed for
    exactly its own prefix (each entry's tokens and parent are compared, not only its key)."""
    store = PrefixStore(1 << 30, block=2, digest_size=1)
    rng = random.Random(0)
    stored = []
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
        store.add(FakeKV(tokens), tokens)
        stored.append(tokens)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
        kv = FakeKV()
        got = store.fill(kv, tokens)
        assert got % 2 == 0 and got <= len(tokens)
        assert kv.rows[0, 0, :got, 0].tolist() == tokens[:got]  # the rows are those of this very prefix
        # ...and a prefix found is one that was stored.
        assert got == 0 or any(s[:got] == tokens[:got] for s in stored)


def test_a_block_shared_in_part_gives_its_leading_rows():
    """After the last full cached block, the stored block continuing the same prefix that shares the most leading
    tokens with the prompt gives those rows (at least min_partial of them), and only rows of this very prefix."""
    store = PrefixStore(1 << 30, block=4, min_partial=2)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9, 9, 9]
    store.add(FakeKV(a), a)
    for prompt, taken in [([1, 2, 3, 4, 5, 6, 9], 6), ([1, 2, 3, 4, 5, 9], 4), ([1, 2, 7], 2), ([1, 7], 0),
                          ([1, 2, 3, 4, 5, 6], 6)]:
        kv = FakeKV()
        assert store.fill(kv, prompt) == taken, prompt
        assert kv.rows[0, 0, :taken, 0].tolist() == prompt[:taken]
    store.add(FakeKV(b), b)
    assert store.fill(FakeKV(), [1, 2, 3, 9, 5]) == 4  # b's first block whole; nothing of its second
    kv = FakeKV()
    assert store.fill(kv, [1, 2, 3, 7, 7]) == 3 and kv.rows[0, 0, :3, 0].tolist() == [1, 2, 3]
    # What a partial block cost the store: nothing (the rows were copied out); a's blocks are still whole.
    assert store.fill(FakeKV(), a) == 8 and store.blocks == 4
    # A generation's end stores its tail too (tokens after its last full block): a chat's next turn takes all of it.
    c = [5, 5, 5, 5, 6, 6, 6]
    store.add(FakeKV(c), c)
    assert store.fill(FakeKV(), c + [7, 7]) == 4
    store.add(FakeKV(c), c, tail=True)
    kv = FakeKV()
    assert store.fill(kv, c + [7, 7]) == 7 and kv.rows[0, 0, :7, 0].tolist() == c and store.blocks == 6


def test_a_prompt_sharing_part_of_a_block_takes_those_rows_and_answers_as_alone(target):
    """The chat template and a question's first words: a prompt sharing 100 tokens with a stored one takes them all
    (one full block, then 36 rows of the next, copied), computes the rest, and answers token for token as alone."""
    store = PrefixStore(1 << 30)
    shared = ids(50, 100)
    first = shared + ids(51, 40)
    SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store).generate(first, max_new_tokens=4)
    donor = [entry.block for entry in store._entries.values()]
    before = [(b.keys.clone(), b.values.clone()) for b in donor]
    prompt = shared + ids(52, 20)
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3), prefix_store=store)
    fed = Counted(decoder)
    out = decoder.generate(prompt, max_new_tokens=12)
    alone = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3)).generate(prompt, max_new_tokens=12)
    assert out.token_ids == alone.token_ids and out.stats.reused_prompt_tokens == 100
    assert 0 <= fed.fed[0] - (len(prompt) - 100) <= 3  # (the rest of the prompt, with its first draft)
    for block, (keys, values) in zip(donor, before):  # the stored blocks were copied from, never written
        assert torch.equal(block.keys, keys) and torch.equal(block.values, values)


def test_two_models_blocks_of_the_same_tokens_never_match():
    """One store serves a target and its draft model: the same tokens' blocks are two entries, each model's own."""
    store = PrefixStore(1 << 30, block=2)
    target, draft = torch.nn.Module(), torch.nn.Module()
    tokens = [1, 2, 3, 4, 5]
    store.add(FakeKV(tokens, model=target), tokens)
    assert store.fill(FakeKV(model=draft), tokens) == 0 and store.fill(FakeKV(model=target), tokens) == 4
    store.add(FakeKV(tokens, model=draft), tokens)
    assert store.blocks == 4 and store.fill(FakeKV(model=draft), tokens) == 4


def test_eviction_keeps_the_budget_and_shortens_a_prefix_from_its_end():
    block_bytes = FakeKV([0, 0]).export_block(0, 2).nbytes
    store = PrefixStore(5 * block_bytes, block=2)
    a = [1, 2, 3, 4, 5, 6, 7, 8]  # 4 blocks
    store.add(FakeKV(a), a)
    b = [9, 9, 8, 8, 7, 7]  # 3 more: 7 > 5, the two least recently used go
    store.add(FakeKV(b), b)
    assert store.bytes <= store.budget and store.blocks == 5
    # a's last two blocks went, its first two stay reachable.
    assert store.fill(FakeKV(), a) == 4 and store.fill(FakeKV(), b) == 6
    assert PrefixStore(0, block=2).fill(FakeKV(), a) == 0  # a budget of 0 keeps nothing
    empty = PrefixStore(0, block=2)
    empty.add(FakeKV(a), a)
    assert empty.blocks == 0 and empty.bytes == 0


def test_the_server_reports_cached_prompt_tokens_as_openai_does(tiny_folders):
    """Two chat requests with the same long system prompt and different speculative settings: the second's usage
    says how many prompt tokens came from the cache, and /metrics shows the store."""
    import httpx

    from speculate.server import ServerConfig, build_app
    from speculate.server.background import BackgroundServer
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(tiny_folders[2]), dtype="q4", spec=SpeculativeSpec("lookup", k=3), max_batch=1)
    server = BackgroundServer(build_app(config))
    system = " ".join(f"rule {i}: be brief." for i in range(30))
    try:
        with httpx.Client(timeout=120) as http:
            got = []
            for question, speculative in (("a b c", {"drafter": "none"}), ("d e f", {"drafter": "lookup", "k": 2})):
                body = {"model": config.model, "max_tokens": 4, "speculative": speculative,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
                r = http.post(server.url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                got.append(r.json()["usage"])
            metrics = http.get(server.url + "/metrics").text
    finally:
        server.stop()
    assert got[0]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = got[1]["prompt_tokens_details"]["cached_tokens"]
    # All they share: the system prompt and the template up to the question (full blocks, then part of one).
    from speculate.models import load_model
    from speculate.models.kv import position_bytes
    from speculate.text import encode_prompt

    tokenizer = load_model(config.model, dtype="q4").tokenizer
    asked = [encode_prompt(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}], None)
             for q in ("a b c", "d e f")]
    common = next(j for j, (x, y) in enumerate(zip(*asked)) if x != y)
    assert cached == common and cached > 2 * BLOCK and cached % BLOCK and len(asked[1]) == got[1]["prompt_tokens"]
    assert f"speculate_cached_prompt_tokens_total {float(cached)}" in metrics
    assert "speculate_prefix_cache_blocks " in metrics
    # Once the requests ended, the target's pool holds the store's full blocks and nothing else: every request's
    # cache was given up (no decoder keeps one). (The store also holds each answer's tail, copied out of the pool.)
    gauge = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
             if line.startswith(("speculate_kv_pool_bytes ", "speculate_prefix_cache_bytes "))}
    block_bytes = position_bytes(load_model(config.model, dtype="q4")) * BLOCK
    pool = gauge["speculate_kv_pool_bytes"]
    assert pool % block_bytes == 0 and block_bytes * (common // BLOCK) <= pool < gauge["speculate_prefix_cache_bytes"]


def test_requests_that_start_together_compute_their_shared_prefix_once(tiny_folders):
    """Four requests sent at once whose prompts share ~300 tokens: while one prefills a block of the shared prefix,
    the others wait for it and take it from the store (server/scheduler.py, engine.Run.catch_up), so together they
    compute it about once; each answer is the text a server without the store gives."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from speculate.server import ServerConfig, build_app
    from speculate.server.background import BackgroundServer

    shared = " ".join(f"item {i} is fine." for i in range(22))  # ~310 characters: ~4.8 blocks of the tiny tokenizer
    prompts = [shared + f" question {i}: {'xyz' * (i + 1)}" for i in range(4)]
    texts, usages = {}, {}
    for prefix_cache in (True, False):
        config = ServerConfig(model=str(tiny_folders[2]), dtype="q4", spec=SpeculativeSpec("none"), max_batch=4,
                              prefix_cache=prefix_cache)
        server = BackgroundServer(build_app(config))
        go = threading.Barrier(4)
        try:
            with httpx.Client(timeout=120) as http, ThreadPoolExecutor(4) as pool:
                def ask(i):
                    go.wait()  # (the four leave together)
                    return http.post(server.url + "/v1/completions", json={
                        "model": config.model, "prompt": prompts[i], "max_tokens": 8, "temperature": 0})

                for i, r in enumerate(pool.map(ask, range(4))):  # (an error in a request fails the test here)
                    assert r.status_code == 200, r.text
                    texts[prefix_cache, i] = r.json()["choices"][0]["text"]
                    usages[prefix_cache, i] = r.json()["usage"]
        finally:
            server.stop()
    assert all(texts[True, i] == texts[False, i] for i in range(4))
    # Each full block of the shared prefix (5 here) was computed by one request and taken by the three others from
    # the store: which request computed which block depends on when each arrived. (A request may also take the
    # shared rows of the sixth block from another's stored end, having computed blocks before it, so its cached
    # tokens need not be one prefix: counted over all of them, at least three takers a shared block, at most three
    # a shared position.)
    from transformers import AutoTokenizer

    tokenized = [AutoTokenizer.from_pretrained(tiny_folders[2])(p)["input_ids"] for p in prompts]
    common = next(j for j in range(len(tokenized[0])) if len({tuple(t[: j + 1]) for t in tokenized}) > 1)
    cached = [usages[True, i]["prompt_tokens_details"]["cached_tokens"] for i in range(4)]
    shared_blocks = common // BLOCK * BLOCK
    assert 3 * shared_blocks <= sum(cached) <= 3 * common and max(cached) <= common, (cached, common)
    assert common // BLOCK == 5


def test_blocks_taken_from_the_store_are_not_reserved_again(target):
    """--kv-memory counts a running request's own blocks: one whose prompt's first three blocks come from the store
    reserves its stretch less those blocks (they are the store's, held once), and the answer is the same."""
    from speculate.models.kv import position_bytes
    from speculate.server.scheduler import Job, Scheduler

    store = PrefixStore(1 << 30)
    prompt = ids(40, 3 * BLOCK + 5)
    pb = position_bytes(target)
    with_store = SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store)
    if with_store.new_cache().paged is None:
        pytest.skip("no C compiler here: the cache is not paged, a taken block is copied")
    with_store.generate(prompt, max_new_tokens=2)  # (stores the prompt's three full blocks)
    without = SpeculativeDecoder(target, SpeculativeSpec("none"))
    got = {}

    class Recorded(Job):
        def __init__(self, decoder):
            super().__init__(lambda resume=None, reserve=None: (run := decoder.start(
                prompt, max_new_tokens=4, reserve=reserve), run.release), loop=None, prompt_tokens=len(prompt),
                kv_bytes=pb * (len(prompt) + 24), position_bytes=pb)
            self.decoder = decoder

        def emit(self, kind, value=None):
            if kind == "done":
                got[self.decoder] = value.generation

    reserved = {}
    for decoder in (without, with_store):
        sched = Scheduler(max_batch=1, max_queue=1, kv_budget=1 << 30)
        sched.on_round = lambda n, rows, seconds, d=decoder: reserved.setdefault(d, sched.kv_reserved)
        sched.submit(Recorded(decoder))
        sched.start()
        try:
            deadline = time.monotonic() + 60
            while decoder not in got:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        finally:
            sched.stop()
    assert got[with_store].token_ids == got[without].token_ids
    assert got[with_store].stats.reused_prompt_tokens == 3 * BLOCK
    # The stretch: the prompt and up to 24 more positions, in whole blocks (4 of them); the store gave three.
    assert reserved[without] == 4 * BLOCK * pb and reserved[with_store] == BLOCK * pb
