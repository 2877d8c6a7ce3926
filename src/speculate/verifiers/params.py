"""The verifiers' parameters are :class:`speculate.params.Param` (shared with the drafters' options); these names
stay importable from here for the modules that read them here (``speculate.auto``)."""

from ..params import AUTO, Param, is_auto

__all__ = ["AUTO", "Param", "is_auto"]
