"""Thin command-line front end: one module per subcommand in ``kiln.commands``.

Each command module defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``; this file only discovers and dispatches them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import signal
import sys
from types import ModuleType

import kiln.commands
from kiln.errors import KilnError, Terminated, describe_os_error
from kiln.signals import handled


def _command_modules() -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(kiln.commands.__path__))
    return [importlib.import_module(f"kiln.commands.{n}") for n in names]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kiln",
        description="Maintain the fork: pristine upstream vLLM + a topic series "
        "+ the fork's overlay, built into one `vllm` wheel.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _command_modules():
        cmd = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.__doc__ or module.HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with handled():
            return int(args._run(args) or 0)
    except KilnError as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"kiln {args.command}: error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"kiln {args.command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print(f"kiln {args.command}: interrupted", file=sys.stderr)
        return 130
