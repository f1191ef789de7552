"""The `diffcast` command line: a thin dispatcher over app.commands.*."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

# Subcommand modules, in the order `diffcast --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "app.commands.stylize",
    "app.commands.bench",
    "app.commands.serve",
    "app.commands.simulate",
    "app.commands.profile",
    "app.commands.virtualcam",
    "app.commands.train",
)

# Environment a command needs before torch loads, which happens as the command modules are imported
# (libgomp reads it once, at load). serve: the engine's OpenMP threads sleep at a barrier instead of
# spinning; the server's media path (codec threads, the event loop) shares the cores with them, and
# spinning cost the engine 3-15x its CPU per frame on 2 cores (docs/service.md, "Where the CPU and
# the latency went"). The environment's own setting wins.
EARLY_ENVIRONMENT: dict[str, dict[str, str]] = {"serve": {"OMP_WAIT_POLICY": "PASSIVE"}}


def set_early_environment(argv: Sequence[str]) -> None:
    """The chosen command's EARLY_ENVIRONMENT (its name is the first argument that is no option: the
    global options take no values)."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    for key, value in EARLY_ENVIRONMENT.get(command or "", {}).items():
        os.environ.setdefault(key, value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="diffcast", description="Live video diffusion over WebRTC.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        module = importlib.import_module(module_name)
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    set_early_environment(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
