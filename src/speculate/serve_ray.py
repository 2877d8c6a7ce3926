"""The Ray Serve application builder: ``serve run speculate.serve_ray:app model=smollm2-135m-instruct replicas=2``,
or ``import_path: speculate.serve_ray:app`` in a Serve config file (docs/server.md, "Beyond one machine"). The
deployments themselves are in server/ray_serve.py; this module only turns ``args`` into checked settings, through
``speculate serve``'s own parser, so a Serve config says what the command line says."""

from __future__ import annotations

from .cli import _parser
from .server.config import ServerConfig
from .server.ray_serve import RayOptions, build


def app(args: dict):
    """``args``: ``speculate serve``'s flags without their dashes (``max_batch`` or ``max-batch``); ``true`` for a
    switch; a list for a repeatable flag (``api_key: [KEY1, KEY2]``). Returns the Serve application (``Front`` bound
    to the engines)."""
    argv = ["serve", "--ray"]
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [part for item in value for part in (flag, str(item))]
        elif value is not False and value is not None:  # (0 == False: compare by identity)
            argv += [flag, str(value)]
    parsed = _parser().parse_args(argv)
    return build(ServerConfig.from_cli(parsed), RayOptions.from_cli(parsed))
