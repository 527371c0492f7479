"""Reading the repository's TOML files with errors that name the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.textfile import read_utf8


def read_toml(path: Path, when_missing: str) -> dict[str, Any]:
    """The parsed file; ``when_missing`` says what the absent file was for."""
    try:
        return tomllib.loads(read_utf8(path))
    except FileNotFoundError:
        raise KilnError(f"{path}: {when_missing}") from None
    except tomllib.TOMLDecodeError as e:
        raise KilnError(f"{path}: not valid TOML: {e}") from None
