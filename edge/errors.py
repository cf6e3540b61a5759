"""Errors a user can cause: the CLI prints them as one line, never a traceback."""


class UserError(Exception):
    """Something the user can fix (a path, a flag, a pair, a prompt). The message says what to do next."""
