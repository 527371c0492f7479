"""Write an offline bundle that runs the fork's GPU test tier (tests/gpu) on a GPU machine.

For an x86_64 Linux machine with an NVIDIA GPU, Python 3.12 and a CUDA build of
torch >= 2.11 preinstalled, and no network or vLLM (the lent H200 is one). The
folder (at most 60 MiB) holds the fork wheel's Python files, its compiled ops with
the GPU code of every other chip zeroed (--arch picks the chips: 80, 86, 89, 90),
empty stand-ins for the FlashAttention extensions it leaves out, the pinned wheels
of requirements/gpu-bundle.lock, the fork's xgrammar wheel for Python 3.12 (--xgrammar,
or built as `kiln build` does), and kiln/, tests/, bench/ and kvarn/. Copy it there
and run

    DIR/run RESULTS_DIR [extra pytest args]

which refuses a machine it cannot run on (no CUDA GPU, another Python, a glibc older
than the wheels' manylinux tags need, a CPU torch, torch < 2.11, a GPU of another
arch), installs into a temporary prefix, runs pytest on tests/gpu
with the hub offline, writes RESULTS_DIR/junit.xml, pytest.log and summary.json,
and exits with pytest's status. Serve with --attention-backend TRITON_ATTN or a
KVarN --kv-cache-dtype: FlashAttention is not in the bundle.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.testing.gpubundle import ALLOWED_ARCHS, CARRIED, build_gpu_bundle, mib, parse_archs

NAME = "gpu-bundle"
HELP = "write an offline bundle that runs the GPU test tier on a GPU machine (DIR/run RESULTS)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="the bundle's folder (an earlier bundle there is replaced)")
    parser.add_argument("--arch", action="append", metavar="SM",
                        help="GPU arch(s) to keep code for, repeatable or comma-separated: "
                        f"{', '.join(map(str, ALLOWED_ARCHS))} (default: 90)")
    parser.add_argument("--wheel", type=Path, metavar="PATH",
                        help="the fork wheel (default: build it from this checkout)")
    parser.add_argument("--xgrammar", type=Path, metavar="PATH",
                        help="the fork's xgrammar wheel for Python 3.12, e.g. "
                        "dist/xgrammar-*-cp312-*.whl (default: the cached build, made if missing)")


def run(args: argparse.Namespace) -> int:
    archs = parse_archs(args.arch or ["90"])
    bundle = build_gpu_bundle(args.out, archs, args.wheel, args.xgrammar)
    compiled = sum(size for part, size in bundle.parts.items() if part.startswith("compiled/"))
    wheels = sum(size for part, size in bundle.parts.items() if part.startswith("wheels/"))
    print(f"wrote {bundle.path} ({mib(bundle.size)}) in {bundle.seconds:.0f} s: vllm "
          f"{bundle.fork_version} for {', '.join(f'sm_{a}' for a in bundle.archs)}; "
          f"{len(CARRIED)} compiled file(s) {mib(compiled)}, wheels {mib(wheels)}")
    print(f"run it on the GPU machine with: {bundle.path}/run RESULTS_DIR")
    return 0
