from .loader import CHOICES, DTYPES, LoadedModel, load_model, resolve_dtype
from .registry import ALIASES, DEFAULT_MODEL

__all__ = ["ALIASES", "CHOICES", "DEFAULT_MODEL", "DTYPES", "LoadedModel", "load_model", "resolve_dtype"]
