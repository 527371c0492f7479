from pathlib import Path

import pytest

from kiln.build.wheel import check_topic_paths, record_hash
from kiln.errors import KilnError
from kiln.series.series import Topic
from tests.unit.conftest import write_patch


def _topic(tmp_path: Path, name: str, path: str) -> Topic:
    diff = f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-a\n+b\n"
    return Topic.parse(write_patch(tmp_path / "patches", 1, name, diff))


def test_a_topic_touching_upstream_csrc_is_refused_by_name(tmp_path):
    with pytest.raises(KilnError) as err:
        check_topic_paths([_topic(tmp_path, "fast-gemm", "csrc/gemm.cu")])
    assert "topic fast-gemm touches upstream csrc/gemm.cu" in str(err.value)
    assert "compiled" in str(err.value)


def test_a_topic_outside_the_package_is_refused(tmp_path):
    with pytest.raises(KilnError, match="topic docs touches README.md, outside the vllm/ package"):
        check_topic_paths([_topic(tmp_path, "docs", "README.md")])


def test_a_topic_inside_the_package_passes(tmp_path):
    check_topic_paths([_topic(tmp_path, "ok", "vllm/outputs.py")])


def test_record_hash_is_urlsafe_base64_sha256_without_padding():
    # sha256("") in the RECORD encoding (PEP 376 / the wheel spec).
    assert record_hash(b"") == "sha256=47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
