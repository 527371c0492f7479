"""The CUDA C++ decode / verify kernel (kvarn.decode_cuda, csrc/kvarn/kvarn_decode.cu) against
the torch reference (dequantize-then-attend in fp32 over the same cache) and the Triton
kernel (kvarn.decode.attend_rotated). GPU tests are skipped, with the reason, without a
CUDA device or a library (built here into a temporary directory when nvcc is on PATH);
the compile check of every arch runs wherever nvcc is."""
import os
import shutil

import pytest
import torch
from kvarn_cases import capture_graph, check_close, make_state

from kvarn import Preset, decode_cuda
from kvarn import reference as ref

NVCC = shutil.which("nvcc")
ON_CUDA = (torch.cuda.is_available() and torch.version.hip is None
           and not os.environ.get("TRITON_INTERPRET"))
DEV = "cuda"
HEADS = 8
CONTEXTS = [1, 127, 128, 129, 4096, 32768]


@pytest.fixture(scope="session")
def cuda_lib(tmp_path_factory):
    if not ON_CUDA:
        pytest.skip("no CUDA device (the CUDA kernel needs one)")
    if not decode_cuda.library_path().exists():
        if not NVCC:
            pytest.skip(f"{decode_cuda.library_path()} is not built and nvcc is not on PATH")
        major, minor = torch.cuda.get_device_capability()
        out = decode_cuda.build_library(tmp_path_factory.mktemp("kvarn_cuda"),
                                        archs=(f"{major}{minor}",))
        return decode_cuda.load_library(out)
    return decode_cuda.load_library()


def case(name, head_dim, gqa, query_len, contexts, seed, heads=HEADS, hold_back=True):
    p = Preset.parse(name)
    contexts = [max(c, query_len) for c in contexts]
    st = make_state(p, head_dim, heads, contexts, query_len, seed=seed, hold_back=hold_back,
                    device=DEV)
    gen = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(len(contexts), query_len, heads * gqa, head_dim, generator=gen).to(DEV)
    return st, q, (st.kv, st.block_table, st.side_table, st.seq_lens, st.num_flushed)


def test_fragment_layouts_are_what_the_kernel_assumes(cuda_lib):
    # first, so that a failing run says whether the PTX layouts or the kernel are off
    assert decode_cuda.selftest() == []


@pytest.mark.parametrize("name", Preset.names())
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("gqa", [1, 4, 8], ids=lambda g: f"gqa{g}")
def test_decode_matches_reference(cuda_lib, name, head_dim, gqa):
    # shuffled tables, a batch of different lengths around the block edges, split-K off,
    # on (3) and at the default count; 32K where it costs the least test time
    contexts = CONTEXTS if head_dim == 128 or gqa == 4 else CONTEXTS[:-1]
    st, q, args = case(name, head_dim, gqa, 1, contexts, seed=head_dim + gqa)
    assert int(st.num_flushed.max()) >= 2
    want = ref.paged_attention(q, *args)
    for splits in (1, 3, None):
        check_close(decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits), want)


@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v4_g64"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("query_len,gqa", [(2, 1), (2, 4), (2, 8), (4, 1), (4, 4), (1, 16)])
def test_verify_rows_match_reference(cuda_lib, name, head_dim, query_len, gqa):
    # Q * GQA up to 16 rows: one n8 tile of rows, or two (and split output channels at 256)
    st, q, args = case(name, head_dim, gqa, query_len, CONTEXTS, seed=7 * query_len + gqa)
    want = ref.paged_attention(q, *args)
    for splits in (1, 4):
        check_close(decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits), want)


@pytest.mark.parametrize("name,head_dim", [(n, 128) for n in Preset.names()]
                         + [("kvarn_k4v2_g128", 64), ("kvarn_k4v2_g128", 256)])
def test_agrees_with_triton(cuda_lib, name, head_dim):
    from kvarn.decode import attend_rotated
    st, q, args = case(name, head_dim, 4, 2, CONTEXTS, seed=41)
    for splits in (1, 3):
        a = decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits)
        b = attend_rotated(q, *args, num_splits=splits, variant="prefetch")
        assert (a - b).abs().max() <= 2e-3, float((a - b).abs().max())


def test_verify_row_equals_decode_at_that_length(cuda_lib):
    L, Q = CONTEXTS[-1], 3
    st, q, _ = case("kvarn_k4v2_g128", 128, 4, Q, [L], seed=3, hold_back=False)
    args = (st.kv, st.block_table, st.side_table)
    full = decode_cuda.attend_rotated_cuda(q, *args, st.seq_lens, st.num_flushed, num_splits=2)
    for i in range(Q):
        one = decode_cuda.attend_rotated_cuda(q[:, i:i + 1], *args, st.seq_lens - (Q - 1 - i),
                                              st.num_flushed, num_splits=2)
        assert torch.allclose(full[:, i], one[:, 0], atol=1e-3)


@pytest.mark.parametrize("splits", [200, decode_cuda.MAX_SPLITS])
def test_combine_of_many_and_of_empty_parts(cuda_lib, splits):
    # more parts than the combine has threads; past a request's records a part sees
    # nothing (lse -inf) and must not weigh in; the 129-token request has no records
    st, q, args = case("kvarn_k4v4_g64", 128, 4, 1, [32768, 1000, 129], seed=17)
    check_close(decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits),
                ref.paged_attention(q, *args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_queries_equal_their_fp32_values(cuda_lib, dtype):
    st, q, args = case("kvarn_k4v2_g128", 128, 4, 1, [4096, 129], seed=5)
    qh = q.to(dtype)
    a = decode_cuda.attend_rotated_cuda(qh, *args, num_splits=2)
    b = decode_cuda.attend_rotated_cuda(qh.float(), *args, num_splits=2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("splits", [4, None])
def test_cuda_graph_capture_and_replay(cuda_lib, splits):
    st, q, args = case("kvarn_k4v2_g128", 128, 4, 4, [4096, 1000, 129], seed=9)
    eager = decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits)
    graph, out = capture_graph(lambda: decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    st.seq_lens.sub_(1)  # new lengths, same graph: nothing about them baked in
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_cuda.attend_rotated_cuda(q, *args, num_splits=splits))
    check_close(out, ref.paged_attention(q, *args))


def test_bad_arguments_name_what_is_allowed(cuda_lib):
    st, q, args = case("kvarn_k4v2_g128", 128, 4, 1, [300], seed=1)
    kv, bt, side, seq, nf = args
    with pytest.raises(ValueError, match="1..16 rows"):
        decode_cuda.attend_rotated_cuda(q.repeat(1, 5, 1, 1), *args)
    with pytest.raises(ValueError, match="block_table must be int32"):
        decode_cuda.attend_rotated_cuda(q, kv, bt.long(), side, seq, nf)
    with pytest.raises(ValueError, match="seq_lens must be a contiguous int32"):
        decode_cuda.attend_rotated_cuda(q, kv, bt, side, seq.long(), nf)
    with pytest.raises(ValueError, match="allowed: float32, float16, bfloat16"):
        decode_cuda.attend_rotated_cuda(q.double(), *args)
    with pytest.raises(ValueError, match="num_splits 0"):
        decode_cuda.attend_rotated_cuda(q, *args, num_splits=0)
    with pytest.raises(ValueError, match=f"allowed: 1..{decode_cuda.MAX_SPLITS}"):
        decode_cuda.attend_rotated_cuda(q, *args, num_splits=decode_cuda.MAX_SPLITS + 1)


def test_supports_names_the_shapes_it_has():
    assert decode_cuda.supports("kvarn_k4v2_g128", 128, 4)
    assert decode_cuda.supports(Preset.parse("kvarn_k4v4_g64"), 256, 16)
    assert not decode_cuda.supports("kvarn_k4v2_g128", 512, 4)  # Triton serves D=512
    assert not decode_cuda.supports("kvarn_k4v2_g128", 128, 17)


def test_unavailable_reason_names_the_missing_library(monkeypatch, tmp_path):
    monkeypatch.setattr(decode_cuda, "_lib", None)  # restored afterwards
    monkeypatch.setenv(decode_cuda.ENV_LIB, str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="is not built"):
        decode_cuda.load_library()
    assert decode_cuda.unavailable_reason() is not None


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_build_library_compiles_every_arch(tmp_path):
    lib = decode_cuda.build_library(tmp_path, archs=decode_cuda.ARCHS, ptxas_verbose=True,
                                    threads=1)
    assert lib.exists() and lib.stat().st_size > 0
    log = (tmp_path / "build.log").read_text()
    for arch in decode_cuda.ARCHS:
        assert f"for 'sm_{arch}'" in log  # ptxas compiled the kernels for it
