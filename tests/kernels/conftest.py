import os
import sys

# kvarn is a top-level package at the repository root (vllm/kvarn inside the wheel).
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
for path in (ROOT, os.path.dirname(__file__)):
    if path not in sys.path:
        sys.path.insert(0, path)


def pytest_configure(config):
    # Triton's interpreter converts 1-element arrays to scalars (numpy deprecation).
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
