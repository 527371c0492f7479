"""Synthetic upstream trees and series for kiln's unit tests (no network, no vLLM)."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

HEADER = """\
Topic: {name}
Kind: fix
What: {what}
Upstream: none
Cut-against: 1.0.0
Retires-when: never
"""


def make_diff(root: Path, path: str, new_text: str) -> str:
    """A git-style diff of one file of ``root`` against ``new_text``."""
    old = root / path
    result = subprocess.run(
        ["git", "diff", "--no-index", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
         str(old), "-"],
        input=new_text, capture_output=True, text=True,
    )
    # git names the files by their absolute paths; rewrite them to the tree's.
    lines = []
    for line in result.stdout.splitlines(keepends=True):
        if line.startswith("diff --git"):
            line = f"diff --git a/{path} b/{path}\n"
        elif line.startswith("--- "):
            line = f"--- a/{path}\n"
        elif line.startswith("+++ "):
            line = f"+++ b/{path}\n"
        elif line.startswith(("index ", "new file mode", "deleted file mode")):
            continue
        lines.append(line)
    return "".join(lines)


def write_patch(patches: Path, number: int, name: str, diff: str, what: str = "a change") -> Path:
    patches.mkdir(parents=True, exist_ok=True)
    path = patches / f"{number:04d}-{name}.patch"
    path.write_text(HEADER.format(name=name, what=what) + "---\n" + diff)
    series = patches / "series"
    entries = series.read_text() if series.exists() else ""
    series.write_text(entries + path.name + "\n")
    return path


@pytest.fixture
def pristine(tmp_path: Path) -> Path:
    """A small upstream tree: a package with two modules."""
    root = tmp_path / "pristine"
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "a.py").write_text("".join(f"line {i}\n" for i in range(1, 41)))
    (root / "vllm" / "b.py").write_text(textwrap.dedent("""\
        def f(x):
            return x + 1


        def g(y):
            return y * 2
        """))
    return root


WHEEL_NAME = "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
SDIST_NAME = "vllm-1.0.0.tar.gz"


def _synthetic_wheel(path: Path, payload_mib: int) -> None:
    """An upstream-shaped wheel: vllm/ with a version module and ``payload_mib`` MiB of
    incompressible "compiled" files (so writing the fork wheel takes a moment), and a
    .dist-info."""
    import os
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("vllm/__init__.py", "from vllm._version import __version__\n")
        z.writestr("vllm/_version.py", "__version__ = '1.0.0'\n")
        for i in range(payload_mib):
            z.writestr(f"vllm/_C{i}.abi3.so", os.urandom(1 << 20))
        dist = "vllm-1.0.0.dist-info"
        z.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 1.0.0\n"
                   "Requires-Dist: torch==2.13.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                   "Tag: cp38-abi3-manylinux_2_28_x86_64\n")
        z.writestr(f"{dist}/entry_points.txt", "[console_scripts]\nvllm = vllm.cli:main\n")
        z.writestr(f"{dist}/licenses/LICENSE", "upstream's license text\n")
        z.writestr(f"{dist}/RECORD", "")


def _synthetic_sdist(path: Path) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for name, text in (("vllm/__init__.py", "X = 1\n"), ("pyproject.toml", "[project]\n")):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-1.0.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


class KilnCheckout:
    """A repository root laid out like this one (a copy of kiln/ and NOTICE, a lock, a
    series, an overlay, git) whose lock pins a small synthetic upstream wheel and sdist,
    already in its own KILN_CACHE: ``python -m kiln build`` runs there for real in
    seconds. ``kvarn_cuda`` adds the KVarN CUDA source and its nvcc command, which the
    build then compiles (where nvcc is) into an empty cache."""

    def __init__(self, base: Path, payload_mib: int = 12, kvarn_cuda: bool = False):
        import hashlib
        import os
        import shutil

        from kiln.paths import REPO_ROOT

        self.root = base / "checkout"
        self.cache = base / "cache"
        upstream = self.cache / "upstream"
        upstream.mkdir(parents=True)
        _synthetic_wheel(upstream / WHEEL_NAME, payload_mib)
        _synthetic_sdist(upstream / SDIST_NAME)
        sha = {n: hashlib.sha256((upstream / n).read_bytes()).hexdigest() for n in (WHEEL_NAME, SDIST_NAME)}
        shutil.copytree(REPO_ROOT / "kiln", self.root / "kiln",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy(REPO_ROOT / "NOTICE", self.root / "NOTICE")
        if kvarn_cuda:
            shutil.copytree(REPO_ROOT / "csrc" / "kvarn", self.root / "csrc" / "kvarn")
            (self.root / "kvarn").mkdir()
            shutil.copy(REPO_ROOT / "kvarn" / "cuda_build.py", self.root / "kvarn")
        (self.root / "requirements").mkdir()
        (self.root / "requirements" / "upstream.lock").write_text(
            f'default = "1.0.0"\n\n[versions."1.0.0"]\nwheel = "{WHEEL_NAME}"\n'
            f'wheel_sha256 = "{sha[WHEEL_NAME]}"\nsdist = "{SDIST_NAME}"\n'
            f'sdist_sha256 = "{sha[SDIST_NAME]}"\n')
        (self.root / "requirements" / "fork-pins.txt").write_text("")
        (self.root / "patches" / "1.0.0").mkdir(parents=True)
        (self.root / "patches" / "1.0.0" / "series").write_text("")
        (self.root / "vllm" / "fork").mkdir(parents=True)
        (self.root / "vllm" / "fork" / "__init__.py").write_text("FORK = True\n")
        self.env = {**os.environ, "KILN_CACHE": str(self.cache), "SOURCE_DATE_EPOCH": "1700000000",
                    "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PYTHONDONTWRITEBYTECODE": "1"}
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "checkout"]):
            subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                           cwd=self.root, check=True, capture_output=True)

    def kiln(self, *args: str, **env: str) -> subprocess.Popen:
        """``python -m kiln ARGS`` started in the checkout (stdout/stderr piped, text)."""
        import sys

        return subprocess.Popen([sys.executable, "-m", "kiln", *args], cwd=self.root,
                                env={**self.env, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        proc = self.kiln(*args, **env)
        out, err = proc.communicate(timeout=300)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def can_mount_in_own_namespace() -> bool:
    """Whether unshare can give a process a private mount namespace to mount a tmpfs in."""
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                            "mount -t tmpfs -o ro none /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.fixture
def checkout(tmp_path: Path) -> KilnCheckout:
    return KilnCheckout(tmp_path)
