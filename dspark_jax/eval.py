"""``python -m dspark_jax.eval``: thin entry point; the command lives in :mod:`dspark_jax.evaluation.cli`."""

import sys

from dspark_jax.evaluation.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
