"""User-facing errors.

Every problem caused by user input (missing files, mismatched checkpoints, bad
prompts, bad flags) raises :class:`DSparkInputError` with a one-line message.
Command-line entry points print that line and exit with status 2.
"""


class DSparkInputError(ValueError):
    """Bad user input: the message is a one-line explanation of what to fix."""
