"""The section headers of an ELF64 little-endian file: just enough to find a section.

The GPU bundle reads ``.nv_fatbin`` out of the wheel's compiled extensions; every
such file is an x86_64 shared object, so anything else is refused rather than guessed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kiln.errors import KilnError

MAGIC = b"\x7fELF"
ELFCLASS64, ELFDATA2LSB = 2, 1
SHN_XINDEX = 0xFFFF  # e_shstrndx too large for its field: the real index is in section 0
SHT_NOBITS = 8  # occupies no bytes in the file (.bss)
# e_shoff at 0x28; e_shentsize, e_shnum, e_shstrndx at 0x3A.
_SHOFF = struct.Struct("<Q")
_SHCOUNTS = struct.Struct("<HHH")
# name, type, flags, addr, offset, size, link, info, align, entsize
_SHDR = struct.Struct("<IIQQQQIIQQ")


@dataclass(frozen=True)
class Section:
    name: str
    type: int
    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


def sections(data: bytes, source: str) -> list[Section]:
    """Every section of the file, in header order; ``source`` names it in errors."""
    if data[:4] != MAGIC:
        raise KilnError(f"{source}: not an ELF file (starts with {data[:4]!r})")
    if data[4] != ELFCLASS64 or data[5] != ELFDATA2LSB:
        raise KilnError(f"{source}: ELF class {data[4]}, data encoding {data[5]}; "
                        "only 64-bit little-endian files (class 2, encoding 1) are read")
    (shoff,) = _SHOFF.unpack_from(data, 0x28)
    entsize, count, strndx = _SHCOUNTS.unpack_from(data, 0x3A)
    if shoff == 0:
        return []
    if entsize != _SHDR.size:
        raise KilnError(f"{source}: section header size {entsize}, expected {_SHDR.size}")
    raw = _header(data, shoff, 0, source)
    if count == 0:  # more than 0xff00 sections: the count is in section 0's size
        count = raw[5]
    if strndx == SHN_XINDEX:
        strndx = raw[6]
    headers = [_header(data, shoff, i, source) for i in range(count)]
    if not 0 < strndx < count:
        raise KilnError(f"{source}: section name table index {strndx} is not one of the "
                        f"{count} sections")
    names = headers[strndx]
    table = data[names[4]:names[4] + names[5]]
    result = []
    for index, (name, kind, _flags, _addr, offset, size, *_rest) in enumerate(headers):
        end = table.find(b"\0", name)
        if end < 0:
            raise KilnError(f"{source}: section {index}'s name runs past the name table")
        section = Section(table[name:end].decode("ascii", "replace"), kind, offset, size)
        if kind != SHT_NOBITS and section.end > len(data):
            raise KilnError(f"{source}: section {section.name} ends at byte {section.end}, "
                            f"past the end of the {len(data)}-byte file")
        result.append(section)
    return result


def _header(data: bytes, shoff: int, index: int, source: str) -> tuple:
    start = shoff + index * _SHDR.size
    if start + _SHDR.size > len(data):
        raise KilnError(f"{source}: section header {index} at byte {start} runs past the "
                        f"end of the {len(data)}-byte file")
    return _SHDR.unpack_from(data, start)
