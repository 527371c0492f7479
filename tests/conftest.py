"""Shared fixtures: the fork wheel under test (built by tests/run) and pristine upstream."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def fork_wheel() -> Path:
    """The wheel tests/run built from this checkout (KILN_TEST_WHEEL)."""
    path = os.environ.get("KILN_TEST_WHEEL")
    if not path:
        pytest.fail("KILN_TEST_WHEEL is not set: run the tiers through tests/run")
    return Path(path)


@pytest.fixture(scope="session")
def upstream_version(fork_wheel) -> str:
    """The upstream pin the wheel under test was built on (0.33.0 from 0.33.0+kiln.N)."""
    from packaging.version import Version

    return Version(fork_wheel.name.split("-")[1]).base_version


@pytest.fixture(scope="session")
def pristine_files(upstream_version):
    from kiln.upstream.fetch import fetch

    return fetch(upstream_version, log=lambda _: None)


@pytest.fixture(scope="session")
def pristine_tree(pristine_files):
    from kiln.upstream.pristine import PristineTree

    return PristineTree.from_files(pristine_files)


@pytest.fixture(scope="session")
def fork_zip(fork_wheel):
    with zipfile.ZipFile(fork_wheel) as zf:
        yield zf


@pytest.fixture(scope="session")
def upstream_zip(pristine_files):
    with zipfile.ZipFile(pristine_files.wheel) as zf:
        yield zf
