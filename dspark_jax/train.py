"""``python -m dspark_jax.train``: thin entry point; the command lives in :mod:`dspark_jax.commands.train`."""

import sys

from dspark_jax.commands.train import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
