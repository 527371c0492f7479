"""Pin a new upstream version: its files and hashes, and the fork's pins that follow upstream's.

File names and sha256 come from the package registry's simple index (PEP 691
JSON), never from text a person typed. The lock's ``default`` moves only when
asked, since the old wheel stays the default until the new build passes the tests.
"""

from __future__ import annotations

import re
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from kiln.build.pins import canonical, requirement_name
from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.upstream.fetch import index_files, index_url
from kiln.upstream.lock import PinnedFile, UpstreamLock, UpstreamRelease, version_key
from kiln.upstream.pristine import PristineTree

PROJECT = "vllm"
CUDA_REQUIREMENTS = "requirements/cuda.txt"
_VERSION_PIN = re.compile(r"==\s*([^\s;,]+)")
_TORCH_HEADER = re.compile(r"#\s*include\s*[<\"](?:torch|ATen|c10)/")


def registry_files(project: str = PROJECT, index: str | None = None) -> dict[str, str]:
    """File name -> sha256 for every file of the project the index lists."""
    index = index or index_url()
    try:
        files = index_files(project, index)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        raise KilnError(f"cannot read {index}/{project}/ (PEP 691 JSON): {e}; "
                        "check the network or PIP_INDEX_URL") from None
    return {f["filename"]: f.get("hashes", {}).get("sha256", "") for f in files}


def release_from_registry(version: str, wheel_template: str, files: dict[str, str]) -> UpstreamRelease:
    """The version's wheel (same tags as ``wheel_template``) and sdist, with their hashes."""
    sdist = f"{PROJECT}-{version}.tar.gz"
    tags = wheel_template.split("-", 2)[2]  # e.g. cp38-abi3-manylinux_2_28_x86_64.whl
    wheel = f"{PROJECT}-{version}-{tags}"
    of_version = sorted(n for n in files if n.startswith(f"{PROJECT}-{version}-") or n == sdist)
    if not of_version:
        known = sorted({m.group(1) for n in files if (m := re.match(rf"{PROJECT}-([^-]+?)(?:\.tar\.gz|-)", n))},
                       key=version_key)[-5:]
        raise KilnError(f"{PROJECT} {version} is not on the package index {index_url()} "
                        f"(latest there: {', '.join(known) or 'none'})")
    for name in (wheel, sdist):
        if name not in files:
            raise KilnError(f"{PROJECT} {version} has no {name} on the index; it has: {', '.join(of_version)}")
        if not re.fullmatch(r"[0-9a-f]{64}", files[name]):
            raise KilnError(f"the index gives no sha256 for {name}; a file whose hash is unknown "
                            "cannot be pinned")
    return UpstreamRelease(version, PinnedFile(wheel, files[wheel]), PinnedFile(sdist, files[sdist]))


def lock_text(lock: UpstreamLock, header: str) -> str:
    """The lock file: its comment header, then default, then each version, oldest first."""
    out = [header.rstrip("\n") + "\n" if header else "", f'default = "{lock.default}"\n']
    for version in sorted(lock.releases, key=version_key):
        r = lock.releases[version]
        out.append(f'\n[versions."{version}"]\nwheel = "{r.wheel.name}"\nwheel_sha256 = "{r.wheel.sha256}"\n'
                   f'sdist = "{r.sdist.name}"\nsdist_sha256 = "{r.sdist.sha256}"\n')
    return "".join(out)


def comment_header(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


# --- upstream's requirements and the fork's pins ---------------------------


def read_requirements(path: Path, seen: set[Path] | None = None) -> dict[str, str]:
    """Canonical project name -> requirement line, following ``-r`` includes."""
    seen = seen or set()
    if path in seen or not path.is_file():
        return {}
    seen.add(path)
    found: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].split("#", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith(("-r ", "--requirement")):
            found.update(read_requirements(path.parent / line.split(None, 1)[1], seen))
        elif not line.startswith("-"):
            found[requirement_name(line)] = line
    return found


def pinned_version(requirement: str | None) -> str | None:
    m = _VERSION_PIN.search(requirement or "")
    return m.group(1) if m else None


def cuda_pins(tree: Path) -> dict[str, str]:
    """Upstream's CUDA requirements, with flashinfer-cubin made explicit.

    Upstream dropped the flashinfer-cubin line (it is not on PyPI); the fork
    pins it to the flashinfer-python version, which it must equal.
    """
    pins = read_requirements(tree / CUDA_REQUIREMENTS)
    python = pinned_version(pins.get("flashinfer-python"))
    cubin = pins.get("flashinfer-cubin")
    if cubin is None:
        if python is not None:
            pins["flashinfer-cubin"] = f"flashinfer-cubin=={python}"
    elif pinned_version(cubin) != python:
        raise KilnError(f"{CUDA_REQUIREMENTS} pins {cubin!r} but flashinfer-python=={python}; "
                        "flashinfer-cubin must equal the flashinfer-python version")
    return pins


@dataclass
class PinUpdate:
    text: str
    changed: list[str] = field(default_factory=list)  # "name: old -> new"
    review: list[str] = field(default_factory=list)  # fork overrides whose upstream pin moved


def update_fork_pins(text: str, old: dict[str, str], new: dict[str, str]) -> PinUpdate:
    """Move each fork pin that follows upstream's pin; flag deliberate overrides to review.

    A fork line follows upstream when it pins the version upstream's old
    requirements pinned (flashinfer-cubin included); such lines take the new pin.
    Lines in a ``[X.Y.Z]`` section belong to that pin and stay as they are.
    """
    update = PinUpdate(text="")
    lines = []
    in_section = False
    for raw in text.splitlines(keepends=True):
        line = raw.split("#", 1)[0].strip()
        in_section = in_section or line.startswith("[")
        if not line or line.startswith("-") or in_section:
            lines.append(raw)
            continue
        name = requirement_name(line)
        mine, was, now = pinned_version(line), pinned_version(old.get(name)), pinned_version(new.get(name))
        if mine and was and now and mine == was and now != was:
            lines.append(raw.replace(mine, now, 1))
            update.changed.append(f"{name}: {was} -> {now}")
        else:
            if was != now and name in new and mine != now:
                update.review.append(f"{name}: the fork pins {line!r}; upstream moved "
                                     f"{old.get(name, '(none)')!r} -> {new[name]!r}")
            lines.append(raw)
    update.text = "".join(lines)
    return update


# --- torch: what a move of upstream's torch pin asks of the fork --------------


@dataclass(frozen=True)
class TorchMove:
    old: str | None
    new: str | None
    moved: list[str]  # upstream's torch-family requirement lines that changed
    rebuild: list[str]  # what depends on torch, and why

    def describe(self) -> list[str]:
        others = [line for line in self.moved if not line.startswith("torch:")]
        return [f"torch moves: {self.old or '(unpinned)'} -> {self.new or '(unpinned)'}"
                + (f"; with it {'; '.join(others)}" if others else ""),
                "rebuild against the new torch:", *(f"  {line}" for line in self.rebuild)]


def torch_move(old: dict[str, str], new: dict[str, str], root: Path = REPO_ROOT) -> TorchMove | None:
    """None while upstream's torch pin stays; else what moves and what must be rebuilt."""
    was, now = pinned_version(old.get("torch")), pinned_version(new.get("torch"))
    if was == now:
        return None
    moved = [line for line in upstream_changes(old, new) if line.startswith("torch")]
    return TorchMove(was, now, moved, torch_dependents(root, now))


def torch_dependents(root: Path, torch: str | None) -> list[str]:
    """What in the checkout at ``root`` is built or installed against upstream's torch.
    The KVarN CUDA library is not, while it includes no torch header (it is loaded with
    ctypes), nor are the fork's xgrammar wheels, while their build pins no torch."""
    found = [(f"the CPU test venv: kiln/testing/testenv.py installs the wheel's own torch pin, so the next "
             f"`tests/run` makes a new venv with torch=={torch}"),
             ("the GPU bundle (`python -m kiln gpu-bundle`): it carries upstream's compiled ops, "
             f"now built against torch {torch}, to a machine that keeps its own torch; rebuild it "
             "and rerun tests/gpu there")]
    if "torch" in read_requirements(root / "requirements" / "xgrammar-build.txt"):
        found.append("the fork's xgrammar wheels: requirements/xgrammar-build.txt builds them "
                     "against torch (`python -m kiln build-xgrammar`)")
    if sorted((root / "csrc").glob("*.cu")):
        found.append("the fork's torch extension _kiln_C: CMakeLists.txt links csrc/*.cu "
                     "against torch (`python -m kiln build` on a CUDA machine)")
    if any(_TORCH_HEADER.search(p.read_text()) for p in sorted((root / "csrc" / "kvarn").glob("*.cu"))):
        found.append("the KVarN CUDA library: csrc/kvarn/ includes torch headers "
                     "(`python -m kiln build` on a CUDA machine)")
    return found


@dataclass
class PinBump:
    release: UpstreamRelease
    default: str
    pins: PinUpdate
    upstream_changes: list[str]
    torch: TorchMove | None


def upstream_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Upstream's requirement lines that differ between the two versions."""
    changes = []
    for name in sorted(set(old) | set(new), key=canonical):
        if old.get(name) != new.get(name):
            changes.append(f"{name}: {old.get(name, '(none)')} -> {new.get(name, '(none)')}")
    return changes


def pin_bump(version: str, *, lock_path: Path, pins_path: Path, make_default: bool,
             files: dict[str, str] | None = None, log=print) -> PinBump:
    """Pin ``version`` in the lock and move the fork's pins; write both files."""
    lock = UpstreamLock.load(lock_path)
    template = lock.release().wheel.name
    release = release_from_registry(version, template, files if files is not None else registry_files())
    releases = dict(lock.releases)
    if version in releases and releases[version] != release:
        raise KilnError(f"{lock_path.name} pins {version} with other files or hashes than the index "
                        f"lists now ({releases[version]} vs {release}); refusing to overwrite a pin")
    releases[version] = release
    new_lock = UpstreamLock(default=version if make_default else lock.default, releases=releases,
                            path=lock_path)
    old_tree = PristineTree.pinned(lock.default, lock).root
    new_tree = PristineTree.pinned(version, new_lock).root
    old_pins, new_pins = cuda_pins(old_tree), cuda_pins(new_tree)
    pins_text = pins_path.read_text() if pins_path.exists() else ""
    update = update_fork_pins(pins_text, old_pins, new_pins)
    lock_path.write_text(lock_text(new_lock, comment_header(lock_path.read_text())))
    if update.text != pins_text:
        pins_path.write_text(update.text)
    return PinBump(release, new_lock.default, update, upstream_changes(old_pins, new_pins),
                   torch_move(old_pins, new_pins))
