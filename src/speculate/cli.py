"""``speculate``: the command line. Bad input gets one line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import SpeculateError, SpeculateWarning

K_HELP = ("draft length per round (default 6: a target forward over 7 tokens costs far less than 7 forwards "
          "over one, so long drafts pay where they are accepted; measured in docs/benchmarks.md, "
          "\"Verification cost T(n)\")")
K_AUTO_HELP = K_HELP[:-1] + ("; 'auto': per round, the k with the best predicted speedup on this machine's "
                             "measured cost curve at the acceptance rate seen so far)")
DTYPE_HELP = ("weight precision: fp32, bf16 (weights rounded to bfloat16; fp32 sums in the kernel), int8 "
              "(ours: SmoothQuant, per-row int8), q4 (a GGUF's own 4-bit blocks; other folders quantized to Q4_1), "
              "q4a8 (q4 with 8-bit activations as llama.cpp runs them: faster batches and prefill, answers not "
              "fp32's; its own quality gate per model) or auto (default: q4 for a model that ships as a GGUF q4 "
              "reads, the default model among them; else fp32)")

def _either(names) -> str:
    """``a, b or c``."""
    names = list(names)
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _drafters_help() -> str:
    """--drafter's help, from the drafters' declarations: what ``auto`` picks, each drafter's summary and the names
    of its variants."""
    from .drafters import AUTO_PICKS, drafter_classes

    lines = []
    for cls in drafter_classes():
        named = [f"{v.name}={str(not v.default).lower()}: {cls.variant_name(**{v.name: not v.default})}"
                 for v in cls.variants]
        lines.append(f"{cls.name}: {cls.summary}" + (f" ({', '.join(named)})" if named else ""))
    return f"default auto: {AUTO_PICKS}. " + "; ".join(lines)


def _drafter_opt_help() -> str:
    """--drafter-opt's help, from the drafters' declarations (what parse_options checks against): each name's
    options with their defaults, and the variants' true/false options."""
    from .drafters import DRAFTERS, drafter_classes

    takes = "; ".join(f"{name}: " + ", ".join(p.name if p.default is None else f"{p.name}={p.default}"
                                               for p in entry.params)
                      for name, entry in DRAFTERS.items() if entry.params)
    switches: dict[str, list[str]] = {}
    for cls in drafter_classes():
        if cls.variants:
            text = " and ".join(f"{v.name}={str(not v.default).lower()} (the {v.suffix} names)" for v in cls.variants)
            switches.setdefault(text, []).append(cls.name)
    also = "".join(f" {' and '.join(names)} also take {text}." for text, names in switches.items())
    return f"a drafter option (repeatable).{also} Options by drafter (=default) — {takes}"


def _count_arg(value: str) -> int:
    """A whole number >= 0 (argparse names the flag in its one-line error)."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {count}")
    return count


def _k_arg(value: str):
    from .policy.draft_length import parse_k

    try:
        return parse_k(value)
    except SpeculateError as e:  # argparse shows an ArgumentTypeError's own message (others: "invalid _k_arg")
        raise argparse.ArgumentTypeError(str(e)) from None


def _drafter_arg(value: str) -> str:
    from .drafters import check_name

    try:  # (not argparse's choices: the same text as a request's or a bench method's unknown drafter)
        return check_name(value)
    except SpeculateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _verifier_param_arg(name: str):
    """``--NAME``'s argparse type for a verifier parameter (``verifiers.PARAMS``): a number, or 'auto' where
    a verifier declares it. Its range depends on the verifier, so the spec checks it (``SpeculativeSpec``, by the
    declaration itself) once the verifier is known."""
    from .params import as_bool
    from .verifiers import AUTO, PARAMS, is_auto

    declared = [param for _, param in PARAMS[name]]
    auto = any(param.auto for param in declared)
    flag = "--" + name.replace("_", "-")

    def parse(value: str):
        if auto and is_auto(value):
            return AUTO
        if declared[0].kind is bool:
            if as_bool(value) is not None:
                return as_bool(value)
            raise argparse.ArgumentTypeError(f"{flag} must be true or false, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number{' or auto' if auto else ''}, "
                                             f"got {value!r}") from None

    parse.__name__ = name  # (argparse names the type in some messages)
    return parse


def _add_verifier_params(parser: argparse.ArgumentParser) -> None:
    """One flag per verifier parameter, from the verifiers' declarations (a new verifier's appear here)."""
    from .verifiers import PARAMS, param_help

    for name in PARAMS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_verifier_param_arg(name),
                            help=param_help(name))


class _HelpFormatter(argparse.HelpFormatter):
    """Each flag's default in its help: ``(default: VALUE)`` where the help does not already say it (``off`` for a
    switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, argparse.SUPPRESS)
                and "default" not in text and "%(default)" not in text):
            text += " (default: off)" if action.default is False else " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)  # (every subcommand's parser too)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, not usage + message
        raise SpeculateError(message)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if getattr(namespace, "command", None) in ("generate", "serve"):  # (the top-level parse, once)
            namespace.spec = _spec(namespace)
        return namespace, extras


def _spec(args):
    """``generate``'s and ``serve``'s speculative flags as one checked :class:`~speculate.spec.SpeculativeSpec`,
    made as the flags are parsed, so that bad settings stop the command before any model loads. ``generate``
    names its verifier (the default at its temperature where none is given), so the parameters are checked against
    the verifier that will run; ``serve``'s stays open, each request's temperature choosing it."""
    from .spec import SpeculativeSpec

    spec = SpeculativeSpec.from_cli(args)
    return spec.with_verifier(args.temperature == 0) if args.command == "generate" else spec


def _add_speculative_flags(parser: argparse.ArgumentParser, serving: bool) -> None:
    """The flags ``generate`` and ``serve`` share: the model, its precision and the speculative settings (for
    ``serve``, the defaults of requests that give none)."""
    from .drafters import ALL_DRAFTERS, MODEL_DRAFTERS, drafter_classes
    from .models import ALIASES, CHOICES, DEFAULT_MODEL
    from .verifiers import VERIFIERS

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"target model: an alias ({', '.join(ALIASES)}) or a local Hugging Face folder (default "
                             f"{DEFAULT_MODEL})" + ("; also the model id clients must send" if serving else ""))
    parser.add_argument("--drafter", default="auto", type=_drafter_arg, metavar="{" + ",".join(ALL_DRAFTERS) + "}",
                        help=("default drafter for requests; " if serving else "") + _drafters_help())
    if not serving:
        with_heads = " / ".join(cls.name for cls in drafter_classes() if any(p.name == "heads" for p in cls.params))
        parser.add_argument("--heads", metavar="DIR", help=f"heads folder for {with_heads} (default: the shipped ones)")
    parser.add_argument("--drafter-opt", action="append", metavar="KEY=VALUE", help=_drafter_opt_help())
    parser.add_argument("--draft-model", help=f"draft model for --drafter {_either(MODEL_DRAFTERS)}: an alias or a "
                                              "folder sharing the target's tokenizer"
                                              + (" (loaded once, shared by requests)" if serving else ""))
    parser.add_argument("--verifier", choices=list(VERIFIERS),
                        help=("default verifier; " if serving else "")
                        + "default greedy at temperature 0, sample (lossless) otherwise")
    parser.add_argument("--k", type=_k_arg, default=6, help=K_AUTO_HELP)
    _add_verifier_params(parser)  # --eps, --beta, --delta, --D, ...: each verifier's declared parameters
    parser.add_argument("--dtype", default="auto", choices=list(CHOICES), help=DTYPE_HELP)


def _parser() -> argparse.ArgumentParser:
    from .models import CHOICES

    p = _Parser(prog="speculate", description="Speculative decoding for LLMs, offline.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate text with speculative decoding and print its speed statistics.")
    g.add_argument("prompt", help="the prompt (the user turn of a chat, unless --no-chat)")
    _add_speculative_flags(g, serving=False)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) means greedy")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: draw from the fewest most likely tokens whose probabilities add up to "
                        "TOP_P, in (0, 1]; 1 means off")
    g.add_argument("--top-k", type=int, default=0, help="0 (default) means off")
    g.add_argument("--max-new-tokens", type=_count_arg, default=256,
                   help="the most tokens to generate (the prompt and these must fit the model's context window)")
    g.add_argument("--seed", type=int, help="seed for every random draw (reproducible runs), in [0, 2^63) as a "
                                            "server request's (default: a random one)")
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    g.add_argument("--json-schema", metavar="FILE_OR_JSON",
                   help="structured output: the answer is a JSON document following this schema (a file, or the "
                        "schema itself; '{}' for any JSON object), every token checked by the grammar")
    g.add_argument("--draft-dtype", choices=list(CHOICES), help="the draft model's precision (default: --dtype)")
    g.add_argument("--no-chat", action="store_true", help="send the raw prompt, without the chat template")
    g.add_argument("--stream", action="store_true", help="print text as it is generated")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    g.add_argument("--compare", action="store_true",
                   help="then decode the same prompt plainly (no drafter, the same model and sampling) and print how "
                        "much faster speculation was and whether its text is the same")

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                   "/metrics over HTTP. Models load once, before the server listens.")
    _add_speculative_flags(s, serving=True)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: loopback only; 0.0.0.0 exposes the server)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host (and Origin) name to serve besides loopback ones; repeatable. Bound to loopback, "
                        "any other Host is refused (DNS rebinding); bound elsewhere, the list, if given, is the "
                        "only names served")
    s.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes; repeatable, each key a tenant of its own "
                        "(default: $SPECULATE_API_KEY, comma-separated, if set, else no key)")
    s.add_argument("--share-drafts", action="store_true",
                   help="drafters that learn from served answers (suffix) draft for every API key from every key's "
                        "answers; by default each key's answers draft for that key only")
    s.add_argument("--no-draft-gate", action="store_true",
                   help="draft as the batch planner plans, without timing rounds with and without drafts to withhold "
                        "those that measure slower (the gate's rates are still on /metrics)")
    s.add_argument("--max-batch", type=int, default=8,
                   help="generations running at once, their rows verified in one forward per round (continuous "
                        "batching; default 8)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait for a place in the batch; beyond that the server answers 429 "
                        "(default 16)")
    s.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens a joining request feeds per round, so that a long prompt does not stall the "
                        "others (default 128)")
    s.add_argument("--prefill-budget", type=int,
                   help="prompt tokens all joining requests feed per round together, the shortest remaining prompt "
                        "first; at most half of --max-batch prompts longer than this prefill at once, shorter ones "
                        "admitted past them (default: 2 x --prefill-chunk)")
    s.add_argument("--max-tokens", type=int, default=2048,
                   help="a request's new tokens at most, and the default where it asks for none (a completion's "
                        "default stays OpenAI's 16); 0: the context window (default 2048)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest accepted request body in bytes; larger is 413 (default 1048576: 1 MiB)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a client has to send a request's headers, from connecting or from its previous "
                        "response; then the connection is closed (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's body; then 408 (default 30)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle connection is kept open after a response (default 5)")
    s.add_argument("--max-connections", type=int, default=100,
                   help="open connections at most; past it the one idle the longest is closed, or the new one where "
                        "none is idle (default 100)")
    s.add_argument("--max-connections-per-client", type=int,
                   help="open connections from one address at most, its own idle ones closed first (default: half "
                        "of --max-connections; 0: no limit, e.g. behind a proxy)")
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="on SIGTERM or Ctrl-C: seconds running generations get to finish before they end with an "
                        "error (a stream: an error event, then [DONE]); queued requests get 503 at once (default 10)")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt whole (default: a prompt takes the KV blocks of the prefix it shares "
                        "with any earlier request's prompt and answer, whatever its speculative settings)")
    s.add_argument("--prefix-cache-gib", type=float, default=1.0,
                   help="memory for the KV blocks shared by all requests, whatever their speculative settings "
                        "(GiB; the least recently used go first; default 1)")
    s.add_argument("--kv-memory", type=float, default=None, metavar="GIB",
                   help="KV cache the running requests may fill together (GiB; a request joins the batch when its "
                        "prompt and a first stretch of output fit, and grows a stretch at a time; where memory runs "
                        "out the youngest is preempted and resumes later; one whose prompt and max tokens never fit "
                        "is refused; default: half the memory available at start; 0: no limit)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log messages shown, from this level up")
    r = s.add_argument_group("Ray Serve (pip install -e '.[ray]'; docs/server.md, \"Beyond one machine\")")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: the same API from several replicas, each one engine with its own "
                        "generation thread, behind Ray's HTTP proxy on --host:--port")
    r.add_argument("--replicas", type=_count_arg, default=2, help="engine replicas (default 2)")
    r.add_argument("--min-replicas", type=int, help="with --max-replicas: let Ray's autoscaler choose the count")
    r.add_argument("--max-replicas", type=int, help="with --min-replicas: the autoscaler's upper bound")
    r.add_argument("--target-ongoing", type=float,
                   help="requests per replica the autoscaler aims at (default: --max-batch)")
    r.add_argument("--replica-threads", type=_count_arg, default=1,
                   help="torch threads of each replica, and the Ray CPUs it reserves (default 1)")
    r.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster ('auto': the one `ray start` made on this machine); default: start "
                        "a local Ray instance and stop it on exit")
    r.add_argument("--router", choices=["affinity", "default"], default="affinity",
                   help="affinity: a request goes to the replica that served its prompt's longest known prefix "
                        "unless that one is saturated; default: Ray's power of two choices (default affinity)")

    from .calc.command import add_arguments as add_calc_arguments

    add_calc_arguments(sub.add_parser(
        "calc", help="speedup arithmetic: the lesson's model, acceptance, measured cost curves, ε",
        description="Expected speedup of speculative decoding (the lesson's approximation and the exact "
                    "model), α and the residual of two distributions, T(n)/T(1) measured on this machine "
                    "with the best k per α, or Consultant Decoding's ε from the Chinchilla law. One per run."))

    from .heads.command import add_arguments as add_heads_arguments

    add_heads_arguments(sub.add_parser(
        "train-heads", help="train Medusa heads or an EAGLE head on a target's own hidden states",
        description="Self-distillation: the target answers a prompt set, its hidden states are cached, and "
                    "draft heads are trained on them (resumable; writes safetensors + config.json)."))

    from .answers import add_arguments as add_answers_arguments

    add_answers_arguments(sub.add_parser(
        "train-answers", help="build the retrieval drafter's answer store from a target's own answers",
        description="The target answers the self-distillation prompt set (greedy; cached, shared with train-heads) "
                    "and its answers become an n-gram table the retrieval drafter drafts from (no training)."))

    from .bench.command import add_arguments as add_bench_arguments

    add_bench_arguments(sub.add_parser(
        "bench", help="measure methods against plain decoding and Hugging Face on HumanEval, GSM8K, MT-Bench",
        description="Run a matrix of methods over datasets, interleaved, resumable: speedup, LLM-calls ratio, "
                    "acceptance length and position, quality normalised to the target's greedy output "
                    "(markdown, CSV, plots)."))
    return p


def stats_line(method: str, s, k) -> str:
    """``generate``'s speed statistics on one line. Acceptance is by draft position 1..N, N the longest draft seen:
    past k where a drafter drafts longer copies than k (lookup, retrieval)."""
    acc = [round(a, 2) for a in s.acceptance_by_position]
    past = f", past k = {k}: this drafter's copies grow longer than k" if isinstance(k, int) and len(acc) > k else ""
    where = f"acceptance by draft position (1..{len(acc)}{past}) {acc}" if acc else "no drafts"
    return (f"[{method}] {s.new_tokens} tokens in {s.wall_seconds:.2f} s ({s.tokens_per_second:.1f} tokens/s), "
            f"{s.target_calls} target calls, {s.mean_accepted_length:.2f} tokens per call, {where}")


def _generate(args) -> int:
    from .engine import SpeculativeDecoder
    from .models import load_model
    from .sampling import SamplingParams, check_seed
    from .spec import SpeculativeSpec
    from .text import check_text_prompt

    # Every check that needs no model, before any model loads.
    grammar = _schema_grammar(args.json_schema) if args.json_schema else None
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, check_seed(args.seed), args.max_new_tokens,
                              args.stop or (), grammar=grammar)
    check_text_prompt(args.prompt)
    spec = args.spec  # drafter, options, verifier and its parameters, k: checked as the flags were parsed
    if args.stream and args.json:  # one JSON object at the end cannot also be a stream of text
        raise SpeculateError("--stream and --json: choose one")
    if args.draft_dtype and not args.draft_model:
        raise SpeculateError("--draft-dtype is the draft model's precision: it needs --draft-model")
    target = load_model(args.model, dtype=args.dtype)
    draft = load_model(args.draft_model, dtype=args.draft_dtype or args.dtype) if args.draft_model else None
    decoder = SpeculativeDecoder(target, spec, draft_model=draft)
    chat = False if args.no_chat else None
    plain = SpeculativeDecoder(target, SpeculativeSpec("none")) if args.compare else None
    if plain is not None:  # both warmed up alike on another prompt: neither pays a first call's costs in the timing
        for d in (decoder, plain):
            d.generate("Hi.", max_new_tokens=2, chat=chat)
    stream = decoder.stream(args.prompt, sampling, chat=chat)
    for piece in stream:
        if args.stream:
            print(piece, end="", flush=True)
    gen = stream.generation
    base = plain.generate(args.prompt, sampling, chat=chat) if plain is not None else None
    if args.json:
        out = {"text": gen.text, "token_ids": gen.token_ids, "finish_reason": gen.finish_reason,
               "stats": gen.stats.to_dict()}
        if base is not None:
            out["plain"] = {"text": base.text, "token_ids": base.token_ids, "stats": base.stats.to_dict(),
                            "speedup": round(speedup(gen.stats, base.stats), 3)}
        print(json.dumps(out))
        return 0
    print(("" if args.stream else gen.text), flush=True)
    print("\n" + stats_line(spec.label(), gen.stats, spec.k), file=sys.stderr)
    if base is not None:
        print(compare_line(gen, base, args.temperature == 0), file=sys.stderr)
    return 0


def _schema_grammar(value: str) -> str:
    """--json-schema: a file holding a JSON schema, or the schema's JSON itself."""
    from pathlib import Path

    from .grammar import json_schema_grammar

    text = value
    if not value.lstrip().startswith("{"):
        try:
            text = Path(value).read_text()
        except OSError as e:
            raise SpeculateError(f"--json-schema: cannot read {value} ({e.strerror or e})") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise SpeculateError(f"--json-schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise SpeculateError("--json-schema: a schema is a JSON object")
    return json_schema_grammar(schema or None)


def speedup(spec_stats, plain_stats) -> float:
    """Walltime speedup over plain decoding: tokens per second, speculative over plain (the paper's measure)."""
    return spec_stats.tokens_per_second / max(plain_stats.tokens_per_second, 1e-9)


def compare_line(gen, base, greedy: bool) -> str:
    """``--compare``'s line: plain decoding's speed, the speedup, and whether the tokens are the same (at
    temperature 0 lossless verifiers must give plain decoding's tokens; sampling gives the same distribution, not
    the same draws)."""
    from .models.quality import first_difference

    s = base.stats
    if gen.token_ids == base.token_ids:
        same = "the same tokens"
    elif greedy:
        same = f"different tokens from token {first_difference(gen.token_ids, base.token_ids) + 1} (a lossy verifier)"
    else:
        same = "different tokens (sampling: the same distribution, not the same draws)"
    return (f"[plain] {s.new_tokens} tokens in {s.wall_seconds:.2f} s ({s.tokens_per_second:.1f} tokens/s): "
            f"speculative decoding was {speedup(gen.stats, s):.2f}x as fast, {same}")


def _serve(args) -> int:
    from .server import ServerConfig, serve

    config = ServerConfig.from_cli(args)
    if not args.ray:
        serve(config, log_level=args.log_level)
        return 0
    try:
        from .server.ray_serve import RayOptions, serve_on_ray
    except ImportError as e:
        raise SpeculateError(f"--ray needs Ray Serve ({e}): pip install -e '.[ray]'") from None
    serve_on_ray(config, RayOptions.from_cli(args), log_level=args.log_level)
    return 0


def _calc(args) -> int:
    from .calc.command import run

    return run(args)


def _train_heads(args) -> int:
    if args.kind == "answers":  # the former spelling of train-answers
        return _train_answers(args)
    from .heads.command import run

    return run(args)


def _train_answers(args) -> int:
    from .answers import run

    return run(args)


def _bench(args) -> int:
    from .bench.command import run

    return run(args)


def _one_line_warnings(show):
    """``warnings.showwarning`` that prints our own warnings (SpeculateWarning) as one line, as errors are."""
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, SpeculateWarning):
            print(f"speculate: warning: {message}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)
    return showwarning


def main(argv: list[str] | None = None) -> int:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            args = _parser().parse_args(argv)
            return {"generate": _generate, "serve": _serve, "calc": _calc, "bench": _bench,
                    "train-heads": _train_heads, "train-answers": _train_answers}[args.command](args)
    except SpeculateError as e:
        print(f"speculate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("speculate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
