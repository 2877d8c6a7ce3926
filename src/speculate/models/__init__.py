from .loader import DTYPES, LoadedModel, load_model
from .registry import ALIASES, DEFAULT_MODEL

__all__ = ["ALIASES", "DEFAULT_MODEL", "DTYPES", "LoadedModel", "load_model"]
