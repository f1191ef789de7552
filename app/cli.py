"""The `diffcast` command line: a thin dispatcher over app.commands.*."""

from __future__ import annotations

import argparse
import importlib
import logging
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
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
