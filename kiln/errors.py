"""The one exception type the CLI turns into a clean error message."""


class KilnError(Exception):
    """A user-facing failure: the message names what is wrong and what is allowed."""
