"""``python -m dspark_jax.export``: thin entry point; the command lives in :mod:`dspark_jax.commands.export`."""

import sys

from dspark_jax.commands.export import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
