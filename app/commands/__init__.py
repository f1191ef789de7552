"""One module per `diffcast` subcommand.

Each module exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``.
Heavy imports (torch, aiortc, ...) stay inside ``run`` so ``diffcast --help`` is instant.
"""
