"""speculate: speculative decoding for LLMs, offline.

    from speculate import load_model, SpeculativeDecoder, SpeculativeSpec
    target = load_model()                       # SmolLM2-135M-Instruct at q4 (dtype='auto'), converted once
    out = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=6)).generate("Rewrite: ...", max_new_tokens=128)
    print(out.text, out.stats.to_dict())
"""

from .engine import Generation, SpeculativeDecoder, Stream, TokenLogprob
from .errors import SpeculateError
from .models import DEFAULT_MODEL, LoadedModel, load_model
from .sampling import SamplingParams
from .spec import SpeculativeSpec
from .stats import Stats

__all__ = ["DEFAULT_MODEL", "Generation", "LoadedModel", "SamplingParams", "SpeculateError", "SpeculativeDecoder",
           "SpeculativeSpec", "Stats", "Stream", "TokenLogprob", "load_model"]
__version__ = "0.1.0"
