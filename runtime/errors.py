"""The one exception type users see: its message says what went wrong, where, and what to do."""


class DeepinferError(Exception):
    """A user-facing error; command-line tools print its message and exit non-zero."""

    exit_code = 1
