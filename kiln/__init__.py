"""kiln: the maintainer tool of the fork.

A library first: every subcommand of ``python -m kiln`` is a thin wrapper over a
function in one of these modules, so tests call the same code the CLI runs.
It imports nothing beyond the standard library at module level, so it runs
before any vLLM (or torch) is installed.
"""

from kiln.errors import KilnError

__all__ = ["KilnError"]
