"""The one exception type for failures a user can fix.

A `UserError` carries a one-line message that names the file, line or field
and says what to do; the CLI prints it without a traceback and exits with 2.
"""


class UserError(Exception):
    """Bad input, config or environment that the user can correct."""
