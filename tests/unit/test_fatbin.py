"""kiln.abi.fatbin: reading and slimming CUDA fatbins, on synthetic ELF files and on nvcc's."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from kiln.abi import elf, fatbin
from kiln.errors import KilnError

PLAIN = fatbin.FLAG_64BIT | fatbin.FLAG_LINUX
ARCH_SPECIFIC = PLAIN | fatbin.FLAG_ARCH_SPECIFIC
FAMILY = PLAIN | fatbin.FLAG_FAMILY_SPECIFIC
ELF, PTX = fatbin.KIND_ELF, fatbin.KIND_PTX
TEXT = b"\xcc" * 24  # a stand-in for host code, before the fatbin section


def entry(kind: int, arch: int, payload: bytes, flags: int = PLAIN, header_size: int = 64,
          version: int = fatbin.ENTRY_VERSION, payload_size: int | None = None) -> bytes:
    padded = payload + bytes(-len(payload) % 8)
    header = bytearray(header_size)
    struct.pack_into("<HHIQ", header, 0, kind, version, header_size,
                     len(padded) if payload_size is None else payload_size)
    # The format's offsets written out, not taken from the module under test.
    struct.pack_into("<I", header, 28, arch)
    struct.pack_into("<Q", header, 40, flags)
    return bytes(header) + padded


def blob(*entries: bytes, magic: int = fatbin.BLOB_MAGIC, version: int = 1,
         header_size: int = 16, size: int | None = None) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", magic, version, header_size,
                       len(body) if size is None else size) + body


def code(arch: int, size: int = 40) -> bytes:
    """A payload no other entry shares, never zero."""
    return bytes((arch + i) % 255 + 1 for i in range(size))


def elf_file(section: bytes, name: bytes = b".nv_fatbin") -> tuple[bytes, int]:
    """A minimal ELF64 shared object holding ``section``; (bytes, the section's offset)."""
    names = b"\0.text\0" + name + b"\0.shstrtab\0"
    text_at = 64
    section_at = text_at + len(TEXT)
    names_at = section_at + len(section)
    headers_at = names_at + len(names) + (-(names_at + len(names)) % 8)
    shdr = struct.Struct("<IIQQQQIIQQ")
    headers = b"".join([
        bytes(shdr.size),
        shdr.pack(1, 1, 6, 0, text_at, len(TEXT), 0, 0, 16, 0),
        shdr.pack(7, 1, 2, 0, section_at, len(section), 0, 0, 8, 0),
        shdr.pack(8 + len(name), 3, 0, 0, names_at, len(names), 0, 0, 1, 0),
    ])
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, headers_at, 0,
                         64, 0, 0, shdr.size, 4, 3)
    body = header + TEXT + section + names
    return body + bytes(headers_at - len(body)) + headers, section_at


# Four blobs that exercise every rule: newest same-major machine code, sm_90 beside
# sm_90a, the PTX fallback, the newest PTX at or below the target, nothing at all.
BLOBS = [
    [(ELF, 80, PLAIN), (ELF, 86, PLAIN), (ELF, 89, PLAIN), (ELF, 90, PLAIN),
     (ELF, 90, ARCH_SPECIFIC), (PTX, 90, PLAIN)],
    [(ELF, 75, PLAIN), (ELF, 80, PLAIN), (PTX, 80, PLAIN)],
    [(PTX, 80, PLAIN), (PTX, 89, PLAIN), (ELF, 120, PLAIN)],
    [(ELF, 100, PLAIN)],
]


def sample() -> bytes:
    return elf_file(b"".join(
        blob(*(entry(kind, arch, code(arch + 7 * i + 50 * b), flags)
               for i, (kind, arch, flags) in enumerate(entries)))
        for b, entries in enumerate(BLOBS)))[0]


def names(entries) -> list[list[str]]:
    by_blob: list[list[str]] = [[] for _ in BLOBS]
    for e in entries:
        by_blob[e.blob].append(e.name)
    return by_blob


def test_parse_reads_every_blob_and_entry_with_its_place():
    data = sample()
    blobs = fatbin.read(data, "sample.so")
    assert [[(e.kind, e.arch, e.flags) for e in b.entries] for b in blobs] == BLOBS
    section = next(s for s in elf.sections(data, "sample.so") if s.name == ".nv_fatbin")
    assert blobs[0].offset == section.offset and blobs[0].entries[0].offset == section.offset + 16
    for b in blobs:
        for e in b.entries:
            expected = code(e.arch + 7 * e.index + 50 * b.index)
            assert data[e.payload_offset:e.payload_offset + 40] == expected
    last = blobs[-1].entries[-1]
    assert last.end == section.end
    assert [e.name for e in blobs[0].entries] == [
        "sm_80 ELF", "sm_86 ELF", "sm_89 ELF", "sm_90 ELF", "sm_90a ELF", "compute_90 PTX"]


def test_a_file_without_a_fatbin_section_has_no_gpu_code():
    data, _ = elf_file(b"not GPU code", name=b".rodata")
    assert fatbin.read(data, "host.so") == []
    assert fatbin.slim(data, (90,), "host.so").data == data


@pytest.mark.parametrize("targets, kept", [
    ((90,), [["sm_90 ELF", "sm_90a ELF"], ["compute_80 PTX"], ["compute_89 PTX"], []]),
    ((89,), [["sm_89 ELF"], ["sm_80 ELF"], ["compute_89 PTX"], []]),
    ((86,), [["sm_86 ELF"], ["sm_80 ELF"], ["compute_80 PTX"], []]),
    ((80,), [["sm_80 ELF"], ["sm_80 ELF"], ["compute_80 PTX"], []]),
    ((86, 90), [["sm_86 ELF", "sm_90 ELF", "sm_90a ELF"], ["sm_80 ELF", "compute_80 PTX"],
                ["compute_80 PTX", "compute_89 PTX"], []]),
])
def test_slimming_keeps_what_the_runtime_loads_on_each_target(targets, kept):
    data = sample()
    slim = fatbin.slim(data, targets, "sample.so")
    assert names(slim.kept) == kept
    assert len(slim.kept) + len(slim.zeroed) == sum(map(len, BLOBS))
    assert len(slim.data) == len(data)
    expected = bytearray(data)
    for e in slim.zeroed:
        expected[e.payload_offset:e.end] = bytes(e.payload_size)
    assert slim.data == bytes(expected)  # only the zeroed payloads changed
    for e in slim.kept:
        assert slim.data[e.offset:e.end] == data[e.offset:e.end]
    assert slim.zeroed_bytes == sum(e.payload_size for e in slim.zeroed)
    assert elf.sections(slim.data, "slim") == elf.sections(data, "sample")


def test_which_targets_an_entry_loads_on():
    def make(kind, arch, flags=PLAIN):
        return fatbin.Entry(0, 0, 0, kind, arch, flags, 64, 0)

    assert [t for t in (80, 86, 89, 90) if make(ELF, 86).loads_on(t)] == [86, 89]
    assert not make(ELF, 80).loads_on(90)  # machine code never crosses a major version
    assert make(PTX, 80).loads_on(90) and make(PTX, 90).loads_on(120)
    assert not make(PTX, 90).loads_on(89)
    assert make(ELF, 90, ARCH_SPECIFIC).loads_on(90)
    assert not make(PTX, 90, ARCH_SPECIFIC).loads_on(100)
    assert make(ELF, 100, FAMILY).loads_on(103) and not make(ELF, 100, FAMILY).loads_on(120)
    assert make(PTX, 100, FAMILY).loads_on(103) and not make(PTX, 100, FAMILY).loads_on(120)


def _malformed(blobs: list[bytes]) -> tuple[bytes, int]:
    return elf_file(b"".join(blobs))


GOOD = blob(entry(ELF, 90, code(90)))
GOOD_SIZE = len(GOOD)


@pytest.mark.parametrize("blobs, where, what", [
    ([GOOD, blob(entry(ELF, 90, code(1)), magic=0x12345678)],
     ("blob 1", GOOD_SIZE), "magic 0x12345678, expected 0xba55ed50"),
    ([blob(entry(ELF, 90, code(1)), version=2)], ("blob 0", 0), "header version 2, size 16"),
    ([blob(entry(ELF, 90, code(1)), header_size=24)], ("blob 0", 0), "header version 1, size 24"),
    ([blob(entry(ELF, 90, code(1)), entry(3, 90, code(2)))],
     ("blob 0 entry 1", 16 + 64 + 40), "entry kind 3; known kinds are 1 (PTX) and 2 (ELF)"),
    ([GOOD, blob(entry(ELF, 90, code(1), version=0x0102))],
     ("blob 1 entry 0", GOOD_SIZE + 16), "header version 0x0102, size 64"),
    ([blob(entry(ELF, 90, code(1), header_size=48) + bytes(16))],
     ("blob 0 entry 0", 16), "header version 0x0101, size 48"),
    ([blob(entry(ELF, 90, code(1)), entry(PTX, 90, code(2), payload_size=400))],
     ("blob 0 entry 1", 16 + 104), "its 400-byte payload ends at byte"),
    ([blob(entry(ELF, 90, code(1)), entry(ELF, 80, code(2), flags=PLAIN | 0x4))],
     ("blob 0 entry 1", 16 + 104), "flags 0x15 carry bits this reader does not know (0x4)"),
    ([blob(entry(ELF, 90, code(1)), bytes(24))],
     ("blob 0 entry 1", 16 + 104), "a 64-byte entry header runs past the end of its blob"),
    ([GOOD, blob(entry(ELF, 90, code(1)), size=4096)],
     ("blob 1", GOOD_SIZE), "its 4096 bytes of entries end at byte"),
    ([GOOD, b"\x50\xed\x55\xba\x01\x00"], ("blob 1", GOOD_SIZE),
     "header runs past the end of the section"),
])
def test_what_the_reader_does_not_understand_is_refused_by_place(blobs, where, what):
    data, section_at = _malformed(blobs)
    label, offset = where
    with pytest.raises(KilnError) as err:
        fatbin.read(data, "bad.so")
    message = str(err.value)
    assert message.startswith(f"bad.so: fatbin {label} at byte {section_at + offset:#x}: "), message
    assert what in message


def test_files_that_are_not_little_endian_elf64_are_refused():
    with pytest.raises(KilnError, match="bad.so: not an ELF file"):
        fatbin.read(b"MZ\x90\x00" + bytes(60), "bad.so")
    data, _ = elf_file(GOOD)
    with pytest.raises(KilnError, match="only 64-bit little-endian"):
        fatbin.read(data[:4] + b"\x01" + data[5:], "bad.so")
    with pytest.raises(KilnError, match="past the end of the"):
        fatbin.read(data[:len(data) - 10], "bad.so")


# A real library from nvcc: its own kernels for four arches plus PTX, a second
# translation unit with only sm_80 code and PTX, a third for sm_90a alone. Stored
# uncompressed, so every payload can be checked against the arch its header names.
SOURCES = {
    "all.cu": "-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_86,code=sm_86 "
              "-gencode=arch=compute_89,code=sm_89 "
              "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    "old.cu": "-gencode=arch=compute_80,code=[sm_80,compute_80]",
    "hopper.cu": "-gencode=arch=compute_90a,code=[sm_90a,compute_90a]",
}
KERNEL = ("__global__ void k_{0}(float *x, float a, int n) {{ int i = blockIdx.x * blockDim.x "
          "+ threadIdx.x; if (i < n) x[i] = x[i] * a + {1}.0f; }}\n")


@pytest.fixture(scope="module")
def nvcc_library(tmp_path_factory) -> bytes:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    tmp = tmp_path_factory.mktemp("nvcc")
    objects = []
    for n, (source, gencode) in enumerate(SOURCES.items()):
        (tmp / source).write_text(KERNEL.format(Path(source).stem, n))
        obj = tmp / f"{Path(source).stem}.o"
        subprocess.run([nvcc, "-c", "-Xcompiler", "-fPIC", *gencode.split(), "-Xfatbin",
                        "--compress-mode=none", str(tmp / source), "-o", str(obj)],
                       check=True, capture_output=True)
        objects.append(str(obj))
    subprocess.run([nvcc, "-shared", *objects, "-o", str(tmp / "lib.so")],
                   check=True, capture_output=True)
    return (tmp / "lib.so").read_bytes()


def _ours(blobs: list[fatbin.Blob]) -> dict[str, fatbin.Blob]:
    """Our three blobs by source (the CUDA runtime library linked in brings its own)."""
    wanted = {
        "all.cu": ["compute_90 PTX", "sm_80 ELF", "sm_86 ELF", "sm_89 ELF", "sm_90 ELF"],
        "old.cu": ["compute_80 PTX", "sm_80 ELF"],
        "hopper.cu": ["compute_90a PTX", "sm_90a ELF"],
    }
    found = {}
    for b in blobs:
        for source, entries in wanted.items():
            if sorted(e.name for e in b.entries) == entries:
                found[source] = b
    assert sorted(found) == sorted(wanted), [sorted(e.name for e in b.entries) for b in blobs]
    return found


def test_nvcc_headers_name_the_arch_their_payloads_were_built_for(nvcc_library):
    ours = _ours(fatbin.read(nvcc_library, "lib.so"))
    for b in ours.values():
        for e in b.entries:
            payload = nvcc_library[e.payload_offset:e.end]
            if e.is_elf:
                assert payload[:4] == b"\x7fELF" and struct.unpack_from("<H", payload, 18)[0] == 190
                (e_flags,) = struct.unpack_from("<I", payload, 48)
                assert (e_flags >> 8) & 0xFF == e.arch, e.name
            else:
                target = re.search(rb"\.target\s+sm_(\d+)(a?)", payload)
                assert int(target[1]) == e.arch, e.name
                assert bool(target[2]) == bool(e.flags & fatbin.FLAG_ARCH_SPECIFIC), e.name


@pytest.mark.parametrize("targets, kept", [
    ((90,), {"all.cu": ["sm_90 ELF"], "old.cu": ["compute_80 PTX"],
             "hopper.cu": ["sm_90a ELF"]}),
    ((86,), {"all.cu": ["sm_86 ELF"], "old.cu": ["sm_80 ELF"], "hopper.cu": []}),
    ((80, 90), {"all.cu": ["sm_80 ELF", "sm_90 ELF"], "old.cu": ["compute_80 PTX", "sm_80 ELF"],
                "hopper.cu": ["sm_90a ELF"]}),
])
def test_slimming_an_nvcc_library_keeps_payloads_byte_for_byte_and_zeroes_the_rest(
        nvcc_library, targets, kept):
    slim = fatbin.slim(nvcc_library, targets, "lib.so")
    assert len(slim.data) == len(nvcc_library)
    assert elf.sections(slim.data, "slim") == elf.sections(nvcc_library, "lib.so")
    kept_ids = {(e.blob, e.index) for e in slim.kept}
    for source, b in _ours(fatbin.read(nvcc_library, "lib.so")).items():
        assert sorted(e.name for e in b.entries if (e.blob, e.index) in kept_ids) == kept[source]
        for e in b.entries:
            payload = slim.data[e.payload_offset:e.end]
            if (e.blob, e.index) in kept_ids:
                assert payload == nvcc_library[e.payload_offset:e.end]
            else:
                assert payload == bytes(e.payload_size)
    expected = bytearray(nvcc_library)
    for e in slim.zeroed:
        expected[e.payload_offset:e.end] = bytes(e.payload_size)
    assert slim.data == bytes(expected)
