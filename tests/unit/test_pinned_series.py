"""The setup apply, materialize, port-check and rebase share (kiln/series/pinned.py): the
pin's series is read before anything is fetched, and only the sdist is fetched.

Each test runs the real CLI on a checkout whose lock pins a small synthetic upstream and
whose package index is a closed port, so whatever the cache lacks cannot be fetched."""

from __future__ import annotations

from pathlib import Path

from tests.unit.conftest import SDIST_NAME, WHEEL_NAME


def test_apply_and_materialize_read_the_pinned_sdist_alone(checkout, tmp_path: Path):
    (checkout.cache / "upstream" / WHEEL_NAME).unlink()
    applied = checkout.run("apply", "--into", str(tmp_path / "applied"))
    assert applied.returncode == 0, applied.stderr
    assert (tmp_path / "applied" / "vllm" / "__init__.py").read_text() == "X = 1\n"
    materialized = checkout.run("materialize", "--into", str(tmp_path / "repo"))
    assert materialized.returncode == 0, materialized.stderr
    assert "branch fork/1.0.0 ready in" in materialized.stdout
    assert not (checkout.cache / "upstream" / WHEEL_NAME).exists()


def test_a_series_that_does_not_load_is_refused_before_anything_is_fetched(checkout, tmp_path: Path):
    for name in (WHEEL_NAME, SDIST_NAME):
        (checkout.cache / "upstream" / name).unlink()
    patches = checkout.root / "patches" / "1.0.0"
    (patches / "series").write_text("0001-gone.patch\n")
    for command in ("apply", "materialize"):
        result = checkout.run(command, "--into", str(tmp_path / command))
        assert result.returncode == 2
        assert result.stderr == (f"kiln {command}: error: the series and the patch files disagree:\n"
                                 f"  series lists 0001-gone.patch, but {patches / '0001-gone.patch'} "
                                 "does not exist\n")
    assert list((checkout.cache / "upstream").iterdir()) == []
