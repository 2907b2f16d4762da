"""User-facing errors.

Every problem caused by user input (missing files, mismatched checkpoints, bad
prompts, bad flags) raises :class:`DSparkInputError` with a one-line message.
Command-line entry points print that line and exit with status 2.
"""


class DSparkInputError(ValueError):
    """Bad user input: the message is a one-line explanation of what to fix."""


def run_cli(fn, *args):
    """Runs ``fn(*args)`` for a command-line entry point.

    Returns:
      ``(0, result)``, or ``(2, None)`` after printing a :class:`DSparkInputError` as one
      ``error: ...`` line on stderr.
    """
    import sys

    try:
        return 0, fn(*args)
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, None
