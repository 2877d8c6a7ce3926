"""What a chat's second turn finds cached: MT-Bench conversations of two turns through the server, the second turn
carrying the first and its answer, with the same speculative settings in both turns or other ones:

    python benchmarks/probes/chat_turns.py [--conversations 16] [--max-tokens 64] [--dtype q4]

One server (the app as `speculate serve` builds it, defaults: the prefix store on), one client, each conversation's
two turns one after the other, greedy, streamed. ``same``: both turns `lookup` k 6; ``other``: turn 1 `none`, turn 2
`lookup` k 3 with `consultant`. Printed per case: the second turns' median TTFT, the prompt tokens they found cached
(``usage.prompt_tokens_details``) over their prompt tokens, and a digest of all answers (greedy: two versions of the
server that agree give the same digest). Run it with ``PYTHONPATH=<another tree>/src`` to measure another version.
"""

import argparse
import hashlib
import json
import statistics

CASES = {"same": ({"drafter": "lookup", "k": 6}, {"drafter": "lookup", "k": 6}),
         "other": ({"drafter": "none"}, {"drafter": "lookup", "k": 3, "verifier": "consultant"})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="q4")
    a = p.parse_args()

    import httpx

    from speculate.bench.client import chat
    from speculate.bench.datasets import load_dataset
    from speculate.bench import machine_header
    from speculate.server import ServerConfig
    from speculate.server.background import BackgroundServer
    from speculate.server.main import build_app
    from speculate.spec import SpeculativeSpec

    machine = machine_header()
    model = "smollm2-135m-instruct"
    server = BackgroundServer(build_app(ServerConfig(model=model, dtype=a.dtype, spec=SpeculativeSpec("lookup"),
                                                     max_batch=4)))
    samples = load_dataset("mt_bench", limit=2 * a.conversations + 1, shots=0)
    out = {**machine, "dtype": a.dtype, "conversations": a.conversations, "max_tokens": a.max_tokens}
    try:
        with httpx.Client() as http:
            def turn(messages, speculative):
                body = {"model": model, "max_tokens": a.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, "speculative": speculative, "messages": messages}
                answer, _ = chat(http, server.url, body)
                return answer["ttft"], answer["choices"][0]["message"]["content"], answer["usage"]

            turn([{"role": "user", "content": samples[-1].turns[0]}], CASES["same"][0])  # warm-up, not counted
            for c, (case, (first, second)) in enumerate(CASES.items()):
                ttfts, cached, prompt, texts = [], 0, 0, []
                # Each case has conversations of its own: a conversation's first turn is new to the server.
                for s in samples[c * a.conversations: (c + 1) * a.conversations]:
                    messages = [{"role": "user", "content": s.turns[0]}]
                    _, text, _ = turn(messages, first)
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": s.turns[1]}]
                    ttft, answer, usage = turn(messages, second)
                    ttfts.append(ttft)
                    cached += usage["prompt_tokens_details"]["cached_tokens"]
                    prompt += usage["prompt_tokens"]
                    texts += [text, answer]
                out[case] = {"second_turn_ttft_median": round(statistics.median(ttfts), 4),
                             "second_turn_cached": f"{cached}/{prompt}",
                             "digest": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:12]}
    finally:
        server.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
