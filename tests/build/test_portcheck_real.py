"""port-check on the real 0.31.0 -> 0.32.0 pair: the two breaks the 0.32 port met.

Fetches the 0.31.0 and 0.32.0 sdists (sha256-checked; both pins are this test's own,
since the lock pins only what the fork builds from).
"""

from __future__ import annotations


import pytest

pytest.importorskip("griffe")

from kiln.upstream.lock import PinnedFile, UpstreamLock, UpstreamRelease  # noqa: E402
from kiln.upstream.pristine import PristineTree  # noqa: E402
from kiln.portcheck import port_check  # noqa: E402
from kiln.series.series import Series  # noqa: E402
from tests.unit.conftest import make_diff, write_patch  # noqa: E402

V031 = UpstreamRelease(
    "0.31.0",
    PinnedFile("vllm-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl",
               "39132b433967f0962d03d8a5f633b9bee6b32708f566c7d5637b79f8d0ef3433"),
    PinnedFile("vllm-0.31.0.tar.gz", "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380"),
)
V032 = UpstreamRelease(
    "0.32.0",
    PinnedFile("vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
               "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611"),
    PinnedFile("vllm-0.32.0.tar.gz", "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"),
)
OUTPUT_PROCESSOR = "vllm/v1/engine/output_processor.py"
OVERLAY = '''\
from vllm.v1.engine.output_processor import RequestState
from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator


def deliver_progress(state: RequestState, count: int):
    # 0.31-style: the count passed positionally after the two transfer params.
    return state.make_request_output([], None, None, None, None, None, count)


class LookupSpeculator(BaseSpeculator):
    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync=None, dummy_run=False,
                skip_attn_for_dummy_run=False, mm_inputs=None, is_profile=False):
        return None
'''


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    lock = UpstreamLock.load()
    lock = UpstreamLock(default="0.31.0", releases={**lock.releases, "0.31.0": V031, "0.32.0": V032})
    old, new = PristineTree.pinned("0.31.0", lock).root, PristineTree.pinned("0.32.0", lock).root
    tmp = tmp_path_factory.mktemp("real")
    text = (old / OUTPUT_PROCESSOR).read_text()
    signature = "        ec_transfer_params: dict[str, Any] | None = None,\n    ) -> RequestOutput | PoolingRequestOutput | None:"
    assert text.count(signature) == 1
    cut = text.replace(signature, signature.replace(
        "= None,\n", "= None,\n        num_computed_tokens: int | None = None,\n"))
    cut = cut.replace("from vllm.v1.engine import", "from vllm.fork.progress import deliver_progress  # noqa\nfrom vllm.v1.engine import", 1)
    write_patch(tmp / "patches", 1, "prompt-progress", make_diff(old, OUTPUT_PROCESSOR, cut))
    overlay = tmp / "overlay" / "vllm"
    (overlay / "fork").mkdir(parents=True)
    (overlay / "fork" / "progress.py").write_text(OVERLAY)
    return port_check(old, "0.31.0", new, "0.32.0", Series.load(tmp / "patches"), [(overlay, "vllm")])


def by_where(findings, where):
    return [f for f in findings if f.where == where]


def test_a_positional_count_would_bind_to_the_new_error_parameter(findings):
    (finding,) = by_where(findings, "vllm/fork/progress.py::vllm.v1.engine.output_processor.RequestState.make_request_output")
    assert finding.kind == "changed-signature" and finding.topic == "prompt-progress"
    assert "argument #7 binds to `num_computed_tokens` in 0.31.0 but to `error` in 0.32.0" in finding.detail


def test_a_031_style_override_misses_the_dp_sync_state_rename(findings):
    (finding,) = by_where(findings, "vllm/fork/progress.py::LookupSpeculator.propose")
    assert finding.kind == "override"
    assert "is `dp_sync` where the base has `dp_sync_state`" in finding.detail


def test_every_finding_is_well_formed(findings):
    assert findings and all(f.kind and f.topic and f.where and f.detail for f in findings)
