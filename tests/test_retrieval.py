"""The answer store (drafters/answer_store.py) and the ``retrieval`` drafter that drafts from it
(drafters/retrieval.py)."""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict

import pytest
import torch
from scipy import stats as sstats

from speculate import SpeculateError, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.cli import main
from speculate.drafters import get_drafter, parse_options
from speculate.drafters.answer_store import FILE, AnswerStore, find_store, save_store
from speculate.sampling import SamplingParams, warp


def reference_table(answers, max_n, min_count, min_n=1):
    """The table by direct counting: n-gram → (most frequent next token, lowest id on ties; its share)."""
    follow = defaultdict(Counter)
    for a in answers:
        for i in range(len(a)):
            for n in range(min_n, max_n + 1):
                if i - n >= 0:
                    follow[tuple(a[i - n:i])][a[i]] += 1
    out = {}
    for key, counts in follow.items():
        token, count = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if count >= min_count:
            out[key] = (token, count / sum(counts.values()))
    return out


@pytest.mark.parametrize("max_n,min_count,min_n", [(1, 1, 1), (3, 1, 1), (4, 2, 2), (2, 3, 1)])
def test_the_table_counts_what_followed_each_ngram_inside_each_answer(max_n, min_count, min_n):
    rng = random.Random(max_n * 10 + min_count)
    # A small alphabet, so n-grams repeat and ties happen; answers of mixed lengths (one too short for any).
    answers = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(30)] + [[3]]
    store = AnswerStore(answers, max_n=max_n, min_count=min_count, min_n=min_n)
    expected = reference_table(answers, max_n, min_count, min_n)
    assert store.table.keys() == expected.keys()
    for key, (token, share) in expected.items():
        assert store.table[key][0] == token and store.table[key][1] == pytest.approx(share)
    # An n-gram never counts across two answers: [1, 2] then [3] does not make (2,) → 3.
    assert AnswerStore([[1, 2], [3]], max_n=2, min_count=1).table == {(1,): (2, 1.0)}


def test_chain_follows_the_longest_match_while_it_is_confident():
    answers = [[1, 2, 3, 4, 5]] * 3 + [[9, 2, 7]] * 2  # after (2,): 3 three times, 7 twice
    store = AnswerStore(answers, max_n=3, min_count=2)
    assert store.next([0, 2]) == (3, 0.6)  # the unigram (2,) alone
    assert store.next([9, 2]) == (7, 1.0)  # the longer match decides
    assert store.chain([1, 2], 10) == [3, 4, 5]  # stops where nothing followed
    assert store.chain([0, 2], 10, min_share=0.7) == []  # (2,) → 3 has a share of 0.6 only
    assert store.chain([0, 2], 10, min_n=2) == []  # (0, 2) never occurred
    assert store.chain([9, 2], 1) == [7]  # at most k


def test_save_load_and_find(tiny, tmp_path):
    answers = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8]]
    vocab = int(tiny[0].model.get_output_embeddings().out_features)
    save_store(tmp_path / FILE, answers, {"model": "tiny", "vocab_size": vocab})
    loaded = AnswerStore.load(tmp_path / FILE, max_n=3, min_count=2)
    assert loaded.table == AnswerStore(answers, max_n=3, min_count=2).table and loaded.meta["model"] == "tiny"
    assert find_store(tiny[0], tmp_path).table == loaded.table  # a folder holding the file, or the file
    assert find_store(tiny[0], tmp_path / FILE) is find_store(tiny[0], tmp_path / FILE)  # loaded once
    save_store(tmp_path / "other" / FILE, answers, {"model": "big", "vocab_size": vocab + 1})
    with pytest.raises(SpeculateError, match="vocabulary"):
        find_store(tiny[0], tmp_path / "other")
    save_store(tmp_path / "big" / FILE, [[vocab + 5, 1, 2]] * 2, {})  # hand-made: no vocab_size, ids too large
    with pytest.raises(SpeculateError, match="vocabulary"):
        find_store(tiny[0], tmp_path / "big")
    with pytest.raises(SpeculateError, match="no answer store ships for"):
        find_store(tiny[0])
    with pytest.raises(SpeculateError, match="cannot read the answer store"):
        find_store(tiny[0], tmp_path / "missing.safetensors")
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def store_of_answers(tmp_path, target, prompts, n_new=40, copies=2, with_prompt=False):
    """A store of the target's own greedy answers to ``prompts`` (each ``copies`` times: the table keeps
    continuations seen at least twice), after their prompts with ``with_prompt`` (so that the store can draft
    the first answer token too)."""
    plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
    answers = [(p if with_prompt else []) + plain.generate(p, max_new_tokens=n_new).token_ids for p in prompts] * copies
    vocab = int(target.model.get_output_embeddings().out_features)
    save_store(tmp_path / FILE, answers, {"vocab_size": vocab})
    return tmp_path


def random_prompt(seed, n=8):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def test_greedy_equals_plain_decoding_and_the_store_drafts_what_it_saw(tiny, tmp_path):
    """The store holds the target's answers to these very prompts: the retrieval drafter then drafts them
    whole (far fewer target calls than lookup), and its output is plain decoding's exactly. On prompts
    the store has not seen, output is still plain decoding's."""
    target = tiny[0]
    seen = [random_prompt(s) for s in range(3)]
    folder = store_of_answers(tmp_path, target, seen)
    for prompts, familiar in ((seen, True), ([random_prompt(s) for s in range(10, 13)], False)):
        for prompt in prompts:
            ref = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
            drafter = get_drafter("retrieval", None, target, store=str(folder))
            out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=6),
                                     drafter=drafter).generate(prompt, max_new_tokens=40)
            assert out.token_ids == ref.token_ids
            lookup = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=6))
            lookup = lookup.generate(prompt, max_new_tokens=40)
            if familiar:
                assert drafter.from_store > 0
                assert out.stats.target_calls <= 40 // 3 < lookup.stats.target_calls


def test_sampling_is_lossless(tiny, tmp_path):
    """The first two sampled tokens against the exact warped target distribution (chi-square at 1e-3),
    with a store whose drafts are sometimes right (its answers are greedy ones, the samples are not)."""
    target = tiny[2]
    prompt = random_prompt(5)
    folder = store_of_answers(tmp_path, target, [prompt], n_new=8, copies=3, with_prompt=True)
    s = SamplingParams(temperature=1.0, top_k=3)
    with torch.no_grad():
        p1 = warp(target.model(torch.tensor([prompt])).logits[0, -1:], s)[0]
        firsts = p1.nonzero()[:, 0]
        p2 = warp(target.model(torch.tensor([prompt + [int(t)] for t in firsts])).logits[:, -1], s)
    exact = {(int(a), int(b)): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in p2[i].nonzero()[:, 0]}
    drafter = get_drafter("retrieval", None, target, store=str(folder), min_share=0.0)
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="sample", k=2), drafter=drafter)
    n, drafted = 2000, 0
    counts = Counter()
    for i in range(n):
        out = decoder.generate(prompt, max_new_tokens=2, temperature=1.0, top_k=3, seed=i)
        counts[tuple(out.token_ids)] += 1
        drafted += drafter.from_store
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    total = sum(exact.values())
    assert sstats.chisquare([counts.get(key, 0) for key in keys], [exact[key] / total * n for key in keys]).pvalue > 1e-3
    assert drafted >= n  # the store drafted the first round of every generation


def test_options_refusals_and_the_command_line(tiny, tiny_folders, tmp_path, capsys):
    target = tiny[0]
    folder = store_of_answers(tmp_path, target, [random_prompt(1)], n_new=10)
    assert parse_options("retrieval", ["store=x", "min_share=0.3", "min_context=3"]) == \
        {"store": "x", "min_share": 0.3, "min_context": 3}
    with pytest.raises(SpeculateError, match="min_share must be in"):
        get_drafter("retrieval", None, target, store=str(folder), min_share=1.5)
    with pytest.raises(SpeculateError, match="min_context must be"):
        get_drafter("retrieval", None, target, store=str(folder), min_context=0)
    with pytest.raises(SpeculateError, match="needs the target"):
        get_drafter("retrieval", store=str(folder))
    with pytest.raises(SpeculateError, match="takes no draft model"):
        get_drafter("retrieval", target, target, store=str(folder))
    model = str(tiny_folders[0])
    assert main(["generate", "abc", "--model", model, "--drafter", "retrieval", "--drafter-opt", f"store={folder}",
                 "--max-new-tokens", "8", "--no-chat"]) == 0
    capsys.readouterr()
    assert main(["generate", "abc", "--model", model, "--drafter", "retrieval", "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no answer store ships for" in err[0] and "speculate train-answers" in err[0]


@pytest.mark.parametrize("command", [["train-answers"], ["train-heads", "--kind", "answers"]])  # (the old spelling)
def test_train_answers_writes_an_answer_store(tiny_folders, tmp_path, capsys, command):
    """`speculate train-answers`: the data's answers (no hidden states, no training) as a store the drafter
    loads; a later run with the same data reads them instead of generating again."""
    out = tmp_path / "answers"
    args = [*command, "--model", str(tiny_folders[0]), "--out", str(out), "--prompts", "4",
            "--max-new-tokens", "6", "--quiet"]
    assert main(args) == 0
    store = AnswerStore.load(out / FILE, min_count=1)
    assert store.meta["prompts"] == 4 and 0 < store.meta["answer_tokens"] <= 4 * 6 and store.table
    cached = json.loads((out / "data-4x6.answers.json").read_text())  # kept for a later train-heads
    assert sum(len(answer) for _, answer in cached["pairs"]) == store.meta["answer_tokens"]
    (out / "data-4x6.answers.json").write_text(json.dumps({**cached, "pairs": [[p, [7, 7, 7]] for p, _ in
                                                                                cached["pairs"]]}))
    assert main(args) == 0  # resumes from the cached answers: no generation
    assert AnswerStore.load(out / FILE, min_count=1).meta["answer_tokens"] == 4 * 3
    assert "saved the answer store" in capsys.readouterr().err


def test_the_shipped_store_drafts_for_the_default_model(default_model):
    """The default model's store ships with the package: greedy output is plain decoding's, and on a GSM8K-
    style question the store drafts in most rounds lookup has nothing for, so fewer target calls."""
    question = ("A baker made 24 muffins and sold 3 boxes of 4 muffins each. How many muffins are left? "
                "Explain step by step.")
    ref = SpeculativeDecoder(default_model, SpeculativeSpec("none")).generate(question, max_new_tokens=64)
    drafter = get_drafter("retrieval", None, default_model)
    out = SpeculativeDecoder(default_model, SpeculativeSpec(verifier="greedy", k=6),
                             drafter=drafter).generate(question, max_new_tokens=64)
    lookup = SpeculativeDecoder(default_model,
                                SpeculativeSpec("lookup", verifier="greedy", k=6)).generate(question, max_new_tokens=64)
    assert out.token_ids == ref.token_ids
    assert drafter.from_store > 5 and out.stats.target_calls < lookup.stats.target_calls


def test_auto_is_retrieval_where_a_store_ships_else_lookup(default_model, tiny, capsys):
    from speculate.drafters import resolve

    assert resolve("auto", default_model) == "retrieval" and resolve("auto", tiny[0]) == "lookup"
    assert resolve("eagle", default_model) == "eagle"
    assert SpeculativeDecoder(default_model).drafter.name == "retrieval"  # the library's default
    assert SpeculativeDecoder(tiny[0]).drafter.name == "lookup"
    assert get_drafter("auto", None, tiny[0]).name == "lookup"
    assert resolve("auto", "smollm2-135m-instruct") == "retrieval"  # by name too (the server's flags)
    assert main(["generate", "Name three colours.", "--max-new-tokens", "8"]) == 0  # the command line's default
    assert "[retrieval/greedy k=6]" in capsys.readouterr().err
    # Options reach the drafter auto stands for: retrieval's here, lookup's on a model without a store.
    assert main(["generate", "Name three colours.", "--max-new-tokens", "8", "--drafter-opt", "min_share=0.9"]) == 0
    capsys.readouterr()
    assert _serve_config("smollm2-135m-instruct", "--drafter-opt", "min_share=0.9").spec.drafter == "retrieval"
    with pytest.raises(SpeculateError, match="takes: max_ngram"):
        _serve_config("/some/folder", "--drafter-opt", "min_share=0.9")


def _serve_config(model, *flags):
    """The server's settings as ``speculate serve --model MODEL FLAGS`` makes them."""
    from speculate.cli import _parser
    from speculate.server.config import ServerConfig

    return ServerConfig.from_cli(_parser().parse_args(["serve", "--model", model, *flags]))


def test_concurrent_first_uses_load_a_store_once(tiny, tmp_path, monkeypatch):
    """Server workers building their first decoders at once share one table, loaded once; a rewritten file
    is loaded again."""
    import os
    import threading
    import time

    vocab = int(tiny[0].model.get_output_embeddings().out_features)
    save_store(tmp_path / FILE, [[5, 6, 7, 8]] * 3, {"vocab_size": vocab})
    loads = []
    original = AnswerStore.load.__func__

    def counted(cls, path, **settings):
        loads.append(path)
        time.sleep(0.05)  # a load takes a while: without the lock the other threads would load it too
        return original(cls, path, **settings)

    monkeypatch.setattr(AnswerStore, "load", classmethod(counted))
    found = []
    threads = [threading.Thread(target=lambda: found.append(find_store(tiny[0], tmp_path))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(loads) == 1 and len({id(s) for s in found}) == 1

    save_store(tmp_path / FILE, [[5, 6, 7, 9]] * 3, {"vocab_size": vocab})
    os.utime(tmp_path / FILE, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # a later mtime, surely
    assert find_store(tiny[0], tmp_path).next([6, 7]) == (9, 1.0) and len(loads) == 2


def test_auto_takes_the_options_of_either_drafter_it_may_stand_for(default_model, tiny):
    """auto is retrieval on the default model and lookup elsewhere: lookup's options work with both."""
    from speculate.server.generation import request_spec
    from speculate.server.schemas import SpeculativeSettings

    for model in ("smollm2-135m-instruct", "/some/folder"):
        config = _serve_config(model, "--drafter-opt", "min_ngram=2", "--drafter-opt", "max_copy=8")
        assert config.spec.drafter_options == {"min_ngram": 2, "max_copy": 8}
        # A request naming auto gets the server's own settings (and so its decoders and their prefix caches).
        assert request_spec(config, SpeculativeSettings(drafter="auto")) == request_spec(config, None)
    drafter = get_drafter("auto", None, default_model, min_ngram=2)
    assert drafter.name == "retrieval" and drafter.min_ngram == 2
