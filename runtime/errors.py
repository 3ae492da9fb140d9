"""The exception types users see: a message that says what went wrong, where, and what to do."""


class DeepinferError(Exception):
    """A user-facing error; command-line tools print its message and exit non-zero."""

    exit_code = 1


class BundleError(DeepinferError):
    """A bundle that cannot be used as it is; the message names the file and what to do."""
