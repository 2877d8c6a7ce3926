"""``speculate serve``: an OpenAI-compatible HTTP server over the speculative decoding engine.

One responsibility per module: config (flags), schemas (request bodies), body (size-limited JSON),
auth (API key), errors (OpenAI error objects), generation (request → engine stream; the worker's loop),
scheduler (continuous batching: one generation thread, a bounded queue), responses (OpenAI response objects, SSE), sse (streaming response
that notices disconnects), metrics (Prometheus), app (routes), main (load models, run uvicorn).
"""

from .app import create_app
from .config import ServerConfig
from .main import build_app, load_models, serve

__all__ = ["ServerConfig", "build_app", "create_app", "load_models", "serve"]
