"""What `python -m kiln` imports is installed by the README's first line
(requirements/kiln.txt), so no command fails with ModuleNotFoundError after it."""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Modules that run in another interpreter, which installs these itself.
ELSEWHERE = {
    "kiln/testing/peer_plugin.py": {"pytest"},  # loaded by the test venv's pytest
    "kiln/testing/tinymodel/copymodel.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/dense.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/drafter.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/hybrid.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/hybridcopy.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/model.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/tensors.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/tinymodel/tokenizer.py": {"torch", "transformers", "tokenizers"},  # the test venv
    "kiln/testing/gpurun.py": {"torch", "triton"},  # the GPU machine's torch
    "kiln/testing/trained/build.py": {"torch", "transformers", "tokenizers"},  # the test venv, the GPU
    "kiln/testing/trained/data.py": {"torch", "transformers", "tokenizers"},  # the test venv, the GPU
    "kiln/testing/trained/train.py": {"torch", "transformers", "tokenizers"},  # the test venv, the GPU
    "kiln/testing/trained/tokenizer.py": {"torch", "transformers", "tokenizers"},  # the test venv, the GPU
    # Installed into the GPU bundle's site: the GPU machine's torch.
    "kiln/testing/standins/flashinfer/norm.py": {"torch"},
}
DISTRIBUTION = {"setuptools_scm": "setuptools-scm"}


def _third_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        found.update(n.split(".")[0] for n in names if n)
    return {m for m in found if m not in sys.stdlib_module_names and m != "kiln"}


def test_every_module_kiln_imports_is_in_requirements_kiln_txt():
    pinned = {re.split(r"[=<>~!]", line)[0].strip().lower()
              for line in (ROOT / "requirements/kiln.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    missing = {}
    for path in sorted((ROOT / "kiln").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for module in _third_party_imports(path) - ELSEWHERE.get(rel, set()):
            if DISTRIBUTION.get(module, module).lower() not in pinned:
                missing.setdefault(module, []).append(rel)
    assert not missing, f"imported by kiln but not in requirements/kiln.txt: {missing}"
