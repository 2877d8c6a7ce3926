"""What a verifier class owns: its tree rule (a subclass keeps it), one verdict type with a path, one call
from the engine, its parameters declared once (the constructor, get_verifier, the CLI flags and the request
fields follow, with one error text), and one module for tree shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

import speculate.models.fast as fast
import speculate.models.kv as kv
import speculate.tree_shape as tree_shape
from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.cli import _parser
from speculate.drafters import get_drafter
from speculate.drafters.base import Draft
from speculate.errors import SpeculateError
from speculate.server.schemas import CompletionRequest, SpeculativeSettings
from speculate.verifiers import PARAMS, VERIFIERS, Verdict, Verifier, check_params, get_verifier, tree as tree_rules
from speculate.verifiers.consultant import ConsultantVerifier
from speculate.verifiers.greedy import GreedyVerifier
from speculate.verifiers.mentored import MentoredVerifier
from speculate.verifiers.sample import SampleVerifier

from conftest import noisy_copy

V = 6


class MyGreedy(GreedyVerifier):
    name = "my-greedy"


class MySample(SampleVerifier):
    name = "my-sample"


class MyConsultant(ConsultantVerifier):
    pass


def random_tree(rng, n):
    """Random topological parents, tokens, p_target rows [n+1, V] and p_draft rows shared by siblings."""
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    by_parent = torch.tensor(rng.dirichlet(np.full(V, 0.5), size=n + 1), dtype=torch.float32)
    draft = torch.stack([by_parent[p + 1] for p in parents])
    tokens = torch.tensor(rng.integers(0, V, size=n))
    target = torch.tensor(rng.dirichlet(np.full(V, 0.5), size=n + 1), dtype=torch.float32)
    # Some nodes are the target's argmax, so that greedy accepts paths of several lengths.
    for i, p in enumerate(parents):
        if rng.random() < 0.5:
            tokens[i] = target[p + 1].argmax()
    return parents, tokens, draft, target


# ------------------------------------------------------------------------------------- the tree rule


def test_a_subclass_keeps_its_tree_rule():
    """Before, the tree form was looked up by exact type: these subclasses had none."""
    rng = np.random.default_rng(0)
    assert MyGreedy.has_tree_rule() and MySample.has_tree_rule() and MyConsultant.has_tree_rule()
    lengths = set()
    for trial in range(200):
        parents, tokens, draft, target = random_tree(rng, int(rng.integers(1, 15)))
        parent, child = GreedyVerifier().verify_tree(tokens, parents, None, target), \
            MyGreedy().verify_tree(tokens, parents, None, target)
        assert parent == child
        lengths.add(child.n_accepted)
        for replacement in (False, True):
            g1, g2 = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            a = SampleVerifier().verify_tree(tokens, parents, draft, target, None, g1, replacement=replacement)
            b = MySample().verify_tree(tokens, parents, draft, target, None, g2, replacement=replacement)
            assert a == b and torch.equal(g1.get_state(), g2.get_state())
        a = ConsultantVerifier(eps=1.5).verify_tree(tokens, parents, None, target, 0.3)
        assert a == MyConsultant(eps=1.5).verify_tree(tokens, parents, None, target, 0.3)
    assert len(lengths) >= 3


def test_a_subclass_keeps_its_tree_rule_in_the_engine(tiny):
    target = tiny[0]
    drafter = get_drafter("model-tree", noisy_copy(target, 0.3), target, branch=2)
    prompt = [5, 6, 7, 8, 9]
    expected = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3),
                                  drafter=drafter).generate(prompt, max_new_tokens=20)
    out = SpeculativeDecoder(target, SpeculativeSpec(k=3), drafter=drafter,
                             verifier=MyGreedy()).generate(prompt, max_new_tokens=20)
    assert out.token_ids == expected.token_ids and out.stats.target_calls == expected.stats.target_calls


def test_a_subclass_that_changes_the_rule_changes_both_forms():
    class TargetCorrection(SampleVerifier):  # (the biased negative control of test_verifiers.py)
        def correction_distribution(self, target_row, draft_row):
            return target_row.double() / target_row.double().sum()

    rng = np.random.default_rng(3)
    differs = 0
    for trial in range(100):
        k = int(rng.integers(1, 5))
        target = torch.tensor(rng.dirichlet(np.full(V, 0.5), size=k + 1), dtype=torch.float32)
        draft = torch.tensor(rng.dirichlet(np.full(V, 0.5), size=k), dtype=torch.float32)
        x = torch.tensor(rng.integers(0, V, size=k))
        for verifier in (SampleVerifier(), TargetCorrection()):
            g1, g2 = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            chain = verifier.verify(x, draft, target, None, g1)
            assert chain == verifier.verify_tree(x, tree_shape.chain_as_tree(k), draft, target, None, g2)
        g1, g2 = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        differs += SampleVerifier().verify(x, draft, target, None, g1) != TargetCorrection().verify(x, draft, target,
                                                                                                     None, g2)
    assert differs  # (the two rules do differ somewhere)


def test_only_greedys_own_rule_reads_the_argmax_alone():
    """``argmax_only`` (the LM head may then leave the logits that cannot be the greatest at -inf): greedy and a
    subclass that keeps its rule; not a subclass with a rule of its own, nor a verifier that reads probabilities."""

    class Margin(GreedyVerifier):  # (a plugin's rule that reads more than the argmax)
        name = "margin"

        def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
            return super().verify(draft_tokens, draft_probs, target_probs.softmax(-1), state)

    assert GreedyVerifier().argmax_only and MyGreedy().argmax_only
    assert not Margin().argmax_only
    assert not any(cls().argmax_only for cls in (SampleVerifier, MySample, ConsultantVerifier, MentoredVerifier))


def test_a_verifier_without_a_tree_rule_says_so(tiny):
    class Custom(Verifier):
        name = "custom"

    assert not Custom.has_tree_rule() and not MentoredVerifier.has_tree_rule()
    assert [name for name, cls in VERIFIERS.items() if not cls.has_tree_rule()] == ["mentored"]
    with pytest.raises(SpeculateError, match="no tree rule"):
        MentoredVerifier().judge(torch.tensor([0]), [-1], torch.full((1, V), 1 / V), torch.full((2, V), 1 / V))
    drafter = get_drafter("model-tree", noisy_copy(tiny[0], 0.3), tiny[0])
    with pytest.raises(SpeculateError, match="can be verified by greedy, sample, consultant, loose, typical"):
        SpeculativeDecoder(tiny[0], SpeculativeSpec(verifier="mentored", k=3), drafter=drafter)


# ------------------------------------------------------------------------ one verdict, one call shape


def test_one_verdict_type_with_a_path():
    assert Verdict(2, 5) == Verdict(path=[0, 1], next_token=5) and Verdict(2, 5).n_accepted == 2
    assert Verdict(0, 1).path == [] and Verdict(path=[3, 7], next_token=0).n_accepted == 2
    with pytest.raises(ValueError, match="n_accepted"):
        Verdict(1, 0, path=[0, 1])
    target = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]])
    chain = GreedyVerifier().verify(torch.tensor([1, 0]), None, target)
    tree = GreedyVerifier().verify_tree(torch.tensor([1, 0]), [-1, 0], None, target)
    assert type(chain) is type(tree) is Verdict and chain == tree and chain.path == [0, 1]


def test_the_engine_calls_one_method():
    calls = []

    class Recording(GreedyVerifier):
        def verify(self, *args, **kwargs):
            calls.append("chain")
            return super().verify(*args, **kwargs)

        def verify_tree(self, *args, **kwargs):
            calls.append("tree")
            return super().verify_tree(*args, **kwargs)

    target = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5]])
    r = Recording()
    assert r.judge(torch.tensor([1, 0]), None, None, target) == r.judge(torch.tensor([1, 0]), [-1, 0], None, target)
    assert calls == ["chain", "tree"]


# ------------------------------------------------------------------------------ declared parameters


def test_every_verifier_is_built_from_its_declaration():
    for name, cls in VERIFIERS.items():
        v = get_verifier(name)
        assert isinstance(v, cls) and v.name == name
        for param in cls.params:
            assert getattr(v, param.name) == param.default
        names = [p.name for p in cls.params]
        assert repr(v) == f"{cls.__name__}({', '.join(f'{n}={getattr(v, n)!r}' for n in names)})"
    assert ConsultantVerifier(3.0, 0.5, False).eps == 3.0 and ConsultantVerifier(beta=0.5).beta == 0.5
    with pytest.raises(TypeError):
        ConsultantVerifier(D=0.3)
    assert check_params("consultant", {"eps": "auto", "beta": None}) == {"eps": "auto"}


def test_cli_flags_and_request_fields_follow_the_declarations():
    flags = {a.dest for a in _parser()._subparsers._group_actions[0].choices["generate"]._actions}
    assert set(PARAMS) <= flags
    fields = set(SpeculativeSettings.model_fields)
    assert fields == {"drafter", "verifier", "k", "share"} | set(PARAMS)  # (share: the suffix index, issue 40)
    assert set(PARAMS) == {"eps", "beta", "argmax", "delta", "D", "tol", "theta", "rho"}  # (greedy is the engine's)
    # Every declared parameter can be set both ways.
    for name, declared in PARAMS.items():
        verifier, param = declared[0]
        value = param.default
        args = _parser().parse_args(["generate", "hi", "--verifier", verifier, f"--{name}", str(value)])
        assert getattr(args, name) == value
        spec = SpeculativeSettings(verifier=verifier, **{name: value})
        assert spec.verifier_params() == {name: value}


BAD = [
    ("consultant", "eps", 0.0),
    ("consultant", "beta", 1.0),
    ("consultant", "beta", -0.1),
    ("typical", "eps", -0.1),
    ("typical", "delta", 0.0),
    ("mentored", "D", -1.0),
    ("mentored", "tol", 1.0),
    ("loose", "theta", -1.0),
    ("loose", "rho", 1.5),
    ("greedy", "eps", 2.0),  # a parameter the verifier does not take
    ("mentored", "beta", 0.2),
    ("typical", "eps", "auto"),  # 'auto' where it is not declared
    ("sample", "eps", "auto"),
]


@pytest.mark.parametrize("verifier, name, value", BAD)
def test_one_error_text_whichever_way_a_bad_value_arrives(verifier, name, value):
    with pytest.raises(ValueError) as api:
        get_verifier(verifier, **{name: value})
    text = str(api.value)
    with pytest.raises(SpeculateError) as cli:
        _parser().parse_args(["generate", "hi", "--verifier", verifier, f"--{name}", str(value)])
    assert str(cli.value) == text
    with pytest.raises(ValidationError) as schema:
        SpeculativeSettings(verifier=verifier, **{name: value})
    assert schema.value.errors()[0]["msg"] == text
    with pytest.raises(ValidationError) as request:  # within a request: at its "speculative" object
        CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                          "speculative": {"verifier": verifier, name: value}})
    assert (request.value.errors()[0]["loc"], request.value.errors()[0]["msg"]) == (("speculative",), text)


def test_the_default_verifier_is_checked_on_the_command_line():
    with pytest.raises(SpeculateError, match="verifier 'greedy' does not take beta"):
        _parser().parse_args(["generate", "hi", "--beta", "0.5"])
    with pytest.raises(SpeculateError, match="verifier 'sample' does not take beta"):
        _parser().parse_args(["generate", "hi", "--temperature", "0.7", "--beta", "0.5"])
    with pytest.raises(SpeculateError, match="needs the verifier 'consultant'"):
        _parser().parse_args(["generate", "hi", "--eps", "auto"])
    assert _parser().parse_args(["generate", "hi", "--verifier", "consultant", "--eps", "auto"]).eps == "auto"


# ------------------------------------------------------------------------------------------ tree shape


def test_tree_shape_lives_in_one_module():
    parents = [-1, -1, 0, 0, 1, 3]
    assert tree_shape.depths(parents) == [1, 1, 2, 2, 2, 3]
    depth, allowed = tree_shape.depths_and_ancestors(parents)
    assert depth.tolist() == [1, 1, 2, 2, 2, 3]
    assert allowed[5].tolist() == [True, False, False, True, False, True] and allowed.diagonal().all()
    draft = Draft(torch.arange(6), parents=parents)
    assert draft.node_depths() == tree_shape.depths(parents) and draft.depth == 3
    assert Draft(torch.arange(3)).node_depths() == [1, 2, 3]
    for name in ("chain_as_tree", "children_of", "depths", "paths"):
        assert getattr(tree_rules, name) is getattr(tree_shape, name)
    assert kv.depths_and_ancestors is fast.depths_and_ancestors is tree_shape.depths_and_ancestors
    assert not hasattr(kv, "tree_depths_and_ancestors")
    with pytest.raises(ValueError, match="topological"):
        tree_shape.depths_and_ancestors([-1, 1])


def test_a_bool_parameter_given_as_text_reads_true_or_false():
    """A TOML table or a bench method string gives text: "false" is False (bool("false") would be True)."""
    from speculate.bench.methods import parse_method
    from speculate.verifiers import get_verifier

    assert get_verifier("consultant", argmax="false").argmax is False
    assert get_verifier("consultant", argmax="true").argmax is True
    assert parse_method("drafter=lookup,verifier=consultant,k=6,argmax=false").argmax is False
    assert parse_method("drafter=lookup,verifier=consultant,k=6,argmax=true").spec.verifier_params["argmax"] is True
    with pytest.raises(ValueError, match="true or false"):
        get_verifier("consultant", argmax="maybe")
