"""``python -m dspark_jax.calibrate``: thin entry point; the command lives in :mod:`dspark_jax.commands.calibrate`."""

import sys

from dspark_jax.commands.calibrate import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
