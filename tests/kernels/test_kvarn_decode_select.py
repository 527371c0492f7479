"""Which kernel kvarn.decode.attend_rotated runs: "auto" (the default) and "cuda" take the
CUDA C++ kernel where its library is available and has the shape, else the Triton
"prefetch" kernel, saying why once per selector (kvarn.decode_select). On a machine
without CUDA the fallback itself is checked against the reference; the GPU half (the
CUDA kernel chosen, a library that cannot launch here falling back) is skipped without
CUDA or a library."""
import logging
import os
import shutil

import pytest
import torch
from kvarn_cases import DEVICE, capture_graph, make_state

from kvarn import Preset, decode_cuda, decode_select
from kvarn import reference as ref
from kvarn.decode import CHOICES, attend_rotated, default_variant

ON_CUDA = (torch.cuda.is_available() and torch.version.hip is None
           and not os.environ.get("TRITON_INTERPRET"))
LOGGER = "kvarn.decode_select"


@pytest.fixture
def fresh():
    """A selector that has learnt nothing yet, as a new server's builder holds."""
    return decode_select.DecodeSelector()


def case(name="kvarn_k4v2_g64", head_dim=64, heads=2, gqa=2, query_len=1,
         contexts=(1, 64, 65, 200), seed=3, device=DEVICE):
    contexts = [max(c, query_len) for c in contexts]
    st = make_state(Preset.parse(name), head_dim, heads, contexts, query_len,
                    seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(contexts), query_len, heads * gqa, head_dim, generator=gen).to(device)
    return q, (st.kv, st.block_table, st.side_table, st.seq_lens, st.num_flushed)


def test_the_default_is_auto_and_a_bad_variant_lists_the_allowed_ones(monkeypatch):
    monkeypatch.delenv("KVARN_DECODE_VARIANT", raising=False)
    assert default_variant() == "auto"
    monkeypatch.setenv("KVARN_DECODE_VARIANT", "cuda")
    assert default_variant() == "cuda"
    monkeypatch.setenv("KVARN_DECODE_VARIANT", "triton")
    with pytest.raises(ValueError, match="'triton': allowed: auto, cuda, prefetch$"):
        default_variant()
    monkeypatch.setenv("KVARN_DECODE_VARIANT", "pipelined")  # retired: auto never chose it
    with pytest.raises(ValueError, match="'pipelined': allowed: auto, cuda, prefetch$"):
        default_variant()
    assert CHOICES == ("auto", "cuda", "prefetch")


def test_an_unknown_variant_argument_lists_the_allowed_ones():
    q, args = case()
    with pytest.raises(ValueError, match="'fast'; allowed: auto, cuda, prefetch$"):
        attend_rotated(q, *args, variant="fast")


@pytest.mark.parametrize("variant", ["auto", "cuda"])
def test_triton_launch_parameters_are_refused_naming_them(variant):
    q, args = case()
    with pytest.raises(TypeError, match=rf"'{variant}' takes no num_warps, tile_tokens: launch "
                                        r"parameters tune the Triton kernel \(prefetch\)"):
        attend_rotated(q, *args, variant=variant, num_warps=4, tile_tokens=64)
    # None means "the default", as for the Triton kernel
    attend_rotated(q, *args, variant=variant, num_warps=None)


def test_shapes_without_a_cuda_instance_say_which_and_what_there_is():
    p = Preset.parse("kvarn_k4v2_g128")
    selector = decode_select.DecodeSelector()
    assert "head_dim 512" in selector.fallback_reason(p, 512, 4)
    reason = selector.fallback_reason(p, 128, 17)
    assert "17 query rows per KV head" in reason and "1..16 rows" in reason
    assert "on cpu" in selector.fallback_reason(p, 128, 4, torch.device("cpu"))
    assert "debug=True" in selector.fallback_reason(p, 128, 4, debug=True)


def missing_library_reason(tmp_path, monkeypatch) -> str:
    """What decode_cuda says where the wheel was built without nvcc (no library in it)."""
    for name in ("_lib", "_lib_error"):  # a library this process loaded stays loaded
        monkeypatch.setattr(decode_cuda, name, getattr(decode_cuda, name))
    with pytest.raises(RuntimeError) as missing:
        decode_cuda.load_library(tmp_path / "libkvarn_decode.so")
    return str(missing.value)


def test_auto_serves_with_the_prefetch_kernel_where_the_cuda_kernel_cannot(tmp_path,
                                                                           monkeypatch):
    # What each supported GPU's server learns about the CUDA kernel, and the kernel "auto"
    # then gives a call: wherever the CUDA kernel cannot serve, the Triton "prefetch" does.
    machines = {
        "sm_80/86/89/90, wheel built with nvcc": None,
        # the library has sm_80-90 code only, so its first launch fails (the GPU test
        # below runs that launch with a library of another major arch)
        "sm_120 (consumer Blackwell)": ("the CUDA kernel's first launch failed: "
                                        "kvarn_decode_launch failed: no kernel image is "
                                        "available for execution on the device"),
        "wheel built without nvcc": missing_library_reason(tmp_path, monkeypatch),
    }
    g128 = Preset.parse("kvarn_k4v2_g128")
    calls = {  # (head dim, query rows per KV head) -> the kernel where CUDA's is usable
        (128, 4): "cuda",  # GQA 4 decode
        (256, 16): "cuda",  # GQA 4, verify of 3 speculative tokens
        (512, 4): "prefetch",  # no CUDA instance at head dim 512
        (128, 20): "prefetch",  # GQA 5 verify of 4 speculative tokens: 20 rows
    }
    for machine, reason in machines.items():
        selector = decode_select.DecodeSelector(probe=lambda reason=reason: reason)
        for (head_dim, rows), usable in calls.items():
            want = usable if reason is None else "prefetch"
            got = selector.choose("auto", g128, head_dim, rows, torch.device("cuda"))
            assert got == want, (machine, head_dim, rows)
    assert "does not exist" in machines["wheel built without nvcc"]


@pytest.mark.skipif(ON_CUDA, reason="checks the machine without CUDA")
def test_auto_without_cuda_resolves_to_prefetch_and_says_why_once(fresh, caplog):
    p = Preset.parse("kvarn_k4v2_g128")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            assert fresh.choose("auto", p, 128, 4, torch.device("cuda")) == "prefetch"
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO
    assert "'auto' uses the Triton 'prefetch' kernel: " in record.message
    assert fresh.unavailable_reason() in record.message
    assert "CUDA" in fresh.unavailable_reason()
    assert fresh.describe("auto", p, 128, 4).startswith("Triton 'prefetch', since ")


@pytest.mark.skipif(ON_CUDA, reason="checks the machine without CUDA")
def test_cuda_variant_falls_back_to_the_triton_kernel_with_the_references_output(fresh, caplog):
    q, args = case(query_len=2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = attend_rotated(q, *args, num_splits=2, variant="cuda", selector=fresh)
        again = attend_rotated(q, *args, num_splits=2, variant="cuda", selector=fresh)
    want = ref.paged_attention(q, *args)
    assert (out - want).abs().max() <= 5e-3, float((out - want).abs().max())
    assert torch.equal(out, attend_rotated(q, *args, num_splits=2, variant="prefetch"))
    assert torch.equal(out, again)
    [record] = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING  # asked for by name: a fallback is worth a warning
    assert "'cuda' uses the Triton 'prefetch' kernel" in record.message


@pytest.fixture
def cuda_library(fresh):
    if not ON_CUDA:
        pytest.skip("no CUDA device (the CUDA kernel needs one)")
    if fresh.unavailable_reason():
        pytest.skip(fresh.unavailable_reason())
    return fresh


def test_auto_on_cuda_runs_the_cuda_kernel(cuda_library):
    q, args = case("kvarn_k4v2_g128", 128, 8, 4, 2, (1, 129, 4096, 1000), seed=5)
    out = attend_rotated(q, *args, num_splits=3)
    assert torch.equal(out, decode_cuda.attend_rotated_cuda(q, *args, num_splits=3))
    assert cuda_library.describe("auto", args[0].preset, 128, 8).startswith("CUDA C++ (")
    # D=512 has no CUDA instance: the Triton kernel serves it, as before
    q5, args5 = case("kvarn_k4v2_g128", 512, 2, 2, 1, (300,), seed=6)
    assert torch.equal(attend_rotated(q5, *args5, num_splits=2),
                       attend_rotated(q5, *args5, num_splits=2, variant="prefetch"))


def test_auto_is_chosen_from_shapes_inside_graph_capture(cuda_library):
    q, args = case("kvarn_k4v2_g128", 128, 8, 4, 4, (4096, 1000, 129), seed=9)
    eager = attend_rotated(q, *args, num_splits=4)
    graph, out = capture_graph(lambda: attend_rotated(q, *args, num_splits=4))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_a_library_that_cannot_launch_here_falls_back_to_triton(cuda_library, monkeypatch,
                                                                tmp_path, caplog):
    # machine code for another major arch only: it loads, and its first launch fails
    major, _ = torch.cuda.get_device_capability()
    other = next((a for a in decode_cuda.ARCHS if int(a) // 10 != major), None)
    if other is None or shutil.which("nvcc") is None:
        pytest.skip("needs nvcc and an arch of another major version than this GPU's")
    lib = decode_cuda.build_library(tmp_path, archs=(other,))
    monkeypatch.setattr(decode_cuda, "_lib", None)  # restored afterwards
    monkeypatch.setenv(decode_cuda.ENV_LIB, str(lib))
    selector = decode_select.DecodeSelector()  # a server started on that library
    q, args = case("kvarn_k4v2_g128", 128, 8, 4, 1, (4096, 129), seed=11)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = attend_rotated(q, *args, num_splits=2, selector=selector)
        attend_rotated(q, *args, num_splits=2, selector=selector)
    assert torch.equal(out, attend_rotated(q, *args, num_splits=2, variant="prefetch"))
    assert "first launch failed" in selector.unavailable_reason()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "kvarn_decode_launch failed" in warnings[0].message
