"""(Re)write fa2/schemas/<version>.txt and the version's line of fa2/PIN from the pinned wheel.

The op schemas are read out of the wheel's compiled attention extensions
(vllm_flash_attn's _vllm_fa2_C and _vllm_fa3_C, and the attention ops of
_C_stable_libtorch); the FlashAttention commit comes from the sdist's CMake pin.
A binary with no readable schema fails, naming the file.
"""

from __future__ import annotations

import argparse

from kiln.abi.fa2 import PIN_PATH, extract, flash_attention_pin, snapshot_path, write_pin
from kiln.cmdoptions import add_version_option
from kiln.errors import naming
from kiln.upstream.fetch import fetch

NAME = "fa2-snapshot"
HELP = "extract the pinned wheel's attention op schemas into fa2/schemas/ and fa2/PIN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_version_option(parser, "upstream version (default: the lock's default)")


def run(args: argparse.Namespace) -> int:
    files = fetch(args.version)
    snapshot = extract(files)
    path = snapshot_path(snapshot.version)
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        path.write_text(snapshot.render())
    pin = flash_attention_pin(files)
    write_pin(pin)
    for ns in snapshot.namespaces.values():
        print(f"{ns.name}: {len(ns.schemas)} schema(s) from {ns.binary}")
    print(f"wrote {path} ({snapshot.count} schemas) and {PIN_PATH} "
          f"(FlashAttention {pin.commit[:12]} for vLLM {pin.version})")
    return 0
