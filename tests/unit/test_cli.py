import subprocess
import sys
from pathlib import Path

import pytest

import kiln.upstream.fetch
from kiln.cli import build_parser, main
from kiln.paths import REPO_ROOT
from kiln.upstream.lock import UpstreamLock, version_key

COMMANDS = ["apply", "build", "build-xgrammar", "export", "fetch", "gpu-bundle", "materialize",
            "peer-suite", "pin-bump", "port-check", "rebase", "test-env", "tiny-model", "topics",
            "verify"]


def test_every_command_is_registered_with_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in COMMANDS:
        assert name in sub.choices
        assert sub.choices[name].format_help().strip()


def test_python_dash_m_kiln_runs_with_the_standard_library_alone():
    # -S leaves site-packages out: kiln's import must not need them.
    result = subprocess.run([sys.executable, "-S", "-m", "kiln", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in COMMANDS:
        assert name in result.stdout


def test_errors_are_one_clean_line_with_status_2(tmp_path: Path, capsys):
    code = main(["test-env", "--wheel", str(tmp_path / "missing.whl")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln test-env: error: ") and "missing.whl: no such wheel" in err
    assert "Traceback" not in err


def test_test_env_refuses_a_missing_xgrammar_wheel_before_making_a_venv(tmp_path: Path, capsys):
    wheel = tmp_path / f"vllm-{UpstreamLock.load().default}+kiln.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not read: the missing xgrammar wheel is refused first")
    code = main(["test-env", "--wheel", str(wheel), "--xgrammar", str(tmp_path / "xg.whl")])
    assert code == 2
    assert "xg.whl: no such wheel" in capsys.readouterr().err


def test_a_kiln_cache_that_is_a_file_is_one_error_line(tmp_path: Path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.write_text("not a folder\n")
    monkeypatch.setenv("KILN_CACHE", str(cache))
    assert main(["fetch"]) == 2
    err = capsys.readouterr().err
    assert err == (f"kiln fetch: error: the cache {cache} (KILN_CACHE, default ~/.cache/kiln) "
                   "is not a folder; point KILN_CACHE at a folder\n")
    assert cache.read_text() == "not a folder\n"


# Every command taking an upstream version, with what else it requires.
VERSION_ARGVS = [
    ["apply", "--into", "{tmp}/applied"], ["build", "--out", "{tmp}/dist", "--no-xgrammar"],
    ["export", "--from", "{tmp}/repo"], ["fa2-check"], ["fa2-snapshot"], ["fetch"],
    ["materialize", "--into", "{tmp}/repo"], ["topics"], ["verify"],
    ["port-check", "--to"], ["rebase", "--repo", "{tmp}/repo", "--onto"],
    ["peer-suite", "--python", "{tmp}/python"], ["test-env", "--wheel", "{tmp}/vllm.whl"],
    # A pinned version first: every named pin is checked before anything is fetched.
    ["verify", "--version", UpstreamLock.load().default],
]


def test_every_command_with_a_version_option_is_in_the_refusal_test():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    declared = {name for name, parser in sub.choices.items()
                if any("--version" in action.option_strings for action in parser._actions)}
    assert declared == {argv[0] for argv in VERSION_ARGVS if argv[-1] not in ("--to", "--onto")}


@pytest.mark.parametrize("argv", VERSION_ARGVS)
def test_a_version_the_lock_does_not_pin_is_refused_naming_the_pins(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    # Nothing may be fetched: a closed local port makes any download fail at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setattr(kiln.upstream.fetch, "BACKOFF_SECONDS", 0.0)
    argv = [a.format(tmp=tmp_path) for a in argv]
    argv += ["9.9.9"] if argv[-1] in ("--to", "--onto") else ["--version", "9.9.9"]
    assert main(argv) == 2
    pinned = ", ".join(sorted(UpstreamLock.load().releases, key=version_key))
    assert capsys.readouterr().err == (
        f"kiln {argv[0]}: error: upstream version 9.9.9 has no pinned hashes in upstream.lock "
        f"(pinned: {pinned}); pin it with `python -m kiln pin-bump --to 9.9.9`\n")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] in ([], ["cache"])


def test_tiny_model_drafter_flags_are_refused_where_they_do_not_apply(tmp_path: Path, capsys):
    assert main(["tiny-model", "--block-size", "8"]) == 2
    assert "--block-size: only apply with --dflash2-drafter" in capsys.readouterr().err
    assert main(["tiny-model", "--dflash2-drafter"]) == 2
    assert "needs --target DIR" in capsys.readouterr().err
    assert main(["tiny-model", "--dflash2-drafter", "--target", str(tmp_path), "--hidden",
                 "64", "--copy"]) == 2
    assert "drop --hidden, --copy" in capsys.readouterr().err
    assert main(["tiny-model", "--dflash2-drafter", "--target", str(tmp_path)]) == 2
    assert "no config.json there" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 96, "num_attention_heads": 2, "num_hidden_layers": 2, '
        '"vocab_size": 512}')
    assert main(["tiny-model", "--dflash2-drafter", "--target", str(tmp_path),
                 "--conv-group-size", "64", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "--conv-group-size 64: must divide the hidden size 96" in err and "32, 48" in err
    assert not (tmp_path / "d").exists()
