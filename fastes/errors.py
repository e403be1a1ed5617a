"""Errors a user can fix: a bad setting, file or directory.

The `fastes` command prints any FastesError as one line, `fastes: <message>`, and exits with status 2;
the message names the key or file and says how to fix it.
"""


class FastesError(Exception):
    """Bad input that the user can fix; the message names the key or file and the fix."""


class MissingFileError(FastesError, FileNotFoundError):
    """A file or directory that the user named does not exist."""


class MissingPackageError(FastesError, ImportError):
    """An optional package that a chosen setting needs is not installed."""
