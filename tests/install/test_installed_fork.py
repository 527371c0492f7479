"""The fork wheel installed with pip into the test venv (VLLM_TARGET_DEVICE=cpu)."""

import importlib.metadata
import logging
import subprocess
import sys
from pathlib import Path

from kiln.series.series import Series, series_dir

VLLM = str(Path(sys.executable).with_name("vllm"))


def test_the_installed_vllm_is_the_fork_wheel_under_test(fork_wheel):
    assert importlib.metadata.version("vllm") == fork_wheel.name.split("-")[1]


def test_vllm_version_names_the_fork_and_its_topics(fork_wheel, upstream_version):
    result = subprocess.run([VLLM, "--version"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    version = fork_wheel.name.split("-")[1]
    topics = len(Series.load(series_dir(upstream_version)).topics)
    assert result.stdout.strip() == (
        f"{version} (kiln fork of vLLM {upstream_version}, {topics} topics)")


def test_vllm_serve_help_all_runs():
    result = subprocess.run([VLLM, "serve", "--help=all"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--kv-cache-dtype" in result.stdout and "--api-key" in result.stdout


def test_the_server_start_up_line_names_the_fork(caplog, upstream_version):
    try:  # 0.33.0 moved it
        from vllm.entrypoints.common.startup import log_version_and_model
    except ImportError:
        from vllm.entrypoints.serve.utils.api_utils import log_version_and_model
    from vllm.version import __version__

    logger = logging.getLogger("kiln.test.startup")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_version_and_model(logger, __version__, "tiny")
    (record,) = caplog.records
    message = record.getMessage()
    topics = len(Series.load(series_dir(upstream_version)).topics)
    assert f"{__version__} (kiln fork of vLLM {upstream_version}, {topics} topics)" in message
    assert "tiny" in message
