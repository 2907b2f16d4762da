"""``python -m dspark_jax.serve``: thin entry point; the command lives in :mod:`dspark_jax.commands.serve`."""

import sys

from dspark_jax.commands.serve import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
