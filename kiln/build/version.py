"""The fork's version: upstream's release plus ``+kiln.N``, from git tags.

Fork releases are tagged ``kiln-N``. At a tag on a clean tree the version is
``<upstream>+kiln.N``; past it, ``<upstream>+kiln.N.<distance>.g<commit>``;
without any tag N is 0. A build from a tree with uncommitted changes gets a
``.dirty`` suffix instead of being refused, so development builds still work
while no such wheel can pass for a release.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from kiln.errors import KilnError
from kiln.paths import REPO_ROOT

TAG_REGEX = r"^kiln-(?P<version>\d+)$"


def fork_version(upstream: str, root: Path = REPO_ROOT) -> str:
    try:
        from setuptools_scm import get_version
    except ImportError:
        raise KilnError(
            "setuptools-scm is needed for the fork version; "
            "pip install -r requirements/kiln.txt"
        ) from None

    def scheme(scm_version) -> str:
        release = scm_version.tag.release[0] if scm_version.tag.release else 0
        local = f"kiln.{release}"
        if scm_version.distance:
            local += f".{scm_version.distance}.{scm_version.node[:13]}"
        if scm_version.dirty:
            local += ".dirty"
        return f"{upstream}+{local}"

    try:
        with warnings.catch_warnings():
            # 10.x deprecates the tag_regex argument in favour of pyproject config,
            # which this computed scheme cannot use; the pin keeps it working.
            warnings.simplefilter("ignore", DeprecationWarning)
            return get_version(
                root=str(root), version_scheme=scheme, local_scheme=lambda v: "",
                tag_regex=TAG_REGEX, fallback_version=None,
            )
    except LookupError as e:
        raise KilnError(f"cannot read the fork version from git in {root}: {e}") from None


def version_tuple(version: str) -> tuple[int | str, ...]:
    """(0, 32, 0, 'kiln.3', ...) in the shape setuptools-scm gives upstream."""
    public, _, local = version.partition("+")
    parts: list[int | str] = [int(p) if p.isdigit() else p for p in public.split(".")]
    if local:
        parts.append(local)
    return tuple(parts)


def is_fork_version(version: str) -> bool:
    return re.search(r"\+kiln\.\d+", version) is not None
