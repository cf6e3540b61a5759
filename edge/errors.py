"""Errors a user can cause: the CLI prints them as one line, never a traceback."""


class UserError(Exception):
    """Something the user can fix (a path, a flag, a pair, a prompt). The message says what to do next."""


class Interrupted(Exception):
    """The user asked to stop (Ctrl-C) while a prompt was being read; what was read so far stays in the caches."""
