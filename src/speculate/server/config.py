"""The server's settings: what ``speculate serve`` was started with."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import SpeculateError
from ..spec import SpeculativeSpec

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    model: str  # the target: an alias or a local Hugging Face folder; also the served model id
    # The default speculative settings, as one checked spec (``speculate serve``: SpeculativeSpec.from_cli, the same
    # path as ``generate``); None: the default drafter for ``model``. ``auto`` is resolved for ``model``.
    spec: SpeculativeSpec | None = None
    draft_model: str | None = None
    dtype: str = "auto"  # models/loader.py, resolve_dtype: q4 for the default model, else fp32
    host: str = "127.0.0.1"
    port: int = 8000
    # --api-key (repeatable) / $SPECULATE_API_KEY (comma-separated): the keys a /v1 request may carry; (): none asked.
    # Each key is a tenant of its own (server/auth.py): answers served to one key never draft for another
    # (drafters that learn from served answers: suffix) unless --share-drafts.
    api_keys: tuple[str, ...] = ()
    share_drafts: bool = False
    # The batch planner's measured gate (speculate/policy/gate.py): withhold drafts in batches where drafting measures
    # slower than plain rounds; --no-draft-gate: draft as planned (still measured, on /metrics).
    draft_gate: bool = True
    max_batch: int = 8  # generations that share a forward (server/scheduler.py: continuous batching)
    max_queue: int = 16  # admitted requests waiting for a place in the batch; beyond that: 429
    prefill_chunk: int = 128  # prompt tokens a joining request feeds per round
    prefill_budget: int | None = None  # prompt tokens all joining requests feed per round together (2 chunks)
    max_body_bytes: int = MiB
    # --max-tokens: a request's new tokens at most, and the default where it gives none (a chat's default was the
    # rest of the context window: 8,126 tokens held a place in the batch ~90 s); 0: the context window
    max_tokens: int = 2048
    # Keep the KV blocks of requests' prompts and answers for every request, whatever its settings
    # (models/prefix_store.py), in --prefix-cache-gib GiB at most; --no-prefix-cache: every request prefills its
    # whole prompt.
    prefix_cache: bool = True
    prefix_cache_gib: float = 1.0
    # --kv-memory: GiB of KV cache the running generations may fill together (server/scheduler.py admits a request
    # only while its share fits; one that could never fit is a 400); None: half the memory available at start;
    # 0: no limit (the behaviour before it).
    kv_memory_gib: float | None = None
    # --allowed-host: Host (and Origin) names served besides loopback ones (server/guard.py: DNS rebinding)
    allowed_hosts: tuple[str, ...] = ()
    # Slow and idle clients (server/protocol.py, body.py): seconds to send a request's headers (from connecting, or
    # from the previous response), to send its body, to keep an idle connection open; open connections at most.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 100
    # --max-connections-per-client: open connections from one address at most; None: half of max_connections;
    # 0: no limit per address (behind a proxy every client has the proxy's address)
    max_connections_per_client: int | None = None
    # On SIGTERM / Ctrl-C: seconds that running generations get to finish before they are ended cleanly.
    shutdown_grace: float = 10.0
    def __post_init__(self):
        spec = (self.spec or SpeculativeSpec()).resolved(self.model)
        object.__setattr__(self, "spec", spec.check_draft_model(True, given_for_it=bool(self.draft_model)))
        if self.max_batch < 1:
            raise SpeculateError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise SpeculateError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_budget is None:
            object.__setattr__(self, "prefill_budget", 2 * self.prefill_chunk)
        if self.prefill_budget < 1:
            raise SpeculateError(f"--prefill-budget must be >= 1, got {self.prefill_budget}")
        if self.max_queue < 0:
            raise SpeculateError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_tokens < 0:
            raise SpeculateError(f"--max-tokens must be >= 0 (0: the context window), got {self.max_tokens}")
        if not 0 <= self.prefix_cache_gib < float("inf"):
            raise SpeculateError(f"--prefix-cache-gib must be a number >= 0, got {self.prefix_cache_gib}")
        if self.kv_memory_gib is not None and not 0 <= self.kv_memory_gib < float("inf"):
            raise SpeculateError(f"--kv-memory must be a number of GiB >= 0 (0: no limit), got {self.kv_memory_gib}")
        if self.max_body_bytes < 1:
            raise SpeculateError(f"the body size limit must be >= 1 byte, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise SpeculateError(f"--port must be in 0..65535, got {self.port}")
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "shutdown_grace"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise SpeculateError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value}")
        if self.max_connections < 1:
            raise SpeculateError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_connections_per_client is None:
            object.__setattr__(self, "max_connections_per_client", max(1, self.max_connections // 2))
        if self.max_connections_per_client < 0:
            raise SpeculateError(f"--max-connections-per-client must be >= 0 (0: no limit), got "
                                 f"{self.max_connections_per_client}")
        keys = (self.api_keys,) if isinstance(self.api_keys, str) else tuple(self.api_keys)
        if any(not isinstance(key, str) or not key.strip() for key in keys):
            raise SpeculateError("--api-key must not be empty")
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys(key.strip() for key in keys)))

    @classmethod
    def from_cli(cls, args) -> ServerConfig:
        """``speculate serve``'s flags: the speculative ones as the parser checked them (``args.spec``, made by
        ``SpeculativeSpec.from_cli`` as for ``generate``), the API keys from --api-key or else
        $SPECULATE_API_KEY (comma-separated)."""
        keys = args.api_key or [key for key in os.environ.get("SPECULATE_API_KEY", "").split(",") if key.strip()]
        return cls(model=args.model, spec=args.spec, draft_model=args.draft_model,
                   dtype=args.dtype, host=args.host, port=args.port, api_keys=tuple(keys),
                   share_drafts=args.share_drafts, draft_gate=not args.no_draft_gate, max_batch=args.max_batch,
                   max_queue=args.max_queue,
                   prefill_chunk=args.prefill_chunk, prefill_budget=args.prefill_budget,
                   max_body_bytes=args.max_body_bytes,
                   prefix_cache=not args.no_prefix_cache, prefix_cache_gib=args.prefix_cache_gib,
                   allowed_hosts=tuple(args.allowed_host or ()), header_timeout=args.header_timeout,
                   body_timeout=args.body_timeout, keep_alive_timeout=args.keep_alive_timeout,
                   max_connections=args.max_connections,
                   max_connections_per_client=args.max_connections_per_client, shutdown_grace=args.shutdown_grace,
                   max_tokens=args.max_tokens, kv_memory_gib=args.kv_memory)

    def kv_budget(self) -> int:
        """--kv-memory in bytes (0: no limit); by default half the memory available now."""
        if self.kv_memory_gib is not None:
            return int(self.kv_memory_gib * 2**30)
        return available_memory() // 2


def available_memory() -> int:
    """Bytes of memory available to new allocations (Linux: MemAvailable; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
