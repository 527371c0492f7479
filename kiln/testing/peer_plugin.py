"""pytest plugin for the peer suite: writes each test's outcome by node id as JSON.

Copied beside upstream's tests and loaded with ``-p kiln_peer_plugin``; it
imports nothing from kiln, since it runs inside the test virtualenv.
"""

import json
import os

import pytest

_outcomes: dict[str, str] = {}


def pytest_collection_modifyitems(items):
    # Upstream's autouse cleanup tears down the distributed state and runs a full
    # gc after every test: on 2 cores that tripled the suite's time. Its own
    # marker skips it; the baseline is recorded the same way, so they compare.
    for item in items:
        item.add_marker(pytest.mark.skip_global_cleanup)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        previous = _outcomes.get(report.nodeid)
        if previous in (None, "passed"):
            _outcomes[report.nodeid] = report.outcome


def pytest_sessionfinish(session):
    with open(os.environ["KILN_PEER_RESULTS"], "w") as f:
        json.dump(_outcomes, f, indent=0, sort_keys=True)
