"""``python -m dspark_jax.generate``: thin entry point; the command lives in :mod:`dspark_jax.decoding.cli`."""

import sys

from dspark_jax.decoding.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
