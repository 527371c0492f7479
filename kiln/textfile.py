"""Reading the repository's text files (patches, the series, the locks) as UTF-8, with
an error that names the file and where a byte that is not UTF-8 sits."""

from __future__ import annotations

from pathlib import Path

from kiln.errors import KilnError


def read_utf8(path: Path) -> str:
    """The file's text (newlines as ``Path.read_text`` gives them)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        data = path.read_bytes()
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + 1
        raise KilnError(
            f"{path}: line {line}, byte {e.start - line_start + 1}: 0x{data[e.start]:02x} is "
            "not UTF-8 (kiln reads this file as UTF-8 text)"
        ) from None
