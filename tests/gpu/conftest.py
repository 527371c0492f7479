"""The GPU tier: the fork served on a CUDA GPU from the offline bundle (`kiln gpu-bundle`,
then `DIR/run RESULTS`); skipped where there is no GPU, so never run by CPU CI.

Tests name the scenarios they read (``@pytest.mark.scenarios``); the session builds
the models those need with ``kiln.testing.tinymodel``, runs every needed scenario as its own
process (side by side, except the ``exclusive`` speed runs, which go one at a time
after the rest), and writes all results to ``$KILN_GPU_RESULTS/gpu-results.json`` plus
the scenarios' logs as one tarball. The speed runs read $KILN_GPU_SPEED_SHAPES (which
batch x context pairs) and $KILN_GPU_SPEED_PROFILE (decode steps to profile after the
table; tests/gpu/specs.py says what each allows).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from tests.gpu.process_groups import ProcessGroups
from tests.gpu.specs import MODELS, SCENARIOS

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_TIMEOUT_S = int(os.environ.get("KILN_GPU_SCENARIO_TIMEOUT", "420"))
PARALLEL = int(os.environ.get("KILN_GPU_PARALLEL", "16"))
ENGINES = ProcessGroups()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "scenarios(*names): the GPU scenarios a test reads")


def pytest_collection_modifyitems(config, items):
    gpu_items = [i for i in items if "tests/gpu/" in str(i.fspath).replace(os.sep, "/")]
    if not _has_cuda():
        skip = pytest.mark.skip(reason="the GPU tier needs a CUDA GPU (run it via kiln gpu-bundle)")
        for item in gpu_items:
            item.add_marker(skip)
        return


def _needed(items) -> list[str]:
    """The scenarios of the tests left after selection (-k, -m, node ids)."""
    needed: list[str] = []
    for item in items:
        for mark in item.iter_markers("scenarios"):
            needed += [n for n in mark.args if n not in needed]
    return needed


def _build_models(names: set[str], folder: Path) -> dict[str, str]:
    """Each model in a process of its own, all at once; drafters after their targets."""
    drafters = {n for n in names if "dflash2_drafter" in MODELS[n]}
    targets = (names - drafters) | {MODELS[n]["dflash2_drafter"]["target"] for n in drafters}
    paths = _build(targets, folder, lambda name: (
        f"tinymodel.build(out=Path(sys.argv[1]), spec=tinymodel.preset(**{MODELS[name]!r}))"))

    def drafter(name: str) -> str:
        fields = dict(MODELS[name]["dflash2_drafter"])
        target = paths[fields.pop("target")]
        return (f"tinymodel.build_dflash2_drafter({target!r}, out=Path(sys.argv[1]), "
                f"spec=tinymodel.DrafterSpec(**{fields!r}))")

    return {**paths, **_build(drafters, folder, drafter)}


def _build(names: set[str], folder: Path, call) -> dict[str, str]:
    procs = {}
    for name in sorted(names):
        code = f"import sys; from kiln.testing import tinymodel; from pathlib import Path; print({call(name)})"
        procs[name] = subprocess.Popen([sys.executable, "-c", code, str(folder / name)],
                                       cwd=ROOT, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    paths = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"building model {name} failed:\n{stderr[-3000:]}")
        paths[name] = stdout.strip().splitlines()[-1]
    return paths


def _run(name: str, models: dict[str, str], work: Path) -> dict:
    func, model, spec = SCENARIOS[name]
    spec = {**spec, "model": models[model], "log_dir": str(work / name)}
    if "drafter" in spec:
        spec["drafter"] = models[spec["drafter"]]
    (work / name).mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = (work / name / f for f in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1",
           "KILN_SCENARIO_LOG": str(log_path)}
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.gpu.scenarios", func,
                                 str(spec_path), str(out_path)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        ENGINES.add(proc.pid)
        try:
            code = proc.wait(timeout=SCENARIO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = "timeout"
        finally:
            ENGINES.discard(proc.pid)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if code != 0 or not result:
        tail = log_path.read_text(errors="replace").splitlines()[-60:]
        result = {"error": f"exit {code}", "log_tail": "\n".join(tail)}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result


@pytest.fixture(scope="session")
def gpu_results(request, tmp_path_factory) -> dict[str, dict]:
    needed = _needed(request.session.items)
    ENGINES.end_on(signal.SIGTERM, signal.SIGINT)
    work = tmp_path_factory.mktemp("gpu-scenarios")
    started = time.monotonic()
    models = _build_models({SCENARIOS[n][1] for n in needed}
                           | {SCENARIOS[n][2]["drafter"] for n in needed
                              if "drafter" in SCENARIOS[n][2]}, work / "models")
    model_s = time.monotonic() - started
    shared = [n for n in needed if not SCENARIOS[n][2].get("exclusive")]
    alone = [n for n in needed if SCENARIOS[n][2].get("exclusive")]
    results: dict[str, dict] = {}
    out = os.environ.get("KILN_GPU_RESULTS")

    def save() -> None:
        """After every scenario, so a run cut short keeps what finished."""
        if not out:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        summary = {"model_build_s": round(model_s, 1),
                   "total_s": round(time.monotonic() - started, 1), "scenarios": results}
        Path(out, "gpu-results.json").write_text(json.dumps(summary, indent=1))
        with tarfile.open(Path(out, "scenario-logs.tar.gz"), "w:gz") as tar:
            for name in results:
                tar.add(work / name / "log", arcname=f"{name}.log")

    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {pool.submit(_run, n, models, work): n for n in shared}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
            save()
    for name in alone:
        results[name] = _run(name, models, work)
        save()
    return results


@pytest.fixture
def scenario(request, gpu_results):
    """The result of one scenario the test named; a failed run fails the test."""
    def get(name: str) -> dict:
        result = gpu_results[name]
        if "error" in result:
            pytest.fail(f"scenario {name} failed ({result['error']}):\n{result['log_tail']}")
        return result
    return get
