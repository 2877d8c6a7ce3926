"""One SpeculativeSpec from every settings path (CLI flags, an HTTP request's ``speculative`` object, a bench method
string, a TOML table): the same settings give the same spec, the same mistake the same error text; the old drafter
names (eagle-chain, medusa+lookup, ...) are aliases of the options form (tree=false, lookup=true)."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import replace

import pytest
from pydantic import ValidationError

from speculate.bench.command import add_arguments as add_bench_arguments
from speculate.bench.command import build_config
from speculate.bench.methods import engine_method, parse_method
from speculate.bench.runner import BenchConfig, run_bench
from speculate.cli import _parser
from speculate.errors import SpeculateError
from speculate.server.config import ServerConfig
from speculate.server.errors import APIError, validation_error
from speculate.server.generation import build_decoder as server_build_decoder
from speculate.server.generation import request_spec
from speculate.server.schemas import CompletionRequest
from speculate import SpeculativeDecoder
from speculate.spec import VARIANTS, SpeculativeSpec, parse_k

# The same settings written for each path: lookup drafting, Consultant Decoding (eps 2, beta 0.2), k = 3.
EXPECTED = SpeculativeSpec("lookup", (), "consultant", {"eps": 2.0, "beta": 0.2}, 3)
K_ERROR = "k must be an integer in 1..64 or 'auto', got "
UNKNOWN_DRAFTER = "unknown drafter 'nope'; choose one of: auto, none, lookup"
NEEDS_DRAFT = "drafter 'model' needs a draft model (--draft-model)"
BAD_PARAM = "consultant: beta must satisfy 0 <= beta < 1"


def _cli(*flags: str) -> SpeculativeSpec:
    args = _parser().parse_args(["generate", "hi", *flags])
    return replace(SpeculativeSpec.from_cli(args), dtype=None)  # (the CLI also carries the precision: fp32)


def _cli_error(*flags: str) -> str:
    with pytest.raises(SpeculateError) as err:
        _cli(*flags)
    return str(err.value)


def _request(speculative: dict, config: ServerConfig | None = None) -> SpeculativeSpec:
    body = {"model": "m", "prompt": "hi", "speculative": speculative}
    return request_spec(config or ServerConfig(model="m"), CompletionRequest.model_validate(body).speculative)


def _request_error(speculative: dict, draft=None, tiny=None) -> str:
    try:
        spec = _request(speculative)
        server_build_decoder(tiny[0], draft, spec)
    except ValidationError as e:
        return validation_error(e.errors()).message
    except APIError as e:
        return e.message
    raise AssertionError("no error")


def _method_error(method) -> str:
    with pytest.raises(SpeculateError) as err:
        parse_method(method)
    return str(err.value)


def _toml(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    return build_config(p.parse_args(["--config", str(path), "--out", str(tmp_path / "out")]))


def _toml_error(tmp_path, text: str) -> str:
    with pytest.raises(SpeculateError) as err:
        _toml(tmp_path, text)
    return str(err.value)


def test_the_same_settings_give_the_same_spec_on_every_path(tmp_path):
    assert _cli("--drafter", "lookup", "--verifier", "consultant", "--eps", "2", "--beta", "0.2", "--k", "3") \
        == EXPECTED
    assert ServerConfig(model="m", spec=SpeculativeSpec("lookup", (), "consultant", {"eps": 2, "beta": 0.2}, 3)).spec == EXPECTED
    assert _request({"drafter": "lookup", "verifier": "consultant", "eps": 2.0, "beta": 0.2, "k": 3}) == EXPECTED
    # A request over a server started with these settings, and one naming nothing: the server's spec.
    config = ServerConfig(model="m", spec=SpeculativeSpec("lookup", (), "consultant", {"eps": 2, "beta": 0.2}, 3))
    assert _request({}, config) == _request({"drafter": "lookup", "k": 3}, config) == EXPECTED
    assert parse_method("drafter=lookup,verifier=consultant,k=3,eps=2,beta=0.2").spec == EXPECTED
    assert engine_method("lookup", "consultant", 3, eps=2, beta=0.2).spec == EXPECTED
    table = tomllib.loads('drafter = "lookup"\nverifier = "consultant"\nk = 3\neps = 2\nbeta = 0.2\n')
    assert SpeculativeSpec.from_table(table) == EXPECTED
    cfg = _toml(tmp_path, 'method = [{drafter = "lookup", verifier = "consultant", k = 3, eps = 2, beta = 0.2}]\n'
                          'drafters = []\nverifiers = []\nbaselines = []\n')
    assert cfg.methods[-1].spec == EXPECTED
    # Equal specs are one key (the server keeps decoders per spec).
    assert len({EXPECTED, _request({"drafter": "lookup", "verifier": "consultant", "eps": 2.0, "beta": 0.2,
                                    "k": 3})}) == 1


@pytest.mark.parametrize("k", [0, 65])
def test_a_bad_k_is_one_text_on_every_path(tmp_path, k):
    text = K_ERROR + repr(k)
    with pytest.raises(SpeculateError) as err:
        parse_k(k)
    assert str(err.value) == text
    assert _cli_error("--k", str(k)).endswith(K_ERROR + repr(str(k)))  # (argparse hands over the text)
    with pytest.raises(SpeculateError, match=re.escape(text)):
        ServerConfig(model="m", spec=SpeculativeSpec(k=k))
    with pytest.raises(ValidationError, match=re.escape(text)):
        CompletionRequest.model_validate({"model": "m", "prompt": "hi", "speculative": {"k": k}})
    assert _method_error(f"drafter=lookup,k={k}").endswith(K_ERROR + repr(str(k)))
    assert _toml_error(tmp_path, f'method = [{{drafter = "lookup", k = {k}}}]\n').endswith(text)
    assert _toml_error(tmp_path, f"k = [{k}]\n").endswith(text)


def test_an_unknown_drafter_is_one_text_on_every_path(tmp_path, tiny):
    assert UNKNOWN_DRAFTER in _cli_error("--drafter", "nope")
    with pytest.raises(SpeculateError, match=re.escape(UNKNOWN_DRAFTER)):
        ServerConfig(model="m", spec=SpeculativeSpec("nope"))
    assert UNKNOWN_DRAFTER in _request_error({"drafter": "nope"}, tiny=tiny)
    assert UNKNOWN_DRAFTER in _method_error("drafter=nope,k=3")
    assert UNKNOWN_DRAFTER in _toml_error(tmp_path, 'method = [{drafter = "nope"}]\n')
    with pytest.raises(SpeculateError, match=re.escape(UNKNOWN_DRAFTER)):
        SpeculativeSpec.from_table({"drafter": "nope"})


def test_a_draft_model_drafter_without_a_draft_model_is_one_text_on_every_path(tmp_path, tiny, tiny_folders):
    assert _cli_error("--drafter", "model") == NEEDS_DRAFT
    assert _request_error({"drafter": "model"}, tiny=tiny) == "speculative: " + NEEDS_DRAFT
    with pytest.raises(SpeculateError, match=re.escape(NEEDS_DRAFT)):
        SpeculativeDecoder(tiny[0], SpeculativeSpec("model"))
    cfg = BenchConfig(model=str(tiny_folders[0]), out=tmp_path / "run", methods=[parse_method("drafter=model,k=3")],
                      datasets=["copy"], limit=1)
    with pytest.raises(SpeculateError) as err:
        run_bench(cfg, progress=False)
    assert str(err.value) == NEEDS_DRAFT
    table = _toml(tmp_path, 'method = [{drafter = "model", k = 3}]\ndrafters = []\nverifiers = []\nbaselines = []\n')
    with pytest.raises(SpeculateError) as err:
        run_bench(replace(table, model=str(tiny_folders[0]), datasets=["copy"], limit=1), progress=False)
    assert str(err.value) == NEEDS_DRAFT
    # And a draft model given for a drafter that takes none: the CLI's and the server's flag check, once.
    assert "--draft-model needs --drafter model" in _cli_error("--drafter", "lookup", "--draft-model", "x")
    with pytest.raises(SpeculateError, match="--draft-model needs --drafter model"):
        ServerConfig(model="m", spec=SpeculativeSpec("lookup"), draft_model="x")


def test_a_bad_verifier_parameter_is_one_text_on_every_path(tmp_path, tiny):
    assert BAD_PARAM in _cli_error("--verifier", "consultant", "--beta", "1.5")
    with pytest.raises(SpeculateError, match=re.escape(BAD_PARAM)):
        ServerConfig(model="m", spec=SpeculativeSpec(verifier="consultant", params={"beta": 1.5}))
    assert BAD_PARAM in _request_error({"verifier": "consultant", "beta": 1.5}, tiny=tiny)
    assert BAD_PARAM in _method_error("verifier=consultant,k=3,beta=1.5")
    assert BAD_PARAM in _toml_error(tmp_path, 'method = [{verifier = "consultant", beta = 1.5}]\n')
    with pytest.raises(SpeculateError, match=re.escape(BAD_PARAM)):
        SpeculativeSpec.from_table({"verifier": "consultant", "beta": 1.5})


def test_the_old_drafter_names_are_aliases_of_the_options_form():
    assert SpeculativeSpec("eagle-chain") == SpeculativeSpec("eagle", {"tree": False})
    assert SpeculativeSpec("eagle") == SpeculativeSpec("eagle", {"tree": "true", "lookup": "false"})
    assert SpeculativeSpec("medusa-chain+lookup", ["base_k=3"]) == SpeculativeSpec(
        "medusa", {"tree": "false", "lookup": "true", "base_k": "3"})
    for name, (base, _) in VARIANTS.items():  # every alias, back to the registry's name that builds it
        spec = SpeculativeSpec(name)
        assert spec.drafter == base and spec.registry_name == name
    assert _cli("--drafter", "eagle-chain") == _cli("--drafter", "eagle", "--drafter-opt", "tree=false")
    assert _cli("--drafter", "eagle+lookup", "--drafter-opt", "base_k=3") == _cli(
        "--drafter", "eagle", "--drafter-opt", "lookup=true", "--drafter-opt", "base_k=3")
    assert _request({"drafter": "eagle-chain+lookup"}) == SpeculativeSpec("eagle", {"tree": False, "lookup": True})
    # bench: the same spec, each method keeping the name it was written with (records and resumes match by it)
    old, new = parse_method("drafter=eagle-chain,k=2,min_confidence=0"), parse_method(
        "drafter=eagle,tree=false,k=2,min_confidence=0")
    assert old.spec == new.spec and old.name == "SD/eagle-chain k=2 min_confidence=0"
    assert dict(new.spec.options) == {"min_confidence": 0.0, "tree": False}
    # An alias does not take the opposite of what it stands for; a variant option takes true or false.
    with pytest.raises(SpeculateError, match="drafter 'eagle-chain' is eagle with tree=false"):
        SpeculativeSpec("eagle-chain", {"tree": True})
    with pytest.raises(SpeculateError, match="option tree wants true or false"):
        SpeculativeSpec("eagle", {"tree": "maybe"})
    with pytest.raises(SpeculateError, match="drafter 'lookup' has no option 'tree'"):
        SpeculativeSpec("lookup", {"tree": False})


def test_the_decoder_takes_a_spec_never_a_name_or_loose_parameters(tiny):
    """Settings reach the engine in one checked object: a name, a dict or a verifier parameter by keyword is refused
    at once, and a built part cannot stand beside the spec's own choice of it."""
    from speculate.drafters.lookup import LookupDrafter
    from speculate.verifiers import get_verifier

    with pytest.raises(TypeError, match="spec must be a SpeculativeSpec"):
        SpeculativeDecoder(tiny[0], "lookup")
    with pytest.raises(TypeError, match="spec must be a SpeculativeSpec"):
        SpeculativeDecoder(tiny[0], {"drafter": "lookup"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'eps'"):
        SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", verifier="consultant"), eps=2.0)
    with pytest.raises(TypeError, match="in place of the spec's drafter"):
        SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup"), drafter=LookupDrafter())
    with pytest.raises(TypeError, match="in place of the spec's drafter"):
        SpeculativeDecoder(tiny[0], drafter="lookup")
    with pytest.raises(TypeError, match="in place of the spec's verifier"):
        SpeculativeDecoder(tiny[0], SpeculativeSpec(verifier="greedy"), verifier=get_verifier("greedy"))
    with pytest.raises(TypeError, match="in place of the spec's verifier"):
        SpeculativeDecoder(tiny[0], SpeculativeSpec(params={"eps": 2.0}), verifier=get_verifier("greedy"))
    # 'auto' for a parameter of no named verifier is the spec's error, as on every other path
    with pytest.raises(SpeculateError, match="eps 'auto' .* needs the verifier 'consultant'"):
        SpeculativeSpec("lookup", params={"eps": "auto"})
    built = SpeculativeDecoder(tiny[0], SpeculativeSpec(verifier="greedy", k=2), drafter=LookupDrafter(max_ngram=2))
    assert (built.drafter.max_ngram, built.spec.k, built.spec.verifier) == (2, 2, "greedy")
    default = SpeculativeDecoder(tiny[0])  # the defaults: auto (lookup on a model without a shipped store), k = 6
    assert (default.spec.drafter, default.drafter.name, default.spec.k) == ("lookup", "lookup", 6)


def test_the_factory_builds_the_specs_drafter_and_verifier(tiny):
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("lookup", ["max_ngram=5"], "consultant", {"eps": 2}, 3))
    assert decoder.drafter.name == "lookup" and decoder.drafter.max_ngram == 5 and decoder.spec.k == 3
    assert decoder.spec.verifier_params == {"eps": 2.0}
    model = SpeculativeDecoder(tiny[0], SpeculativeSpec("model+lookup", ["lookup_k=4"]), draft_model=tiny[0])
    assert model.drafter.name == "model+lookup" and model.drafter.lookup_k == 4
