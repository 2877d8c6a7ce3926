"""The ``loose`` verifier (verifiers/loose.py: FLy's entropy gate), the one-file verifier: verdicts on
hand-made rows, lossless at its extremes, its tree rule, and its parameters reaching it from a CLI flag
and a request field that nothing but its own declaration lists."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from speculate import SpeculativeDecoder
from speculate.cli import _parser, main
from speculate.drafters import get_drafter
from speculate.errors import SpeculateError
from speculate.sampling import SamplingParams
from speculate.server.config import ServerConfig
from speculate.server.generation import build_decoder, request_spec
from speculate.server.schemas import CompletionRequest, SpeculativeSettings
from speculate.tree_shape import chain_as_tree
from speculate.verifiers import PARAMS, VERIFIERS, get_verifier
from speculate.verifiers.greedy import GreedyVerifier
from speculate.verifiers.loose import LooseVerifier
from speculate.verifiers.tree import tree_greedy
from speculate.spec import SpeculativeSpec

from conftest import noisy_copy

R0 = [0.4, 0.35, 0.2, 0.05]  # H = 1.206 nats; 0.35 is within 0.5 of the max, 0.05 is not
R1 = [0.9, 0.05, 0.03, 0.02]  # H = 0.428 nats
R2 = [0.1, 0.2, 0.3, 0.4]  # argmax 3


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def entropy(row) -> float:
    return -sum(p * math.log(p) for p in row if p > 0)


def test_registered_from_its_own_file_with_its_parameters():
    assert VERIFIERS["loose"] is LooseVerifier
    assert [name for name, _ in PARAMS["theta"]] == ["loose"] and [name for name, _ in PARAMS["rho"]] == ["loose"]
    v = get_verifier("loose")
    assert (v.theta, v.rho, v.greedy) == (1.0, 0.5, True) and v.raw_target and not v.needs_draft_probs
    assert not v.lossless and v.has_tree_rule()


def test_chain_verdicts_on_hand_made_rows():
    target = rows(R0, R1, R2)
    assert entropy(R0) > 1.0 > entropy(R1)
    loose = LooseVerifier(theta=1.0, rho=0.5)
    # x1 = 1: not the argmax, but H(R0) >= 1 and 0.35 >= 0.5 * 0.4; x2 = 0 the argmax: all accepted, bonus argmax.
    assert loose.verify(torch.tensor([1, 0]), None, target).path == [0, 1]
    assert loose.verify(torch.tensor([1, 0]), None, target).next_token == 3
    # x2 = 1 on R1: 0.05 < 0.5 * 0.9, rejected whatever the entropy; the next token is R1's argmax.
    v = loose.verify(torch.tensor([1, 1]), None, target)
    assert (v.n_accepted, v.next_token) == (1, 0)
    # x1 = 3: 0.05 < 0.2, too unlikely even where the target hesitates.
    assert loose.verify(torch.tensor([3, 0]), None, target).n_accepted == 0
    # The gate shut (theta above H(R0)) or the factor tightened (0.35 < 0.9 * 0.4): greedy's verdict.
    for v in (LooseVerifier(theta=1.3).verify(torch.tensor([1, 0]), None, target),
              LooseVerifier(rho=0.9).verify(torch.tensor([1, 0]), None, target)):
        assert (v.n_accepted, v.next_token) == (0, 0)
    assert GreedyVerifier().verify(torch.tensor([1, 0]), None, target) == v
    # Empty draft: the target's own token; state passes through.
    v = loose.verify(torch.tensor([], dtype=torch.long), None, target[:1], state="s")
    assert (v.path, v.next_token, v.state) == ([], 0, "s")


def test_sampling_draws_the_correction_from_sample_probs():
    target = rows(R0, R1, R2)
    forced = torch.zeros(3, 4)
    forced[1, 2] = 1.0  # the warped row after x1 gives token 2 only
    v = LooseVerifier(greedy=False).verify(torch.tensor([1, 1]), None, target, generator=torch.Generator(),
                                           sample_probs=forced)
    assert (v.n_accepted, v.next_token) == (1, 2)


def random_rows(rng, n, v=6, conc=0.3):
    return torch.tensor(rng.dirichlet(np.full(v, conc), size=n), dtype=torch.float32)


def test_lossless_at_the_extremes():
    """theta above log V never opens the gate; rho = 1 admits only ties with the max (none in random rows):
    both give greedy verification's verdicts, chain and tree."""
    rng = np.random.default_rng(0)
    greedy = GreedyVerifier()
    for trial in range(200):
        k = int(rng.integers(0, 6))
        target = random_rows(rng, k + 1)
        argmax = target[:k].argmax(1)
        x = torch.where(torch.tensor(rng.random(k) < 0.6), argmax, torch.tensor(rng.integers(0, 6, size=k)))
        expected = greedy.verify(x, None, target)
        for loose in (LooseVerifier(theta=1e9, rho=1e-9), LooseVerifier(theta=0.0, rho=1.0)):
            assert loose.verify(x, None, target) == expected
        # Anything goes with the gate open and a tiny factor: every token with mass passes.
        massless = [i for i in range(k) if not float(target[i, x[i]]) >= 1e-30 * float(target[i].max())]
        assert LooseVerifier(theta=0.0, rho=1e-30).verify(x, None, target).n_accepted == min(massless, default=k)
    for trial in range(100):
        parents, tokens = random_tree(rng, int(rng.integers(1, 12)))
        target = random_rows(rng, len(parents) + 1)
        expected = tree_greedy(tokens, parents, target)
        assert LooseVerifier(theta=1e9).verify_tree(tokens, parents, None, target) == expected
        assert LooseVerifier(rho=1.0).verify_tree(tokens, parents, None, target) == expected


def random_tree(rng, n, v=6):
    """Random parents (topological) and tokens, distinct among siblings (so greedy's deepest match is unique
    in the tokens it spells)."""
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    tokens, used = [], {}
    for parent in parents:
        free = [t for t in range(v) if t not in used.setdefault(parent, set())]
        token = int(rng.choice(free))
        used[parent].add(token)
        tokens.append(token)
    return parents, torch.tensor(tokens)


def test_tree_rule_on_a_hand_made_tree_and_on_chains():
    # root row R0: n0 = 0 (argmax), n1 = 1 (a near tie where the target hesitates);
    # after n0 (R1): n2 = 1 fails; after n1: n3 = 1 is the argmax; after n2 / n3: R2 (argmax 3).
    parents = [-1, -1, 0, 1]
    tokens = torch.tensor([0, 1, 1, 1])
    target = rows(R0, R1, [0.1, 0.6, 0.2, 0.1], R2, R2)
    v = LooseVerifier().verify_tree(tokens, parents, None, target)
    assert (v.path, v.next_token) == ([1, 3], 3)
    v = LooseVerifier(theta=1e9).verify_tree(tokens, parents, None, target)  # greedy's: n0 only, then R1's argmax
    assert (v.path, v.next_token) == ([0], 0)
    # A chain-shaped tree gives the chain verdict, drawing the same randomness.
    rng = np.random.default_rng(1)
    for trial in range(100):
        k = int(rng.integers(0, 6))
        target = random_rows(rng, k + 1, conc=1.0)
        x = torch.tensor(rng.integers(0, 6, size=k))
        sample_probs = random_rows(rng, k + 1)
        for verifier in (LooseVerifier(theta=0.5, rho=0.3), LooseVerifier(theta=1.0, rho=0.6, greedy=False)):
            g_chain, g_tree = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            chain = verifier.verify(x, None, target, None, g_chain, sample_probs)
            tree = verifier.verify_tree(x, chain_as_tree(k), None, target, None, g_tree, sample_probs)
            assert chain == tree and torch.equal(g_chain.get_state(), g_tree.get_state())


# ------------------------------------------------------------------------------------- in the engine


def test_in_the_engine_chain_and_tree(tiny):
    target = tiny[0]
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    greedy = SpeculativeDecoder(target,
                                SpeculativeSpec("lookup", verifier="greedy", k=4)).generate(prompt, max_new_tokens=24)
    shut = SpeculativeDecoder(target,
                              SpeculativeSpec("lookup", verifier="loose", k=4,
                                              params={"theta": 1e9})).generate(prompt, max_new_tokens=24)
    assert shut.token_ids == greedy.token_ids  # the gate never opens: greedy decoding
    drafter = get_drafter("model-tree", noisy_copy(target, 0.3), target, branch=2)
    tree = SpeculativeDecoder(target, SpeculativeSpec(verifier="loose", k=3, params={"theta": 0.0, "rho": 0.05}),
                              drafter=drafter)
    assert tree._verifier(SamplingParams()).has_tree_rule()
    out = tree.generate(prompt, max_new_tokens=20)
    assert out.stats.new_tokens == 20
    out = tree.generate(prompt, max_new_tokens=20, temperature=0.8, seed=2)  # greedy=False set by the engine
    assert out.stats.new_tokens == 20


# ------------------------------------------------------------------- the CLI flag and the request field


def test_cli_flags_reach_the_verifier(tiny_folders, tiny, capsys):
    args = _parser().parse_args(["generate", "hi", "--verifier", "loose", "--theta", "0.25", "--rho", "0.75"])
    assert (args.theta, args.rho) == (0.25, 0.75)
    with pytest.raises(SpeculateError) as cli:
        _parser().parse_args(["generate", "hi", "--verifier", "loose", "--rho", "0"])
    with pytest.raises(ValueError) as api:
        get_verifier("loose", rho=0.0)
    assert str(cli.value) == str(api.value) == (
        "loose: rho must satisfy 0 < rho <= 1 (a forgiven token's target probability is at least rho times the "
        "max), got 0.0")
    with pytest.raises(SpeculateError, match="does not take theta"):
        _parser().parse_args(["generate", "hi", "--theta", "0.5"])  # the default verifier, greedy
    # End to end: the flags' verifier decodes what the API's does.
    prompt = "hello hello hello"
    assert main(["generate", prompt, "--model", str(tiny_folders[0]), "--json", "--max-new-tokens", "16",
                 "--drafter", "lookup", "--verifier", "loose", "--theta", "0", "--rho", "0.05"]) == 0
    out = json.loads(capsys.readouterr().out)
    api = SpeculativeDecoder(tiny[0],
                             SpeculativeSpec("lookup", verifier="loose",
                                             params={"theta": 0.0, "rho": 0.05})).generate(prompt, max_new_tokens=16)
    assert out["token_ids"] == api.token_ids


def test_request_fields_reach_the_verifier(tiny_folders, tiny):
    body = {"model": "m", "prompt": "hi", "speculative": {"drafter": "lookup", "verifier": "loose", "theta": 0.25,
                                                          "rho": 0.75}}
    spec = CompletionRequest.model_validate(body).speculative
    assert spec.verifier_params() == {"theta": 0.25, "rho": 0.75}
    settings = request_spec(ServerConfig(model=str(tiny_folders[0]), spec=SpeculativeSpec("lookup")), spec)
    decoder = build_decoder(tiny[0], None, settings)
    verifier = decoder._verifier(SamplingParams())
    assert isinstance(verifier, LooseVerifier) and (verifier.theta, verifier.rho) == (0.25, 0.75)
    # A bad value: the same text as get_verifier's, at the request's "speculative" object.
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({**body, "speculative": {"verifier": "loose", "theta": -1}})
    first = err.value.errors()[0]
    with pytest.raises(ValueError) as api:
        get_verifier("loose", theta=-1)
    assert (first["loc"], first["msg"]) == (("speculative",), str(api.value))
    with pytest.raises(ValidationError):
        SpeculativeSettings(verifier="loose", rho="high")  # (a string is not a number: strict types)
    described = CompletionRequest.model_json_schema()["$defs"]["SpeculativeSettings"]["properties"]
    assert "entropy gate" in json.dumps(described["theta"])
