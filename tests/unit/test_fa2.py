"""kiln.abi.opschema and kiln.abi.fa2: the pinned attention op schemas and the calls that bind to them.

Every test runs on the real pinned wheel and sdist (fetched into the cache as CI does),
or on a copy of one real upstream wrapper broken on purpose.
"""

from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path

import pytest

from kiln.abi import fa2, opschema
from kiln.cli import main
from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.upstream.fetch import fetch
from kiln.upstream.lock import UpstreamLock
from kiln.upstream.pristine import PristineTree

VERSION = UpstreamLock.load().default
WRAPPER = "vllm/vllm_flash_attn/flash_attn_interface.py"


@pytest.fixture(scope="module")
def files():
    return fetch(VERSION)


@pytest.fixture(scope="module")
def snapshot():
    return fa2.Snapshot.load(VERSION)


@pytest.fixture(scope="module")
def pristine(files) -> Path:
    return PristineTree.from_files(files).root


def test_the_committed_snapshot_parses_and_round_trips(snapshot):
    assert set(snapshot.namespaces) == {"_vllm_fa2_C", "_vllm_fa3_C", "_C", "_C_cache_ops"}
    for ns in snapshot.namespaces.values():
        assert ns.schemas, f"{ns.name} has no schemas"
        for schema in ns.schemas.values():
            assert opschema.parse(str(schema)) == schema
    varlen = snapshot.namespaces["_vllm_fa2_C"].schemas["varlen_fwd"]
    assert varlen.arguments[0] == opschema.Argument("q", "Tensor!")
    gen = varlen.argument("gen")
    assert gen.optional and gen.required  # Tensor? without a default: still passed
    scale = snapshot.namespaces["_C"].schemas["merge_attn_states"].argument("output_scale")
    assert scale.optional and not scale.required and scale.default == "None"


def test_the_parser_reads_keyword_only_arguments_overloads_and_list_defaults():
    schema = opschema.parse("scaled.out(Tensor  input, int[] dims=[1, 2], *, "
                            "Tensor(a!) output, str? mode=\"a,b\") -> ()")
    assert (schema.name, schema.overload, schema.qualified) == ("scaled", "out", "scaled.out")
    assert [a.name for a in schema.positional] == ["input", "dims"]
    assert schema.argument("dims").default == "[1, 2]"
    assert schema.argument("output").keyword_only and schema.argument("output").required
    assert schema.argument("mode").default == '"a,b"'
    assert str(schema) == ("scaled.out(Tensor input, int[] dims=[1, 2], *, Tensor(a!) output, "
                           "str? mode=\"a,b\") -> ()")


@pytest.mark.parametrize("text", ["varlen_fwd(Tensor q)", "f(Tensor) -> ()",
                                  "f(Tensor q, Tensor q) -> ()", "f(Tensor q=) -> ()"])
def test_the_parser_refuses_a_malformed_schema_naming_its_source(text):
    with pytest.raises(KilnError, match="where.so"):
        opschema.parse(text, "where.so")


def test_extraction_from_the_real_wheel_matches_the_committed_snapshot(files):
    snapshot = fa2.extract(files)
    assert snapshot.render() == fa2.snapshot_path(VERSION).read_text(), (
        "fa2/schemas is stale: run `python -m kiln fa2-snapshot`")


def test_a_real_binary_without_schemas_fails_naming_the_file(files):
    member = "vllm/spinloop.abi3.so"
    with zipfile.ZipFile(files.wheel) as wheel:
        data = wheel.read(member)
    with pytest.raises(KilnError, match=r"spinloop\.abi3\.so: no op schema string"):
        fa2.schemas_in(data, member)
    with pytest.raises(KilnError, match=r"notes\.txt: not an ELF file"):
        fa2.schemas_in(b"varlen_fwd(Tensor q) -> ()\0", "notes.txt")


def test_the_pin_names_the_sdists_flash_attention_commit(files):
    pin = fa2.flash_attention_pin(files)
    assert pin.version == VERSION and len(pin.commit) == 40
    line = next(ln for ln in fa2.PIN_PATH.read_text().splitlines() if ln.startswith(f"{VERSION} "))
    assert line == str(pin)


def test_upstreams_wrappers_and_the_fork_bind(pristine, snapshot):
    report = fa2.check_calls([(pristine, fa2.UPSTREAM_SCAN), (REPO_ROOT, fa2.FORK_SCAN)],
                             snapshot)
    assert report.ok, report.errors
    called = {(c.namespace, c.op) for c in report.checked}
    assert {("_vllm_fa2_C", "varlen_fwd"), ("_vllm_fa3_C", "fwd"),
            ("_vllm_fa3_C", "get_scheduler_metadata")} <= called


def _broken_copy(pristine: Path, tmp_path: Path, op: str, edit) -> tuple[Path, int]:
    """A tree holding only upstream's wrapper, with ``edit`` applied to the call of ``op``."""
    text = (pristine / WRAPPER).read_text()
    call = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr == op)
    lines = text.splitlines(keepends=True)
    offset = lambda line, col: sum(len(ln) for ln in lines[:line - 1]) + col  # noqa: E731
    text = edit(text, call, offset)
    target = tmp_path / "tree" / WRAPPER
    target.parent.mkdir(parents=True)
    target.write_text(text)
    return tmp_path / "tree", call.lineno


def _after_last(text, call, offset, extra):
    last = max([*call.args, *call.keywords], key=lambda n: (n.end_lineno, n.end_col_offset))
    end = offset(last.end_lineno, last.end_col_offset)
    return text[:end] + extra + text[end:]


def _drop_last(text, call, offset):
    prev, last = call.args[-2], call.args[-1]
    return (text[:offset(prev.end_lineno, prev.end_col_offset)]
            + text[offset(last.end_lineno, last.end_col_offset):])


@pytest.mark.parametrize("op, edit, expected", [
    ("varlen_fwd", lambda t, c, o: _after_last(t, c, o, ", softmax_scael=1.0"),
     "keyword 'softmax_scael' is not an argument; allowed: q, k, v"),
    ("varlen_fwd", _drop_last, "missing required argument(s) gen"),
    ("fwd", lambda t, c, o: _after_last(t, c, o, ", None"),
     "38 positional arguments, the schema takes at most 37"),
])
def test_a_broken_call_in_a_copied_wrapper_fails_naming_file_line_and_op(
        pristine, snapshot, tmp_path, capsys, op, edit, expected):
    tree, line = _broken_copy(pristine, tmp_path, op, edit)
    report = fa2.check_calls([(tree, fa2.UPSTREAM_SCAN)], snapshot)
    assert len(report.errors) == 1
    assert report.errors[0].startswith(f"{WRAPPER}:{line}: torch.ops.")
    assert f".{op}: " in report.errors[0] and expected in report.errors[0]
    assert main(["fa2-check", "--tree", str(tree)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {WRAPPER}:{line}:" in out and "1 mismatch(es)" in out


def test_aliases_unknown_ops_and_literal_none_are_checked(snapshot, tmp_path):
    source = tmp_path / "kvarn" / "calls.py"
    source.parent.mkdir()
    source.write_text(
        "import torch\n"
        "ops = torch.ops._vllm_fa2_C\n"
        "varlen = torch.ops._vllm_fa3_C.fwd\n"
        "ops.varlen_fwd(q=1)\n"
        "torch.ops._vllm_fa2_C.no_such_op(1)\n"
        "torch.ops._C.rms_norm(1, 2, 3, 4)\n"  # not an attention op: outside the check
        "torch.ops._C_cache_ops.concat_and_cache_mla(None, 1, 2, 3, 'auto', 4)\n"
        "varlen(*args)\n"
    )
    report = fa2.check_calls([(tmp_path, fa2.FORK_SCAN)], snapshot)
    assert len(report.checked) == 3
    errors = "\n".join(report.errors)
    assert "kvarn/calls.py:4: torch.ops._vllm_fa2_C.varlen_fwd: missing required" in errors
    assert "kvarn/calls.py:5: torch.ops._vllm_fa2_C.no_such_op: op not in the" in errors
    assert "kvarn/calls.py:7: torch.ops._C_cache_ops.concat_and_cache_mla: passes None to kv_c" in errors
    assert "kvarn/calls.py:8: torch.ops._vllm_fa3_C.fwd: passes *args or **kwargs" in errors
    assert len(report.errors) == 4


def test_a_tree_without_the_scanned_paths_is_refused(snapshot, tmp_path):
    # The upstream scan is the whole vllm/ package, so that is where it looked.
    with pytest.raises(KilnError, match=f"no Python files to check; looked in {re.escape(str(tmp_path / 'vllm'))}$"):
        fa2.check_calls([(tmp_path, fa2.UPSTREAM_SCAN)], snapshot)


def test_an_unknown_version_has_no_snapshot(tmp_path):
    with pytest.raises(KilnError, match=r"9\.9\.9\.txt is missing; write it with"):
        fa2.Snapshot.load("9.9.9", tmp_path)


BROKEN_CALL = "import torch\n\ntorch.ops._C_cache_ops.reshape_and_cache(1, 2)\n"


def test_calls_anywhere_in_upstreams_package_are_checked_but_not_an_installed_fork(snapshot, tmp_path):
    # vllm/_cpu_ops.py: 0.34.0 moved calls there, outside every folder once listed.
    for path in ("vllm/_cpu_ops.py", "vllm/fork/ops.py", "vllm/kvarn/ops.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(BROKEN_CALL)
    report = fa2.check_calls([(tmp_path, fa2.UPSTREAM_SCAN)], snapshot)
    # The fork's installed packages are read from the checkout, not from the tree.
    assert [e.split(": ")[0] for e in report.errors] == ["vllm/_cpu_ops.py:3"]
    assert "missing required argument(s) key_cache" in report.errors[0]


@pytest.fixture
def checkout_without_series(tmp_path) -> tuple:
    """A copy of this checkout whose patches/0.34.0/ is absent, with a broken call
    added to its kvarn/."""
    import shutil

    copy = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("kiln", "fa2", "requirements", "vllm", "kvarn", "specattn", "patches"):
        shutil.copytree(REPO_ROOT / folder, copy / folder, ignore=ignore)
    shutil.rmtree(copy / "patches" / "0.34.0", ignore_errors=True)
    (copy / "kvarn" / "broken_ops.py").write_text(BROKEN_CALL)
    return copy


def _kiln(cwd: Path, *argv: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kiln", *argv], cwd=cwd, capture_output=True, text=True)


def test_a_pin_without_its_series_yet_is_checked_pristine_with_the_checkouts_fork(checkout_without_series):
    result = _kiln(checkout_without_series, "fa2-check", "--version", "0.34.0")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "no series in patches/0.34.0/ yet: checking pristine vLLM 0.34.0"
    assert [ln for ln in lines if ln.startswith("FAIL")] == [
        (f"FAIL kvarn/broken_ops.py:3: torch.ops._C_cache_ops.reshape_and_cache: missing required "
        f"argument(s) key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale (an "
        f"argument without a default must be passed, even when it may be None); schema: "
        f"{fa2.Snapshot.load('0.34.0').namespaces['_C_cache_ops'].schemas['reshape_and_cache']}")]


def test_a_tree_is_checked_with_the_checkouts_fork(checkout_without_series, tmp_path):
    tree = tmp_path / "tree"
    (tree / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    (tree / "vllm" / "vllm_flash_attn" / "ops.py").write_text("import torch\n")
    result = _kiln(checkout_without_series, "fa2-check", "--version", "0.34.0", "--tree", str(tree))
    assert result.returncode == 1, result.stderr
    assert "FAIL kvarn/broken_ops.py:3: torch.ops._C_cache_ops.reshape_and_cache:" in result.stdout
