"""The drafter that learns from served answers (drafters/suffix.py): its index against a brute-force reference, the
memory bound, greedy exactness as it learns, the share switch, and lossless sampling."""

from __future__ import annotations

import random

import pytest

from speculate import SamplingParams, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter, suffix
from speculate.drafters.suffix import ServedIndex

from test_tree_engine import sampled_prefix_pvalue


@pytest.fixture(autouse=True)
def fresh_indexes():
    suffix._INDEXES.clear()
    yield
    suffix._INDEXES.clear()


def brute_next(answers, context, max_n):
    """The longest n-gram (2..max_n) ending ``context`` that occurs in some answer followed by a token: the most
    frequent such token (ties: the smaller id), its share and n — by scanning every answer."""
    for n in range(min(max_n, len(context)), 1, -1):
        gram = context[-n:]
        follows = {}
        for a in answers:
            for i in range(len(a) - n):
                if a[i: i + n] == gram:
                    follows[a[i + n]] = follows.get(a[i + n], 0) + 1
        if follows:
            token, count = min(follows.items(), key=lambda item: (-item[1], item[0]))
            return token, count / sum(follows.values()), n
    return None


def test_the_index_equals_a_brute_force_scan_and_keeps_its_memory_bound():
    rng = random.Random(0)
    index = ServedIndex(max_n=4, max_tokens=300)
    kept = []
    for step in range(120):
        answer = [rng.randrange(6) for _ in range(rng.randrange(3, 25))]
        index.add(answer)
        kept.append(answer)
        while sum(map(len, kept)) > 300:  # the oldest answers go first
            kept.pop(0)
        assert index.tokens == sum(map(len, kept)) <= 300 and list(index.answers) == kept
        for _ in range(5):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 8))]
            assert index.next(context) == brute_next(kept, context, 4)
    # Nothing of an evicted answer is left: every n-gram counted is in a kept answer.
    assert all(brute_next(kept, list(gram), len(gram)) is not None for gram in index.counts)


def brute_follows(answers, context, max_n):
    """(counts of the tokens that followed, n) for the longest n-gram (2..max_n) ending ``context`` that occurs in some
    answer followed by a token — by scanning every answer."""
    for n in range(min(max_n, len(context)), 1, -1):
        follows = {}
        for a in answers:
            for i in range(len(a) - n):
                if a[i: i + n] == context[-n:]:
                    follows[a[i + n]] = follows.get(a[i + n], 0) + 1
        if follows:
            return follows, n
    return None


def test_the_draft_tree_is_the_best_scoring_continuations_a_brute_force_scan_finds():
    """ServedIndex.tree against every qualifying path found by scanning the answers: each node a continuation of its
    parent with a share >= min_share, at most alpha * n and k deep; the nodes taken are the best-scoring ones (the
    product of the shares on the path), as many as the budget allows, best first, none twice."""
    rng = random.Random(1)
    for _ in range(150):
        answers = [[rng.randrange(4) for _ in range(rng.randrange(3, 30))] for _ in range(rng.randrange(1, 6))]
        index = ServedIndex(max_n=4)
        for answer in answers:
            index.add(answer)
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
        k, budget = rng.randrange(1, 6), rng.randrange(1, 14)
        min_share, alpha = rng.choice([0.0, 0.3, 0.5]), rng.choice([0.5, 1.0, 2.0])
        tokens, parents = index.tree(context, k, min_share, alpha, budget)
        first = brute_follows(answers, context, 4)
        cap = min(k, max(1, int(alpha * first[1]))) if first else 0
        qualifying = {}  # path -> score

        def walk(path, score):
            found = brute_follows(answers, context + list(path), 4) if len(path) < cap else None
            for token, count in (found[0].items() if found else ()):
                share = count / sum(found[0].values())
                if share >= min_share:
                    qualifying[path + (token,)] = score * share
                    walk(path + (token,), score * share)

        walk((), 1.0)
        paths = []
        for token, parent in zip(tokens, parents):
            assert parent < len(paths)  # a parent before its children
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        assert len(set(paths)) == len(paths) == min(budget, len(qualifying))
        scores = [qualifying[path] for path in paths]  # (KeyError: a node that does not qualify)
        assert scores == sorted(scores, reverse=True)
        left = [score for path, score in qualifying.items() if path not in set(paths)]
        assert not left or min(scores) >= max(left)


@pytest.mark.parametrize("name", ["suffix", "suffix-tree"])
def test_greedy_output_is_the_targets_and_repeats_take_fewer_calls(tiny, name):
    target = tiny[0]
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [5, 6, 7, 8, 9]]
    alone = SpeculativeDecoder(target, SpeculativeSpec("none"))
    plain = {tuple(p): alone.generate(p, max_new_tokens=24).token_ids for p in prompts}
    calls = []
    for p in prompts:
        out = SpeculativeDecoder(target, SpeculativeSpec(name, k=6)).generate(p, max_new_tokens=24)
        assert out.token_ids == plain[tuple(p)]
        calls.append(out.stats.target_calls)
    # The third request repeats the first: its answer is in the index, drafted in long chains.
    assert calls[2] < calls[0] and calls[2] <= len(plain[tuple(prompts[0])]) // 2


def test_the_tree_keeps_the_right_branch_where_the_chain_follows_the_more_frequent_wrong_one(tiny):
    """Two answers in the index disagree at five tokens, the wrong one twice as frequent: the chain drafts the wrong
    token and is cut there, the tree drafts both branches and keeps going. Both give plain decoding's tokens; the tree
    in fewer target calls."""
    target = tiny[0]
    prompt = [5, 6, 7, 8, 9]
    answer = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40).token_ids
    wrong = [(token + 1) % 200 if i in (10, 15, 20, 25, 30) else token for i, token in enumerate(answer)]
    calls = {}
    for name in ("suffix", "suffix-tree"):
        suffix._INDEXES.clear()
        decoder = SpeculativeDecoder(target, SpeculativeSpec(name, {"min_context": 64}, verifier="greedy", k=6))
        for known in (wrong, wrong, answer):
            decoder.drafter.served.add(known)
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == answer, name
        calls[name] = out.stats.target_calls
    # the tree's rounds accept the right sibling and what follows it; the chain's end at the wrong token
    assert calls["suffix-tree"] < calls["suffix"], calls


def test_share_false_neither_reads_nor_feeds_the_index(tiny):
    target = tiny[0]
    p = [5, 6, 7, 8, 9]
    first = SpeculativeDecoder(target,
                               drafter=get_drafter("suffix", None, target, share=False)).generate(p, max_new_tokens=24)
    assert not suffix._INDEXES  # no index was made: nothing fed
    SpeculativeDecoder(target, SpeculativeSpec("suffix")).generate(p, max_new_tokens=24)  # this one feeds it
    private = SpeculativeDecoder(target, drafter=get_drafter("suffix", None, target, share=False))
    again = private.generate(p, max_new_tokens=24)
    assert again.token_ids == first.token_ids and again.stats.target_calls == first.stats.target_calls
    assert private.drafter.from_index == 0


@pytest.mark.parametrize("name", ["suffix", "suffix-tree"])
def test_sampling_stays_lossless_while_the_index_learns(tiny, name):
    """Every sampled answer feeds the index the next one drafts from: the first three tokens still follow the
    target's distribution (chi-square against the exact one, 1500 draws). (The tree variant drafts chains when it
    samples.)"""
    target = tiny[0]
    decoder = SpeculativeDecoder(target, SpeculativeSpec(k=4),
                                 drafter=get_drafter(name, None, target, min_share=0.0))
    prompt = [11, 12, 11, 12]
    p = sampled_prefix_pvalue(target, prompt, SamplingParams(temperature=1.0, top_k=3), decoder, 1500)
    assert decoder.drafter.served.tokens > 0 and p > 1e-3


def test_the_index_can_start_from_the_shipped_answers(default_model):
    from speculate.drafters.answer_store import FILE, read_answers, shipped_store
    from pathlib import Path

    index = suffix.served_index(default_model, seed=50)
    shipped = read_answers(Path(shipped_store(default_model)) / FILE)[0]
    assert list(index.answers) == shipped[:50] and index.tokens == sum(map(len, shipped[:50]))
    drafter = get_drafter("suffix", None, default_model, seed=50)
    assert drafter.served is index  # one index per model, scope and seed: the same object
    assert get_drafter("suffix", None, default_model).served is not index  # an unseeded one starts empty


@pytest.mark.filterwarnings("ignore:.*loaded on another thread:RuntimeWarning")
def test_the_server_reports_the_index_and_honours_share_false(tiny_folders):
    """Through the server: a request with ``speculative.share: false`` leaves the index empty; a shared one feeds it,
    and the same prompt again drafts from it. /metrics reports the index's answers, tokens and hit rate (the index's
    own counts), and τ by drafter (the requests' tokens over their target passes)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from speculate.server import ServerConfig, create_app, load_models
    from speculate.server.background import BackgroundServer
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(tiny_folders[0]), max_batch=2, spec=SpeculativeSpec("lookup", k=4))
    target, draft = load_models(config)
    server = BackgroundServer(create_app(config, target, draft))

    def ask(**speculative):
        body = {"model": config.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 24, "temperature": 0,
                "speculative": {"drafter": "suffix", **speculative}}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics() -> dict:
        text = httpx.get(server.url + "/metrics", timeout=10).text
        return {(s.name, s.labels.get("drafter")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples}

    try:
        private = ask(share=False)
        m = metrics()
        assert m[("speculate_suffix_index_answers", None)] == 0 and m[("speculate_suffix_index_tokens", None)] == 0
        shared = [ask(), ask()]
        assert [a["choices"][0]["text"] for a in shared] == [private["choices"][0]["text"]] * 2
        m = metrics()
        (index,) = suffix.indexes(target)
        assert m[("speculate_suffix_index_answers", None)] == len(index.answers) == 2
        assert m[("speculate_suffix_index_tokens", None)] == index.tokens == 2 * shared[0]["usage"]["completion_tokens"]
        assert index.hits >= 1 and m[("speculate_suffix_index_hit_rate", None)] == pytest.approx(index.hits / index.lookups)
        # the repeat drafted from the first answer: fewer target passes than the private request
        stats = [a["speculative_stats"] for a in (private, *shared)]
        assert stats[2]["target_calls"] < stats[0]["target_calls"]
        tau = sum(s["new_tokens"] for s in stats) / sum(s["target_calls"] for s in stats)
        assert m[("speculate_mean_accepted_length_by_drafter", "suffix")] == pytest.approx(tau)
    finally:
        server.stop()


@pytest.mark.filterwarnings("ignore:.*loaded on another thread:RuntimeWarning")
def test_answers_served_to_one_api_key_never_draft_for_another(tiny_folders):
    """A server with two API keys keeps an index per key (server/auth.py, tenant): the second key's request of the
    same prompt gets no draft from the first key's answer, while the first key's repeat does; with --share-drafts
    both keys read and feed one index. Every answer is plain decoding's."""
    import httpx

    from speculate.server import ServerConfig, create_app, load_models
    from speculate.server.auth import tenant
    from speculate.server.background import BackgroundServer

    def run(share_drafts: bool) -> tuple[dict, list[dict]]:
        suffix._INDEXES.clear()
        config = ServerConfig(model=str(tiny_folders[0]), max_batch=2, spec=SpeculativeSpec("lookup", k=4),
                              api_keys=("key-a", "key-b"), share_drafts=share_drafts)
        target, draft = load_models(config)
        server = BackgroundServer(create_app(config, target, draft))
        body = {"model": config.model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 24, "temperature": 0,
                "speculative": {"drafter": "suffix"}}
        try:
            answers = []
            for key in ("key-a", "key-b", "key-a"):
                r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                               timeout=60)
                assert r.status_code == 200, r.text
                answers.append(r.json())
        finally:
            server.stop()
        assert len({a["choices"][0]["text"] for a in answers}) == 1
        return {key[1]: index for key, index in suffix._INDEXES.items()}, [a["speculative_stats"] for a in answers]

    indexes, (a1, b1, a2) = run(share_drafts=False)
    a, b = indexes.pop(tenant("key-a")), indexes.pop(tenant("key-b"))
    assert not indexes  # no index besides the two keys' own
    assert (len(a.answers), len(b.answers)) == (2, 1)
    assert b.hits == 0 < a.hits  # key b's request never drafted from key a's answer; key a's repeat did
    assert b1["target_calls"] == a1["target_calls"] > a2["target_calls"]

    indexes, (a1, b1, a2) = run(share_drafts=True)
    (shared,) = indexes.values()
    assert set(indexes) == {""} and len(shared.answers) == 3
    assert b1["target_calls"] < a1["target_calls"]  # key b drafted from key a's answer


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """--k auto's cost profile goes to a temporary cache, not the user's."""
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))


def test_the_tree_with_k_auto_prices_its_nodes_within_the_cost_curve(tiny, own_cache):
    """--k auto prices a tree round at T(nodes + 1): the tree's own bound (budget, 1 / min_share children a node), not
    prompt lookup's 32-token copies, which once asked the cost curve for T(33) and refused every request."""
    target = tiny[0]
    decoder = SpeculativeDecoder(target, SpeculativeSpec("suffix-tree", verifier="greedy", k="auto"))
    assert [decoder.drafter.priced_nodes(k) for k in (1, 2, 3)] == [3, 12, 12]  # min_share 0.3, budget 12
    assert decoder.drafter.max_nodes(1) == 32  # (the caches still hold a whole copy)
    plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate([5, 6, 7, 8, 9], max_new_tokens=24)
    for _ in range(2):  # the second drafts from the first's answer
        out = decoder.generate([5, 6, 7, 8, 9], max_new_tokens=24)
        assert out.token_ids == plain.token_ids
    assert decoder.drafter.from_index > 0
