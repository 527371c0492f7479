"""kiln: the maintainer tool of the fork.

A library first: every subcommand of ``python -m kiln`` (``kiln.commands``, options
shared between them in ``kiln.cmdoptions``) is a thin wrapper over a function in one of
its rooms, so tests call the same code the CLI runs: ``upstream`` (the pinned pristine
upstream), ``series`` (the topic series), ``portcheck`` (what a port can still break),
``build`` (the wheels), ``abi`` (compiled binaries) and ``testing`` (what the tests run
on). The modules at the top are the helpers they share. It imports nothing beyond the
standard library at module level, so it runs before any vLLM (or torch) is installed.
"""

from kiln.errors import KilnError

__all__ = ["KilnError"]
