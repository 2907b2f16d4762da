"""``python -m dspark_jax.generate``: thin entry point; the command lives in :mod:`dspark_jax.commands.generate`."""

import sys

from dspark_jax.commands.generate import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
