"""Prometheus metrics, in a registry of the app's own (several apps can live in one process).

Token and pass counters count finished generations (a cancelled one has no statistics); requests are
counted by endpoint and HTTP status, with 499 for a client that went away before its answer was complete.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..engine import Generation

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
OUTCOME_KEY = "speculate.outcome"  # ASGI scope key: a dict where a handler can override the counted status


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("speculate_requests", "HTTP requests to /v1 endpoints, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("speculate_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("speculate_generated_tokens",
                                        "Tokens generated (usage.completion_tokens) by finished generations",
                                        registry=r)
        self.target_calls = Counter("speculate_target_forward_passes",
                                    "Target model forward passes after the prefill (one per speculative round)",
                                    registry=r)
        self.drafted = Counter("speculate_drafted_tokens", "Draft tokens proposed to the target", registry=r)
        self.accepted = Counter("speculate_accepted_tokens", "Draft tokens the verifier accepted", registry=r)
        self.drafted_by_position = Counter("speculate_drafted_tokens_by_position",
                                           "Rounds that drafted a token at this draft position (1 = first)",
                                           ["position"], registry=r)
        self.accepted_by_position = Counter("speculate_accepted_tokens_by_position",
                                            "Rounds that accepted the draft token at this position (1 = first)",
                                            ["position"], registry=r)
        self.mean_accepted_length = Gauge("speculate_mean_accepted_length",
                                          "Generated tokens per target forward pass, over all finished generations",
                                          registry=r)
        self.ttft = Histogram("speculate_time_to_first_token_seconds",
                              "From the request's admission to its first text piece (queueing included)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("speculate_request_latency_seconds",
                                 "From the request's admission to the end of its generation",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.exactness = Gauge("speculate_exactness",
                               "1 for how the target's verified rows are exact (models/exactness.py): batched = "
                               "checked at load on this CPU, row-by-row = the check failed and rows run one at a "
                               "time, none = not claimed (fp32/bf16)", ["mode"], registry=r)
        self.in_flight = Gauge("speculate_requests_in_flight", "Generations running (in the batch)", registry=r)
        self.queued = Gauge("speculate_requests_queued", "Admitted requests waiting for a place in the batch",
                            registry=r)
        # Batching (server/scheduler.py): per round, how many generations shared the target forward and how many
        # rows it scored (drafts, roots and prefill chunks); per request, the wait for a place and the time per token.
        self.batch_size = Histogram("speculate_batch_size", "Generations per target forward (one round of the batch)",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_rows = Histogram("speculate_batch_rows", "Rows per target forward: every generation's root + "
                                    "drafts, or its prefill chunk", buckets=ROW_BUCKETS, registry=r)
        self.round_seconds = Histogram("speculate_round_seconds", "Seconds per round of the batch (draft, one "
                                       "target forward, verify)", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("speculate_queue_seconds", "From the request's admission to its place in the "
                                    "batch (every request that got one)", buckets=LATENCY_BUCKETS, registry=r)
        self.time_per_token = Histogram("speculate_time_per_output_token_seconds", "Per finished generation: "
                                        "(end − first text piece) / (tokens − 1)", buckets=LATENCY_BUCKETS, registry=r)
        # The prompts' KV blocks shared by all requests (models/prefix_store.py), read when /metrics is asked.
        self.cached_prompt_tokens = Counter("speculate_cached_prompt_tokens", "Prompt tokens of finished generations "
                                            "whose KV came from a cache, not a forward", registry=r)
        self.prefix_store_bytes = Gauge("speculate_prefix_cache_bytes", "Bytes of KV blocks (requests' prompts and "
                                        "answers, target and draft model) held for all requests", registry=r)
        self.prefix_store_blocks = Gauge("speculate_prefix_cache_blocks", "KV blocks held for all requests",
                                         registry=r)
        self.prefix_hit_rate = Gauge("speculate_prefix_cache_hit_rate", "Prompt tokens found cached over prompt "
                                     "tokens looked up, since the start", registry=r)
        # suffix's indexes of the answers served (drafters/suffix.py), read when /metrics is asked.
        self.index_tokens = Gauge("speculate_suffix_index_tokens", "Answer tokens held by the suffix drafter's "
                                  "indexes of served answers", registry=r)
        self.index_answers = Gauge("speculate_suffix_index_answers", "Answers held by the suffix drafter's indexes",
                                   registry=r)
        self.index_ngrams = Gauge("speculate_suffix_index_ngrams", "Distinct n-grams in the suffix drafter's indexes",
                                  registry=r)
        self.index_hit_rate = Gauge("speculate_suffix_index_hit_rate", "Rounds the index drafted over rounds it was "
                                    "asked (prompt lookup found no match), since the start", registry=r)
        # τ per drafter (as speculative.drafter names it): generated tokens over target forward passes.
        self.tokens_by_drafter = Counter("speculate_generated_tokens_by_drafter", "Tokens generated by finished "
                                         "generations, by drafter", ["drafter"], registry=r)
        self.calls_by_drafter = Counter("speculate_target_forward_passes_by_drafter", "Target forward passes after "
                                        "the prefill of finished generations, by drafter", ["drafter"], registry=r)
        self.accepted_length_by_drafter = Gauge("speculate_mean_accepted_length_by_drafter", "Generated tokens per "
                                                "target forward pass (τ), by drafter", ["drafter"], registry=r)
        self.indexes = lambda: []  # the target's suffix indexes (set by the app)
        self.kv_budget = Gauge("speculate_kv_budget_bytes", "KV cache the running generations may fill together "
                               "(--kv-memory; 0: no limit)", registry=r)
        self.kv_reserved_bytes = Gauge("speculate_kv_reserved_bytes", "KV cache reserved by the running generations "
                                       "(their tokens and a stretch past them)", registry=r)
        self.kv_reserved = lambda: 0
        self.kv_pool_bytes = Gauge("speculate_kv_pool_bytes", "KV blocks held in the target's pool (running and idle "
                                   "generations and the prompt-prefix store; a block they share counted once)",
                                   registry=r)
        self.kv_pool = lambda: 0
        self.preemptions = Counter("speculate_preemptions", "Generations preempted for KV memory (--kv-memory): their "
                                   "cache given up, their tokens recomputed or found cached when they resume",
                                   registry=r)
        self.peeked = Counter("speculate_peeked_rounds", "Rounds that drafted nothing but asked the drafter for its "
                              "free first token (lookup, retrieval, suffix), so acceptance is still learned",
                              registry=r)
        self.peek_hits = Counter("speculate_peek_hits", "Peeked rounds whose next token was the peeked one", registry=r)
        gate_labels = ["batch", "drafters", "arm"]
        self.gate_rate = Gauge("speculate_draft_gate_tokens_per_second", "The batch planner's gate: decayed tokens "
                               "per second of rounds run with drafts (arm=draft) and without (arm=plain), per batch "
                               "size bucket and drafters in the batch", gate_labels, registry=r)
        self.gate_rounds = Gauge("speculate_draft_gate_rounds", "Rounds the gate has timed, per bucket, drafters and "
                                 "arm", gate_labels, registry=r)
        self.gate_withheld = Gauge("speculate_draft_gate_withheld_rounds", "Rounds the gate ran plain against the "
                                   "plan (drafting measured slower)", registry=r)
        self.gate = None  # the batch planner's DraftGate (speculate/policy/gate.py), if any
        self.store = None  # the server's PrefixStore, if any
        self._tokens = 0
        self._calls = 0
        self._by_drafter: dict[str, list[int]] = {}  # drafter → [tokens, target passes]

    def set_load(self, running: int, queued: int) -> None:
        self.in_flight.set(running)
        self.queued.set(queued)

    def record_round(self, generations: int, rows: int, seconds: float) -> None:
        self.batch_size.observe(generations)
        self.batch_rows.observe(rows)
        self.round_seconds.observe(seconds)

    def record_generation(self, gen: Generation, ttft: float | None, latency: float, drafter: str = "") -> None:
        s = gen.stats
        n = len(gen.token_ids)
        self.prompt_tokens.inc(gen.prompt_tokens)
        self.cached_prompt_tokens.inc(s.reused_prompt_tokens)
        self.generated_tokens.inc(n)
        self.target_calls.inc(s.target_calls)
        self.drafted.inc(s.drafted_tokens)
        self.accepted.inc(s.accepted_draft_tokens)
        self.peeked.inc(s.peeked_rounds)
        self.peek_hits.inc(s.peek_hits)
        for i, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position), start=1):
            self.drafted_by_position.labels(str(i)).inc(d)
            self.accepted_by_position.labels(str(i)).inc(a)
        for mode in ("batched", "row-by-row", "none"):
            self.exactness.labels(mode).set(float(s.exactness == mode))
        self._tokens += s.new_tokens
        self._calls += s.target_calls
        if drafter:
            self.tokens_by_drafter.labels(drafter).inc(s.new_tokens)
            self.calls_by_drafter.labels(drafter).inc(s.target_calls)
            totals = self._by_drafter.setdefault(drafter, [0, 0])
            totals[0] += s.new_tokens
            totals[1] += s.target_calls
            if totals[1]:
                self.accepted_length_by_drafter.labels(drafter).set(totals[0] / totals[1])
        if self._calls:
            self.mean_accepted_length.set(self._tokens / self._calls)
        if ttft is not None:
            self.ttft.observe(ttft)
            if n > 1:
                self.time_per_token.observe((latency - ttft) / (n - 1))
        self.latency.observe(latency)

    def render(self) -> bytes:
        if self.store is not None:
            self.prefix_store_bytes.set(self.store.bytes)
            self.prefix_store_blocks.set(self.store.blocks)
            self.prefix_hit_rate.set(self.store.hit_rate)
        self.kv_reserved_bytes.set(self.kv_reserved())
        self.kv_pool_bytes.set(self.kv_pool())
        indexes = self.indexes()
        self.index_tokens.set(sum(i.tokens for i in indexes))
        self.index_answers.set(sum(len(i.answers) for i in indexes))
        self.index_ngrams.set(sum(len(i.counts) for i in indexes))
        lookups = sum(i.lookups for i in indexes)
        self.index_hit_rate.set(sum(i.hits for i in indexes) / lookups if lookups else 0.0)
        if self.gate is not None:
            for (size, drafters), arms in list(self.gate.arms.items()):  # (a copy: the scheduler's thread adds keys)
                for drafted, arm in list(arms.items()):
                    labels = (str(size), "+".join(drafters), "draft" if drafted else "plain")
                    self.gate_rate.labels(*labels).set(arm.rate)
                    self.gate_rounds.labels(*labels).set(arm.rounds)
            self.gate_withheld.set(self.gate.withheld)
        return generate_latest(self.registry)


class StatusCounter:
    """ASGI middleware: count each /v1 request by endpoint and final status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        outcome = scope[OUTCOME_KEY] = {}
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def send_and_see(message):
            if message["type"] == "http.response.start":
                outcome.setdefault("sent", str(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            status = outcome.get("status") or outcome.get("sent") or "500"
            self.metrics.requests.labels(endpoint, status).inc()
