import os
import sys

# The tests that drive vLLM's attention builders play Model Runner V2 with Triton's
# interpreter. On a host with no GPU, vLLM 0.34.0 finds no active Triton driver and would
# take its standalone CPU runner, which refuses speculative decoding; an empty
# CUDA_VISIBLE_DEVICES (set before vLLM loads) keeps its Triton check on the lenient path.
if os.environ.get("TRITON_INTERPRET") == "1":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# kvarn is a top-level package at the repository root (vllm/kvarn inside the wheel).
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for path in (ROOT, os.path.dirname(__file__)):
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_configure(config):
    # Triton's interpreter converts 1-element arrays to scalars (numpy deprecation).
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
