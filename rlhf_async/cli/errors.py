"""What every command may raise or return: a user error (one line, no traceback) and the
exit codes."""

EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 2, 1, 130


class UserError(Exception):
    """An expected problem with the user's input or environment: one line, no traceback."""
