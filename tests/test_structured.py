"""Structured output (speculate/grammar.py, llguidance): every answer parses and follows its JSON schema, and greedy
constrained answers are token-identical with and without speculation (20 schemas of different shapes; chain and tree
drafts, drafts all accepted or mostly rejected; a draft model drafting under the grammar too); sampling stays lossless with respect to the
constrained distribution."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch
from scipy.stats import chi2_contingency

from speculate import SamplingParams, SpeculateError, SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters.base import Draft, Drafter
from speculate.grammar import json_schema_grammar

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**OBJ, "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "boolean"}}, "required": ["a", "b"]},
    {**OBJ, "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]},
    {**OBJ, "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]},
    {**OBJ, "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "minItems": 1, "maxItems": 3}}, "required": ["xs"]},
    {**OBJ, "properties": {"p": {**OBJ, "properties": {"q": {"type": "boolean"}}, "required": ["q"]}},
     "required": ["p"]},
    {**OBJ, "properties": {"k": {"anyOf": [{"type": "null"}, {"enum": [1, 2, 3]}]}}, "required": ["k"]},
    {**OBJ, "properties": {"c": {"const": "fixed"}, "d": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["c"]},
    {**OBJ, "properties": {"t": {"type": "string", "pattern": "^[a-c]{2,4}$"}}, "required": ["t"]},
    {**OBJ, "properties": {"i": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["i"]},
    {**OBJ, "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        **OBJ, "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["id"]}}},
     "required": ["rows"]},
    {**OBJ, "properties": {"month": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}}, "required": ["month"]},
    {**OBJ, "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     "required": ["flags"]},
    {**OBJ, "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "string", "maxLength": 3}},
     "required": ["a"]},
    {**OBJ, "properties": {"x": {**OBJ, "properties": {"y": {**OBJ, "properties": {"z": {"enum": ["u", "w"]}},
                                                             "required": ["z"]}}, "required": ["y"]}},
     "required": ["x"]},
    {**OBJ, "properties": {"v": {"enum": ["a", 1, True, None]}}, "required": ["v"]},
    {**OBJ, "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                     {"enum": ["p", "q"]}], "items": False}},
     "required": ["pair"]},
    {"type": "array", "items": {"enum": ["r", "g", "b"]}, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no"]},
    {"$defs": {"d": {"type": "integer", "minimum": 0, "maximum": 3}}, **OBJ,
     "properties": {"m": {"$ref": "#/$defs/d"}, "n": {"$ref": "#/$defs/d"}}, "required": ["m", "n"]},
    {**OBJ, "properties": {"tag": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                           "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 10, "maximum": 12}},
     "required": ["tag", "ok", "n"]},
]


@pytest.fixture(scope="module", params=["int8", "q4"])
def target(request, tiny_folders):
    folder = tiny_folders[0] if request.param == "int8" else tiny_folders[2]
    return load_model(str(folder), dtype=request.param)


class Oracle(Drafter):
    """Drafts the answer it is told (so every chain draft is accepted: the masks of drafts' rows decide), or a tree of
    that answer with, at each depth, a sibling of another token (rows of paths the grammar may forbid)."""

    name = "oracle"

    def __init__(self, answer: list[int], prompt_tokens: int, tree: bool = False):
        self.answer, self.prompt_tokens, self.tree = answer, prompt_tokens, tree

    def max_nodes(self, k: int) -> int:
        return 2 * k if self.tree else k

    def propose(self, tokens, k):
        chain = self.answer[len(tokens) - self.prompt_tokens:][:k]
        if not self.tree:
            return Draft(torch.tensor(chain, dtype=torch.long))
        nodes, parents, parent = [], [], -1
        for token in chain:
            nodes += [token, token + 1]
            parents += [parent, parent]
            parent = len(nodes) - 2
        return Draft(torch.tensor(nodes, dtype=torch.long), parents=parents)


def answer(target, drafter, schema, prompt, **kwargs):
    draft = target if drafter == "model" else None
    built = None if isinstance(drafter, str) else drafter  # (a name, or a drafter of the tests' own)
    spec = SpeculativeSpec("auto" if built else drafter, k=4)
    decoder = SpeculativeDecoder(target, spec, drafter=built, draft_model=draft)
    return decoder.generate(prompt, SamplingParams(max_new_tokens=64, grammar=json_schema_grammar(schema), **kwargs))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_answer_follows_its_schema_and_speculation_changes_no_token(target, index):
    schema = SCHEMAS[index]
    for prompt in ([5, 6, 7, 8], [40, 41, 40, 41, 40]):
        plain = answer(target, "none", schema, prompt)
        assert plain.finish_reason == "stop"
        jsonschema.validate(json.loads(plain.text), schema)
        # Drafts the grammar mostly forbids (lookup), and the answer itself as a chain (every draft accepted) and as a
        # tree with a sibling at each depth.
        drafters = ["lookup", Oracle(plain.token_ids, len(prompt)), Oracle(plain.token_ids, len(prompt), True)]
        for drafter in drafters:
            spec = answer(target, drafter, schema, prompt)
            assert spec.token_ids == plain.token_ids, drafter
            if isinstance(drafter, Oracle):
                assert spec.stats.accepted_draft_tokens >= len(plain.token_ids) - spec.stats.target_calls > 0
        # The target as its own draft model, drafting under the grammar too: every draft accepted.
        spec = answer(target, "model", schema, prompt)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted_draft_tokens == spec.stats.drafted_tokens > len(plain.token_ids) // 2


def test_sampling_stays_lossless_under_the_grammar(target):
    """The first token of the value is drawn from the constrained distribution: the same with a draft model that
    proposes freely (its drafts often forbidden) as without speculation (chi-square over 400 draws each)."""
    schema = {**OBJ, "properties": {"v": {"enum": ["a", "b", "c", "d", "e"]}}, "required": ["v"]}
    counts = {}
    for drafter in ("none", "model"):
        seen = {}
        for seed in range(400):
            text = answer(target, drafter, schema, [9, 10, 11], temperature=1.0, seed=seed).text
            value = json.loads(text)["v"]
            seen[value] = seen.get(value, 0) + 1
        counts[drafter] = seen
    keys = sorted(set(counts["none"]) | set(counts["model"]))
    table = [[counts[d].get(k, 0) for k in keys] for d in ("none", "model")]
    assert len(keys) >= 3 and chi2_contingency(table).pvalue > 1e-3


def test_a_bad_schema_is_one_clear_error():
    with pytest.raises(SpeculateError, match="the JSON schema cannot be used: .*objectx"):
        json_schema_grammar({"type": "objectx"})


def test_the_openai_client_gets_json_that_follows_its_schema(target):
    import openai

    from speculate.server import ServerConfig, create_app
    from speculate.server.background import BackgroundServer
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(target.path), dtype=target.dtype, spec=SpeculativeSpec("lookup", k=4), max_batch=2)
    server = BackgroundServer(create_app(config, target))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        for schema in SCHEMAS + [None]:  # (the 20 shapes through the client, and json_object)
            fmt = ({"type": "json_object"} if schema is None else
                   {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
            texts = []
            for drafter in ("none", "lookup"):
                c = client.chat.completions.create(model=config.model, messages=[{"role": "user", "content": "JSON?"}],
                                                   max_tokens=64, temperature=0, response_format=fmt,
                                                   extra_body={"speculative": {"drafter": drafter}}).choices[0]
                texts.append(c.message.content)
                if schema is None and c.finish_reason == "length":  # any object: a random model may not close it
                    continue
                assert c.finish_reason == "stop"
                jsonschema.validate(json.loads(c.message.content), schema or {"type": "object"})
            assert texts[0] == texts[1]
        # /v1/completions takes response_format too (vLLM's server does): the same constraint on a plain prompt
        schema = SCHEMAS[0]
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        texts = []
        for drafter in ("none", "lookup"):
            c = client.completions.create(model=config.model, prompt="JSON: ", max_tokens=64, temperature=0,
                                          extra_body={"response_format": fmt, "speculative": {"drafter": drafter}}
                                          ).choices[0]
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
            texts.append(c.text)
        assert texts[0] == texts[1]
        plain = client.completions.create(model=config.model, prompt="JSON: ", max_tokens=64, temperature=0).choices[0]
        assert plain.text != texts[0]  # (unconstrained, this random model writes no such JSON)
        bad = httpx.post(server.url + "/v1/completions", json={"model": config.model, "prompt": "x",
                                                              "response_format": {"type": "yaml"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    finally:
        server.stop()


def test_the_command_line_takes_a_schema(tiny_folders, tmp_path, capsys):
    from speculate.cli import main

    schema = SCHEMAS[0]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    model = ["--model", str(tiny_folders[0]), "--max-new-tokens", "64", "--no-chat", "--json"]
    texts = []
    for given in (str(tmp_path / "schema.json"), json.dumps(schema)):
        assert main(["generate", "abc", *model, "--json-schema", given]) == 0
        out = json.loads(capsys.readouterr().out)
        jsonschema.validate(json.loads(out["text"]), schema)
        texts.append(out["text"])
    assert texts[0] == texts[1]
    for bad, message in ((str(tmp_path / "missing.json"), "cannot read"), ("{not json", "not JSON"),
                         ('{"type": "objectx"}', "cannot be used")):
        assert main(["generate", "abc", *model, "--json-schema", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_the_bitmask_unpacks_bit_by_bit():
    """grammar.unpack against a bit-by-bit reading (bit 31 set too: negative int32 words), a padded width."""
    from speculate.grammar import unpack

    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32, generator=gen)
    got = unpack(bits, 140)
    want = [[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) if t < 128 else False for t in range(140)]
            for r in range(3)]
    assert got.tolist() == want


def test_langchain_chat_openai_against_the_server(target):
    """LangChain's ChatOpenAI, as an agent framework drives an OpenAI-compatible server: invoke, stream (with usage,
    which LangChain adds up chunk by chunk: it counted a stream's usage twice while the finish chunk carried it too),
    batch, and with_structured_output through a JSON schema; speculation changes no greedy answer."""
    langchain_openai = pytest.importorskip("langchain_openai")

    from speculate.server import ServerConfig, create_app
    from speculate.server.background import BackgroundServer
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model=str(target.path), dtype=target.dtype, spec=SpeculativeSpec("lookup", k=4), max_batch=4)
    server = BackgroundServer(create_app(config, target))

    def chat(drafter: str, max_tokens: int = 24, **kwargs):
        return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=config.model,
                                           temperature=0, max_tokens=max_tokens, max_retries=0, timeout=60,
                                           extra_body={"speculative": {"drafter": drafter}}, **kwargs)

    try:
        prompts = ["abc abc abc", "Name three colours.", "1 2 3 4"]
        whole = {d: [chat(d).invoke(p) for p in prompts] for d in ("none", "lookup")}
        assert [m.content for m in whole["none"]] == [m.content for m in whole["lookup"]]
        for m in whole["lookup"]:
            usage = m.usage_metadata
            assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
        # a stream adds up to the whole answer, and its usage (counted once) to the whole answer's usage
        streamed = None
        for chunk in chat("lookup", stream_usage=True).stream(prompts[0]):
            streamed = chunk if streamed is None else streamed + chunk
        assert streamed.content == whole["lookup"][0].content
        keys = ("input_tokens", "output_tokens", "total_tokens")
        assert [streamed.usage_metadata[k] for k in keys] == [whole["lookup"][0].usage_metadata[k] for k in keys]
        # a batch (concurrent requests, batched by the server) answers each prompt as it is answered alone
        assert [m.content for m in chat("lookup").batch(prompts)] == [m.content for m in whole["none"]]
        # structured output: LangChain sends response_format json_schema and parses the answer itself
        schema = {"title": "answer", "description": "an answer", **SCHEMAS[0]}
        answers = [chat(d, max_tokens=64).with_structured_output(schema, method="json_schema", strict=True)
                   .invoke("JSON?") for d in ("none", "lookup")]
        jsonschema.validate(answers[0], SCHEMAS[0])
        assert answers[0] == answers[1]
    finally:
        server.stop()
