"""port-check on the real 0.33.0 -> 0.34.0 pair and the overlay as it was before the
0.34.0 work (commit 017237f): the breaks a clean rebase hid are found from the overlay
alone. Fetches the pinned 0.33.0 and 0.34.0 sdists (sha256-checked, cached) and keeps
each tree's name index in kiln's cache: about 5 s warm, 15 s on a cold cache, on 2 cores.
"""

from __future__ import annotations

import io
import subprocess
import tarfile

import pytest

pytest.importorskip("griffe")

from kiln.build.wheel import OVERLAY_DIRS  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.commands.port_check import BLIND_SPOT  # noqa: E402
from kiln.paths import REPO_ROOT, cache_dir  # noqa: E402
from kiln.portcheck import port_check  # noqa: E402
from kiln.portcheck.apimodel import ApiModel  # noqa: E402
from kiln.portcheck.mirrors import mirrors_in  # noqa: E402
from kiln.portcheck.units import overlay_units  # noqa: E402
from kiln.series.series import Series  # noqa: E402
from kiln.upstream.lock import UpstreamLock  # noqa: E402
from kiln.upstream.pristine import PristineTree  # noqa: E402

BEFORE_034 = "017237f"  # main before the 0.34.0 work
PREWARM = "vllm/fork/dflash_prewarm.py"
PREPARE = "vllm.v1.worker.gpu.spec_decode.dflash.speculator.prepare_dflash_inputs"


@pytest.fixture(scope="module")
def trees():
    lock = UpstreamLock.load()
    return PristineTree.pinned("0.33.0", lock).root, PristineTree.pinned("0.34.0", lock).root


@pytest.fixture(scope="module")
def empty_series(tmp_path_factory):
    folder = tmp_path_factory.mktemp("series")
    (folder / "series").write_text("")
    return folder


@pytest.fixture(scope="module")
def findings(trees, empty_series, tmp_path_factory):
    """The 0.33.0-era vllm/, kvarn/ and specattn/, with one mirror marker added where
    dflash_prewarm re-derives prepare_dflash_inputs' BLOCK_SIZE (markers came later)."""
    archive = subprocess.run(["git", "-C", str(REPO_ROOT), "archive", BEFORE_034,
                              *(folder for folder, _ in OVERLAY_DIRS)], capture_output=True)
    assert archive.returncode == 0, f"needs the history of {BEFORE_034}: {archive.stderr.decode()}"
    checkout = tmp_path_factory.mktemp("checkout")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(checkout, filter="data")
    prewarm = checkout / PREWARM
    text = prewarm.read_text()
    anchor = "@torch.inference_mode()\ndef prewarm_input_kernel"
    assert text.count(anchor) == 1
    prewarm.write_text(text.replace(anchor, f"# mirrors: {PREPARE}\n{anchor}"))
    overlays = [(checkout / folder, target.replace("/", ".")) for folder, target in OVERLAY_DIRS]
    old, new = trees
    return port_check(old, "0.33.0", new, "0.34.0", Series.load(empty_series), overlays,
                      cache_dir() / "portcheck")


def by_where(findings, where):
    return [f for f in findings if f.where == where]


def test_the_removed_is_custom_mode_read_through_getattr_is_a_silent_default(findings):
    (finding,) = by_where(findings, "vllm/fork/kvarn_backend.py::vllm.v1.kv_cache_interface.KVQuantMode.is_custom_mode")
    assert finding.kind == "silent-default"
    assert "exists in 0.33.0 but not in 0.34.0" in finding.detail
    assert "getattr() silently returns its default instead" in finding.detail


def test_the_deprecated_parallel_drafting_is_found_through_vllm_config(findings):
    (finding,) = by_where(
        findings, "vllm/fork/spec_scratch.py::vllm.config.speculative.SpeculativeConfig.parallel_drafting")
    assert finding.kind == "deprecated"
    assert "its docstring: Deprecated and has no effect." in finding.detail


def test_a_mirror_of_the_changed_prepare_dflash_inputs_is_reported(findings):
    (finding,) = by_where(findings, f"{PREWARM}::{PREPARE}")
    assert finding.kind == "mirror-drift"
    assert "+    BLOCK_SIZE = 128" in finding.detail


def test_nothing_else_is_reported(findings):
    # The one other finding is a real break as well: 0.34.0 dropped Model Runner V1, and
    # with it VllmConfig.use_v2_model_runner, which the KVarN builder reads (typed by the
    # upstream __init__ it overrides).
    assert sorted((f.kind, f.where) for f in findings) == sorted([
        ("silent-default", "vllm/fork/kvarn_backend.py::vllm.v1.kv_cache_interface.KVQuantMode.is_custom_mode"),
        ("deprecated", "vllm/fork/spec_scratch.py::vllm.config.speculative.SpeculativeConfig.parallel_drafting"),
        ("mirror-drift", f"{PREWARM}::{PREPARE}"),
        ("removed-name", "vllm/fork/kvarn_backend.py::vllm.config.vllm.VllmConfig.use_v2_model_runner"),
    ])


def test_every_mirror_marker_in_the_checkout_names_a_definition_of_the_default_pin(empty_series):
    lock = UpstreamLock.load()
    model = ApiModel(PristineTree.pinned(lock.default, lock).root, lock.default)
    units = overlay_units([(REPO_ROOT / f, t.replace("/", ".")) for f, t in OVERLAY_DIRS],
                          Series.load(empty_series), [])
    marks = [(u.path, m) for u in units for m in mirrors_in(u)]
    assert marks, "no # mirrors: marker in the checkout"
    missing = [f"{path}:{m.line}: {m.target}" for path, m in marks if model.definition_text(m.target) is None]
    assert not missing, f"markers naming nothing in vLLM {lock.default}: {missing}"


def test_the_command_says_what_it_cannot_see(empty_series, capsys):
    code = main(["port-check", "--from", "0.33.0", "--to", "0.34.0", "--patches", str(empty_series)])
    out = capsys.readouterr().out
    assert code in (0, 1) and out.rstrip().endswith(BLIND_SPOT)
