"""Pin a new upstream version in requirements/upstream.lock and move the fork's pins.

The wheel (same tags as the current default's) and the sdist, with their
sha256, are read from the package registry's simple index. The lock's default
stays where it is unless --make-default: the old wheel stays the default until
the new build passes the test suite. Fork pins (requirements/fork-pins.txt)
that follow upstream's requirements files move with them; flashinfer-cubin,
which upstream's CUDA requirements no longer list, follows flashinfer-python.
When upstream's torch pin moves, it says so and names what must be rebuilt
against the new torch (only what is built or installed against it).
"""

from __future__ import annotations

import argparse

from kiln.paths import REPO_ROOT
from kiln.upstream.lock import LOCK_PATH
from kiln.upstream.pinbump import pin_bump

NAME = "pin-bump"
HELP = "pin a new upstream version (files + sha256 from the registry) and move the fork's pins"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, help="upstream version to pin, e.g. 0.33.0")
    parser.add_argument("--make-default", action="store_true",
                        help="also make it the lock's default (only once its build passes the tests)")


def run(args: argparse.Namespace) -> int:
    result = pin_bump(args.to, lock_path=LOCK_PATH, pins_path=REPO_ROOT / "requirements" / "fork-pins.txt",
                      make_default=args.make_default)
    r = result.release
    print(f"pinned {r.version}: {r.wheel.name} {r.wheel.sha256}\n        {r.sdist.name} {r.sdist.sha256}")
    print(f"default: {result.default}")
    for line in result.pins.changed:
        print(f"fork pin moved: {line}")
    for line in result.pins.review:
        print(f"review fork pin: {line}")
    if result.upstream_changes:
        print("upstream's CUDA requirements changed (fork wheel takes them from upstream's metadata):")
        for line in result.upstream_changes:
            print(f"  {line}")
    if result.torch is not None:
        print("\n".join(result.torch.describe()))
    return 0
