"""The ``lightning-wsync`` console script.

Subcommands live next to what they drive; this module only dispatches::

    lightning-wsync store --host 0.0.0.0 --port 29400   # a standalone control-plane store
    lightning-wsync bench --size-mb 256 --receivers 4   # push benchmark with bounds
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# name -> (module, help). Each module has ``add_arguments(parser)`` and ``run(args) -> int``;
# imported lazily so ``lightning-wsync store`` does not pay for Lightning's import.
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "store": ("lightning_wsync.rendezvous._store_cli", "host a standalone control-plane TCPStore"),
    "bench": ("lightning_wsync.bench", "measure push stall and latency against machine bounds"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-wsync")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    modules = {}
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        module.add_arguments(sp)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command not in modules:
        parser.error(f"subcommand {args.command!r} is not available in this build")
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    raise SystemExit(main())
