"""Reading the repository's TOML files with errors that name the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kiln.errors import KilnError


def read_toml(path: Path, when_missing: str) -> dict[str, Any]:
    """The parsed file; ``when_missing`` says what the absent file was for."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: {when_missing}") from None
    except tomllib.TOMLDecodeError as e:
        raise KilnError(f"{path}: not valid TOML: {e}") from None
