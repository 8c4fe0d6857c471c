"""The one exception type the CLI turns into a clean, non-zero exit with its message."""


class CachelabError(ValueError):
    """Bad input a user can fix: the message names the file, field or value at fault."""
