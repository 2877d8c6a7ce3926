"""The server's settings: what ``speculate serve`` was started with."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafters import resolve
from ..errors import SpeculateError
from ..spec import SpeculativeSpec

MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    model: str  # the target: an alias or a local Hugging Face folder; also the served model id
    drafter: str = "auto"
    draft_model: str | None = None
    verifier: str | None = None  # None: greedy at temperature 0, sample otherwise
    k: int | str = 6  # or "auto" (the engine sizes each round)
    eps: float | str | None = None  # or "auto" (consultant: the target's calibrated NLL)
    beta: float | None = None
    verifier_options: dict = field(default_factory=dict)  # any verifier parameter by name (--delta, --theta, ...)
    dtype: str = "auto"  # models/loader.py, resolve_dtype: q4 for the default model, else fp32
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch: int = 8  # generations that share a forward (server/scheduler.py: continuous batching)
    max_queue: int = 16  # admitted requests waiting for a place in the batch; beyond that: 429
    prefill_chunk: int = 128  # prompt tokens a joining request feeds per round
    max_body_bytes: int = MiB
    # --max-tokens: a request's new tokens at most, and the default where it gives none (a chat's default was the
    # rest of the context window: 8,126 tokens held a place in the batch ~90 s); 0: the context window
    max_tokens: int = 2048
    # Keep decoders between requests and reuse the KV of a prompt's shared prefix (server/decoders.py);
    # --no-prefix-cache: every request prefills its whole prompt in a fresh decoder.
    prefix_cache: bool = True
    # --drafter-opt KEY=VALUE: the server drafter's options (requests that name another drafter get its defaults)
    drafter_options: dict = field(default_factory=dict)
    # --allowed-host: Host (and Origin) names served besides loopback ones (server/guard.py: DNS rebinding)
    allowed_hosts: tuple[str, ...] = ()
    # Slow and idle clients (server/protocol.py, body.py): seconds to send a request's headers (from connecting, or
    # from the previous response), to send its body, to keep an idle connection open; open connections at most.
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 100
    # On SIGTERM / Ctrl-C: seconds that running generations get to finish before they are ended cleanly.
    shutdown_grace: float = 10.0
    # The speculative settings above as one checked SpeculativeSpec (set in __post_init__).
    spec: SpeculativeSpec | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        # The default speculative settings, checked once (k, drafter and options, verifier and parameters).
        spec = SpeculativeSpec(resolve(self.drafter, self.model), self.drafter_options, self.verifier,
                               self.verifier_params, self.k)
        spec.check_draft_model(True, given_for_it=bool(self.draft_model))
        object.__setattr__(self, "spec", spec)
        if self.max_batch < 1:
            raise SpeculateError(f"--max-batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise SpeculateError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_queue < 0:
            raise SpeculateError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_tokens < 0:
            raise SpeculateError(f"--max-tokens must be >= 0 (0: the context window), got {self.max_tokens}")
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
        if self.api_key is not None and not self.api_key:
            raise SpeculateError("--api-key must not be empty")
        object.__setattr__(self, "drafter", resolve(self.drafter, self.model))  # auto: by the model's name
        object.__setattr__(self, "drafter_options", spec.drafter_options)

    @property
    def verifier_params(self) -> dict:
        named = {key: v for key, v in (("eps", self.eps), ("beta", self.beta)) if v is not None}
        return {**named, **{key: v for key, v in self.verifier_options.items() if v is not None}}
