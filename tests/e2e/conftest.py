"""One real `vllm serve` of the tiny model for the whole end-to-end tier.

Starting the server is most of the tier's cost on a 2-core CI machine, so every
test module shares one: it runs with the flags the topics under test need
(--api-key, prefix caching, the stall sentinel knob and its test trigger,
structured output on xgrammar).
Environment knobs: E2E_SERVER_START_TIMEOUT (seconds, default 900) and
E2E_MODEL_DIR (serve this folder instead of building the tiny model).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent
REPO_ROOT = E2E_DIR.parents[1]
# kiln (the tiny model) lives in the repository, not in the test venv; the
# helper module sits beside this file.
for _path in (REPO_ROOT, E2E_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from e2e_config import API_KEY, MAX_MODEL_LEN, PREFILL_CHUNK, SERVED_NAME, STALL_WARN_S  # noqa: E402
from vllm_server import VllmServer, running  # noqa: E402

_SERVERS: list[VllmServer] = []


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    override = os.environ.get("E2E_MODEL_DIR")
    if override:
        return Path(override)
    from kiln.testing import tinymodel

    return tinymodel.build()


@pytest.fixture(scope="session")
def stall_trigger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Writing N into this file makes the server's next engine step sleep N s."""
    return tmp_path_factory.mktemp("stall") / "stall-once"


@pytest.fixture(scope="session")
def server(
    tiny_model: Path,
    stall_trigger: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[VllmServer]:
    srv = VllmServer(
        model=str(tiny_model),
        args=[
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "8",
            "--enable-prefix-caching",
            # Chunked prefill in small steps, so a long prompt reports progress.
            "--max-num-batched-tokens", str(PREFILL_CHUNK),
            # No torch.compile: start-up on 2 cores is what this tier pays for.
            "--enforce-eager",
            # Structured output on xgrammar (the fork's build) with no free whitespace,
            # so a random-weight model finishes a JSON document.
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        ],
        log_path=tmp_path_factory.mktemp("server") / "vllm-serve.log",
        env={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENGINE_STALL_WARN_S": str(STALL_WARN_S),
            "VLLM_ENGINE_STALL_TEST_TRIGGER": str(stall_trigger),
        },
        api_key=API_KEY,
        served_name=SERVED_NAME,
    )
    _SERVERS.append(srv)
    with running(srv):
        yield srv


@pytest.fixture
def http(server: VllmServer):
    """A raw HTTP client that sends the key, for routes the openai client lacks."""
    import httpx

    with httpx.Client(
        base_url=server.url,
        headers={"Authorization": f"Bearer {server.api_key}"},
        timeout=120,
    ) as c:
        yield c


@pytest.fixture(scope="session")
def client(server: VllmServer):
    import openai

    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _SERVERS:
        report.sections.append(("vllm serve log", _SERVERS[-1].log_tail()))


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    for srv in _SERVERS:
        if srv.startup_seconds is not None:
            terminalreporter.write_line(
                f"e2e: vllm serve healthy after {srv.startup_seconds:.1f}s "
                f"(log: {srv.log_path})"
            )
