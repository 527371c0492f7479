"""PEP 517 entry for `pip wheel .` and `python -m build --wheel`.

Both end in kiln's own wheel builder (kiln/build/wheel.py), so they write the same
bytes as `python -m kiln build`. Metadata comes from the same code, so what
pip resolves before the build is what the wheel declares.
"""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.dist_info import dist_info

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
# setuptools' .egg-info goes under build/: in the checkout's root it is a second `vllm`
# distribution, without the fork's entry points, that shadows the installed wheel's
# metadata wherever the root is on sys.path (tests, a `python` started there).
EGG_BASE = ROOT / "build" / "egg-info"
EGG_BASE.mkdir(parents=True, exist_ok=True)

from kiln.build.metadata import write_dist_info  # noqa: E402
from kiln.build.version import fork_version  # noqa: E402
from kiln.build.wheel import build_wheel  # noqa: E402
from kiln.upstream.lock import UpstreamLock  # noqa: E402


class KilnWheel(bdist_wheel):
    """Repack upstream's wheel with the series and overlay instead of compiling."""

    def run(self):
        build_wheel(Path(self.dist_dir), root=ROOT)


class KilnDistInfo(dist_info):
    """The fork wheel's METADATA, written before the build for pip's resolver."""

    def run(self):
        # setuptools' own run leaves the .egg-info its backend looks for next.
        super().run()
        (target,) = Path(self.output_dir).glob("*.dist-info")
        write_dist_info(target, root=ROOT)


setup(
    name="vllm",
    version=fork_version(UpstreamLock.load(ROOT / "requirements" / "upstream.lock").default, ROOT),
    cmdclass={"bdist_wheel": KilnWheel, "dist_info": KilnDistInfo},
    options={"egg_info": {"egg_base": str(EGG_BASE)}},
    # Nothing here is packaged by setuptools itself: kiln writes the wheel.
    packages=[],
    py_modules=[],
)
