"""User-facing errors.

Every problem caused by user input (missing files, mismatched checkpoints, bad
prompts, bad flags) raises :class:`DSparkInputError` with a one-line message.
Command-line entry points print that line and exit with status 2.
"""


class DSparkInputError(ValueError):
    """Bad user input: the message is a one-line explanation of what to fix."""


# Loggers whose INFO lines a command shows on stderr: notes on long silent work (measuring decode costs).
NOTICE_LOGGERS = ("dspark_jax.decoding.decode_profile",)


def run_cli(fn, *args):
    """Runs ``fn(*args)`` for a command-line entry point, with the INFO lines of
    :data:`NOTICE_LOGGERS` shown on stderr.

    Returns:
      ``(0, result)``, or ``(2, None)`` after printing a :class:`DSparkInputError` as one
      ``error: ...`` line on stderr.
    """
    import logging
    import sys

    for name in NOTICE_LOGGERS:
        log = logging.getLogger(name)
        if not log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
    try:
        return 0, fn(*args)
    except DSparkInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, None
