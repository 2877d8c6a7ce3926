"""Where the registries find drafters and verifiers: their package's own modules, then the plugins.

A plugin is a module outside the package, named in the environment variable ``SPECULATE_PLUGINS`` (import paths,
comma-separated: ``SPECULATE_PLUGINS=my_drafter,lab.verifiers``; found on ``sys.path``, e.g. through
``PYTHONPATH``). It declares drafters and verifiers as a module of the package does (a ``Drafter`` or ``Verifier``
subclass with a ``name`` of its own), and they become choices wherever a name is taken: ``--drafter`` and
``--verifier``, a request's ``speculative`` object, a bench method. The variable is read once per process, when a
registry is first used (``drafters.registry``, ``verifiers.registry``). An environment variable rather than installed
entry points: a plugin needs no package of its own, and the variable reaches the processes a run starts (a server, a
subprocess) by itself.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from types import ModuleType

from .errors import SpeculateError

ENV = "SPECULATE_PLUGINS"


def plugin_modules() -> list[ModuleType]:
    """The modules ``SPECULATE_PLUGINS`` names, imported; a SpeculateError that names the variable for one that cannot
    be (a setting to fix, as a bad flag is: the CLI says it in one line)."""
    modules = []
    for name in filter(None, (part.strip() for part in os.environ.get(ENV, "").split(","))):
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:
            raise SpeculateError(f"{ENV} names {name!r}, which cannot be imported ({e}); is its folder on "
                                 "PYTHONPATH?") from e
    return modules


def declared(package: str, path, base: type) -> list[type]:
    """The classes that declare themselves to a registry: each subclass of ``base`` with a ``name`` of its own that a
    module of ``package`` (``path``: its ``__path__``; modules in name order) or a plugin module defines (not
    imports)."""
    modules = [importlib.import_module(f"{package}.{info.name}")
               for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name)]
    found = []
    for module in modules + plugin_modules():
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, base) and obj is not base
                    and obj.__module__ == module.__name__ and "name" in obj.__dict__):
                found.append(obj)
    return found


__all__ = ["ENV", "declared", "plugin_modules"]
