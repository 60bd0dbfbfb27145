"""The command line: ``python3 ondemand.pyz [--config FILE] COMMAND``.

The click commands, and nothing else. The configuration is read here, once,
and passed down. Commands that read or change state talk to the running
server over its admin socket (``admin.client``); read-only ones open the state
file themselves when no server runs. ``doctor``'s checks live in ``admin.doctor``.
``--json`` prints machine-readable output; errors go to stderr with a non-zero
exit: 1 for a refused or failed action, 2 for bad usage or configuration, 3 when
the server is needed but not running.

The commands by what they are about: ``serve`` (serve and its demo, migrate, the engine
simulator), ``deploy`` (a deployment's add, set, list, show, rm, start, stop, logs),
``warmth`` (mode, sleep and wake), ``keys`` (the key and the LiteLLM sync), ``status``
(status, audit, doctor), ``replay`` (a trace replayed under policies, in virtual time);
``views`` renders a deployment's view, and ``shared`` holds the root group, its context, the
exit codes, the admin calls and the output helpers.
"""
from __future__ import annotations

from . import deploy, keys, replay, serve, status, warmth  # noqa: F401 (each adds its commands to the group)
from .shared import cli


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="ondemand", standalone_mode=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
