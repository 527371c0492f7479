"""Read the CUDA fatbinary in an ELF file's ``.nv_fatbin`` section, and slim it.

A compiled extension carries its GPU code for every chip it was built for: upstream's
``_C_stable_libtorch`` holds sm_75 to sm_120 machine code (ELF "cubin" entries) and
some PTX, 53 MB of its 79 MB. The GPU bundle keeps only what one chip (or a few)
would load and zeroes the rest, so the file keeps its size, its sections and its
symbols byte for byte and then compresses to a fraction (zeroes cost nothing to xz).

The section is a sequence of blobs (one per compiled translation unit), each a
16-byte header then entries back to back. The layout below was read off upstream's
wheel and off objects compiled here with nvcc 13.0 for known targets; each field
was checked against the payload it describes (an uncompressed cubin's ELF
``e_flags`` carry its SM, an uncompressed PTX names ``.target sm_XX``):

blob header (16 bytes):
    0  u32 magic 0xBA55ED50    4  u16 version (1)    6  u16 header size (16)
    8  u64 size of the entries that follow
entry header (64 bytes, or more: 72 with a debug identifier, 80 for PTX, 112 for
sm_100 and later; the payload starts at ``header size``):
    0  u16 kind (1 PTX, 2 ELF)    2  u16 version (0x0101)    4  u32 header size
    8  u64 payload size (padded to 8)    16  u32 compressed size (0 if stored plain)
    24 u16 minor, u16 major version of the payload's format ((8, 1) for cubins;
       (0, 9) for PTX ISA 9.0)
    28 u32 SM arch (75, 80, ..., 120)    40  u64 flags
    56 u64 size uncompressed (0 if stored plain)
flags: 0x1 64-bit, 0x2 debug (-G), 0x10 Linux host, 0x2000 LZ4-compressed (nvcc
``--compress-mode=speed``), 0x8000 zstd-compressed (the default), 0x100000
arch-specific (sm_90a), 0x200000 family-specific (sm_100f), 0x1000000 the 112-byte
header of sm_100 and later.

Slimming never decompresses: it keeps or zeroes whole payloads. Anything this
reader does not know is refused, naming the blob, entry and byte offset, since a
misread header would zero code the runtime needs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kiln.abi.elf import sections
from kiln.errors import KilnError

SECTION = ".nv_fatbin"
BLOB_MAGIC = 0xBA55ED50
BLOB_VERSION = 1
BLOB_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
ENTRY_VERSION = 0x0101
ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, payload size
ENTRY_MIN_HEADER = 64  # every field read below lies in the first 64 bytes
ARCH = struct.Struct("<I")
ARCH_OFFSET = 28
FLAGS = struct.Struct("<Q")
FLAGS_OFFSET = 40

KIND_PTX, KIND_ELF = 1, 2
KIND_NAMES = {KIND_PTX: "PTX", KIND_ELF: "ELF"}

FLAG_64BIT = 0x1
FLAG_DEBUG = 0x2
FLAG_LINUX = 0x10
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY_SPECIFIC = 0x200000
FLAG_LONG_HEADER = 0x1000000
KNOWN_FLAGS = (FLAG_64BIT | FLAG_DEBUG | FLAG_LINUX | FLAG_LZ4 | FLAG_ZSTD
               | FLAG_ARCH_SPECIFIC | FLAG_FAMILY_SPECIFIC | FLAG_LONG_HEADER)


@dataclass(frozen=True)
class Entry:
    blob: int
    index: int  # within its blob
    offset: int  # of the entry header, in the file
    kind: int
    arch: int
    flags: int
    header_size: int
    payload_size: int

    @property
    def payload_offset(self) -> int:
        return self.offset + self.header_size

    @property
    def end(self) -> int:
        return self.payload_offset + self.payload_size

    @property
    def is_elf(self) -> bool:
        return self.kind == KIND_ELF

    @property
    def name(self) -> str:
        """sm_90a ELF, compute_80 PTX: nvcc's spelling of the target."""
        suffix = ("a" if self.flags & FLAG_ARCH_SPECIFIC
                  else "f" if self.flags & FLAG_FAMILY_SPECIFIC else "")
        prefix = "sm" if self.is_elf else "compute"
        return f"{prefix}_{self.arch}{suffix} {KIND_NAMES[self.kind]}"

    def loads_on(self, target: int) -> bool:
        """Whether the CUDA runtime can use this entry on a GPU of SM ``target``.

        Machine code runs on the same major version at an equal or later minor; PTX is
        compiled for any later chip. Arch-specific code (sm_90a) runs only on its own
        chip, family-specific code (sm_100f) only within its major version.
        """
        if self.flags & FLAG_ARCH_SPECIFIC:
            return self.arch == target
        same_major = self.arch // 10 == target // 10
        if self.is_elf or self.flags & FLAG_FAMILY_SPECIFIC:
            return same_major and self.arch <= target
        return self.arch <= target


@dataclass(frozen=True)
class Blob:
    index: int
    offset: int
    entries: tuple[Entry, ...]

    def chosen(self, target: int) -> list[Entry]:
        """The entries the runtime would pick from on ``target``.

        The machine code of the newest loadable arch (every entry of it: sm_90 and
        sm_90a both); where there is none, the newest loadable PTX.
        """
        pool = [e for e in self.entries if e.is_elf and e.loads_on(target)]
        pool = pool or [e for e in self.entries if not e.is_elf and e.loads_on(target)]
        best = max((e.arch for e in pool), default=None)
        return [e for e in pool if e.arch == best]


@dataclass(frozen=True)
class Slimmed:
    data: bytes
    kept: list[Entry]
    zeroed: list[Entry]

    @property
    def zeroed_bytes(self) -> int:
        return sum(e.payload_size for e in self.zeroed)


def parse(data: bytes, start: int, end: int, source: str) -> list[Blob]:
    """The blobs in ``data[start:end]``; offsets in errors and entries are into ``data``."""
    blobs: list[Blob] = []
    pos = start
    while pos < end:
        b = len(blobs)
        where = f"{source}: fatbin blob {b} at byte {pos:#x}"
        if pos + BLOB_HEADER.size > end:
            raise KilnError(f"{where}: its {BLOB_HEADER.size}-byte header runs past the "
                            f"end of the section at byte {end:#x}")
        magic, version, header_size, size = BLOB_HEADER.unpack_from(data, pos)
        if magic != BLOB_MAGIC:
            raise KilnError(f"{where}: magic {magic:#010x}, expected {BLOB_MAGIC:#010x}")
        if version != BLOB_VERSION or header_size != BLOB_HEADER.size:
            raise KilnError(f"{where}: header version {version}, size {header_size}; this "
                            f"reader knows version {BLOB_VERSION}, size {BLOB_HEADER.size}")
        first, blob_end = pos + header_size, pos + header_size + size
        if blob_end > end:
            raise KilnError(f"{where}: its {size} bytes of entries end at byte "
                            f"{blob_end:#x}, past the end of the section at {end:#x}")
        blobs.append(Blob(b, pos, tuple(_entries(data, b, first, blob_end, source))))
        pos = blob_end
    return blobs


def _entries(data: bytes, blob: int, pos: int, end: int, source: str) -> list[Entry]:
    entries: list[Entry] = []
    while pos < end:
        where = f"{source}: fatbin blob {blob} entry {len(entries)} at byte {pos:#x}"
        if pos + ENTRY_MIN_HEADER > end:
            raise KilnError(f"{where}: a {ENTRY_MIN_HEADER}-byte entry header runs past "
                            f"the end of its blob at byte {end:#x}")
        kind, version, header_size, payload_size = ENTRY_HEADER.unpack_from(data, pos)
        if kind not in KIND_NAMES:
            raise KilnError(f"{where}: entry kind {kind}; known kinds are "
                            f"{KIND_PTX} (PTX) and {KIND_ELF} (ELF)")
        if version != ENTRY_VERSION or header_size < ENTRY_MIN_HEADER or header_size % 8:
            raise KilnError(f"{where}: header version {version:#06x}, size {header_size}; "
                            f"this reader knows version {ENTRY_VERSION:#06x} and sizes "
                            f"of at least {ENTRY_MIN_HEADER}, in multiples of 8")
        (flags,) = FLAGS.unpack_from(data, pos + FLAGS_OFFSET)
        if flags & ~KNOWN_FLAGS:
            raise KilnError(f"{where}: flags {flags:#x} carry bits this reader does not "
                            f"know ({flags & ~KNOWN_FLAGS:#x}); they might change which "
                            "entry the runtime loads")
        (arch,) = ARCH.unpack_from(data, pos + ARCH_OFFSET)
        entry = Entry(blob, len(entries), pos, kind, arch, flags, header_size, payload_size)
        if entry.end > end:
            raise KilnError(f"{where}: its {payload_size}-byte payload ends at byte "
                            f"{entry.end:#x}, past the end of its blob at {end:#x}")
        entries.append(entry)
        pos = entry.end
    return entries


def read(data: bytes, source: str) -> list[Blob]:
    """The blobs of an ELF file's fatbin section; none for a file without GPU code."""
    found = [s for s in sections(data, source) if s.name == SECTION]
    if len(found) > 1:
        raise KilnError(f"{source}: {len(found)} {SECTION} sections, expected at most one")
    return parse(data, found[0].offset, found[0].end, source) if found else []


def slim(data: bytes, targets: tuple[int, ...], source: str) -> Slimmed:
    """``data`` with the payload of every entry no target would load zeroed.

    For several targets, an entry is kept when any of them would load it.
    """
    kept: list[Entry] = []
    zeroed: list[Entry] = []
    out = bytearray(data)
    for blob in read(data, source):
        keep = {e.index for target in targets for e in blob.chosen(target)}
        for entry in blob.entries:
            if entry.index in keep:
                kept.append(entry)
            else:
                out[entry.payload_offset:entry.end] = bytes(entry.payload_size)
                zeroed.append(entry)
    return Slimmed(bytes(out), kept, zeroed)
