"""Upstream's TRITON_ATTN backend inside the installed fork, with the topics
spec-decode-scratch-pool and spec-decode-attn: its real metadata builder and
TritonAttentionImpl.forward, driven as the runner drives them (a profiling forward,
then builds and forwards of speculative verify batches), on CPU with the kernels in
Triton's interpreter.

Checked: the split-softmax scratch is one pool per geometry, reserved by the profiling
forward and shared by every builder, sized in query tokens with the verify tokens; a
verify batch goes through the fork's kernel (split into the pool's 16 segments) and
its output is exact attention over the cache; batches the kernel does not take stay
on upstream's path; a batch the rows cannot hold is routed to the non-split path and
counted. Caches are written into upstream's own views (tests/kernels/
test_specattn_upstream.py checks them against upstream's writers).
"""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

# vllm.envs first: from the checkout's root, its overlay-only vllm/ imports without upstream.
pytest.importorskip("vllm.envs", reason="needs the installed fork wheel")
pytest.importorskip("vllm.fork.spec_attn", reason="needs the installed fork wheel")

from specattn_cases import DEVICE, relative_errors  # noqa: E402

from specattn import Mode, PagedCache  # noqa: E402
from specattn import reference as ref  # noqa: E402

H_Q, H_KV, D, PAGE = 8, 2, 64, 16
K_SPEC = 4  # drafted tokens: verify batches of 5 query tokens per request
MAX_SEQS = 8
NUM_BLOCKS = 24


def _config(model_dir, kv_cache_dtype: str, spec: bool = True):
    from vllm.engine.arg_utils import EngineArgs

    spec_config = ({"method": "ngram", "num_speculative_tokens": K_SPEC,
                    "prompt_lookup_max": 3, "prompt_lookup_min": 1} if spec else None)
    return EngineArgs(model=model_dir, skip_tokenizer_init=True, max_model_len=512,
                      max_num_seqs=MAX_SEQS, max_num_batched_tokens=256,
                      block_size=PAGE, kv_cache_dtype=kv_cache_dtype,
                      speculative_config=spec_config).create_engine_config()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import Qwen3Config

    path = tmp_path_factory.mktemp("qwen3-specattn")
    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                max_position_embeddings=1024, torch_dtype="bfloat16",
                architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


@pytest.fixture
def fresh(monkeypatch):
    """The knob on, and no pools or knob decisions left from another test."""
    import vllm.specattn

    from vllm.fork import spec_attn, spec_scratch

    monkeypatch.setenv("VLLM_TRITON_SPEC_VERIFY_ATTN", "1")
    monkeypatch.setattr(spec_attn, "_enabled", {})
    monkeypatch.setattr(spec_scratch, "_POOLS", {})
    # Prewarm off (every geometry counts as warmed): only its own test watches it.
    monkeypatch.setattr(spec_attn, "_prewarmed", Everything())
    assert spec_attn.MAX_QUERY_LEN == vllm.specattn.MAX_QUERY_LEN
    calls = []
    real = vllm.specattn.verify_attention

    def spy(*args, **kwargs):
        calls.append({**kwargs, "num_seqs": args[3].shape[0], "max_query_len": args[5]})
        return real(*args, **kwargs)

    monkeypatch.setattr(vllm.specattn, "verify_attention", spy)
    return calls


class Everything(set):
    def __contains__(self, item) -> bool:
        return True


class Layer:
    """What TritonAttentionImpl.forward reads from its attention layer."""

    def __init__(self) -> None:
        self._k_scale = torch.tensor([0.02])
        self._v_scale = torch.tensor([0.03])
        self._q_scale = torch.tensor([1.0])


class Served:
    """One TRITON_ATTN layer under a config: impl, profiling forward, builder, cache."""

    def __init__(self, config, kv_cache_dtype: str, head_size: int = D,
                 sliding_window: int | None = None) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
        from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

        self.config, self.dtype, self.d = config, kv_cache_dtype, head_size
        self.layer = Layer()
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(set_current_vllm_config(config))
        self.impl = TritonAttentionImpl(H_Q, head_size, head_size ** -0.5, H_KV, None,
                                        sliding_window, kv_cache_dtype)
        storage = STR_DTYPE_TO_TORCH_DTYPE.get(kv_cache_dtype, torch.bfloat16)
        pth = kv_cache_dtype.endswith("per_token_head")
        half = (head_size // 2 if kv_cache_dtype.startswith("int4") else head_size) + (
            4 // storage.itemsize if pth else 0)
        self.kv_cache = torch.zeros(NUM_BLOCKS, PAGE, H_KV, 2 * half, dtype=storage,
                                    device=DEVICE).transpose(1, 2)
        # The profiling run: attention metadata None.
        q = torch.zeros(4, H_Q, head_size, dtype=torch.bfloat16, device=DEVICE)
        kv = torch.zeros(4, H_KV, head_size, dtype=torch.bfloat16, device=DEVICE)
        self.impl.forward(self.layer, q, kv, kv, self.kv_cache, None, torch.empty_like(q))
        self.spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=H_KV, head_size=head_size,
                                      dtype=torch.bfloat16,
                                      kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))

    def builder(self):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

        return TritonAttentionMetadataBuilder(self.spec, ["model.layers.0.self_attn.attn"],
                                              self.config, torch.device(DEVICE))

    def cache(self) -> PagedCache:
        """Random rows written in the cache's format into upstream's own views."""
        from specattn import CACHE_DTYPES

        mode = CACHE_DTYPES[self.dtype]
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(2, NUM_BLOCKS, PAGE, H_KV, self.d, generator=gen)
        if self.impl._is_per_token_head_quant:
            key, value = self.impl._pth_key_value_caches(self.kv_cache)
            scales = (self.impl._k_scale_cache, self.impl._v_scale_cache)
        else:
            key, value = self.kv_cache.transpose(1, 2).split(self.d, dim=-1)
            if mode == Mode.FP8:
                key, value = key.view(torch.float8_e4m3fn), value.view(torch.float8_e4m3fn)
            scales = (self.layer._k_scale, self.layer._v_scale)
        entry = {"fp8_per_token_head": torch.float8_e4m3fn, "int8_per_token_head": torch.int8,
                 "auto": torch.bfloat16}.get(self.dtype)
        for view, scale, rows in ((key, scales[0], x[0]), (value, scales[1], x[1])):
            if mode == Mode.FP8:
                view.copy_((rows / scale).to(torch.float8_e4m3fn))
                continue
            codes, s = ref.quantize(mode, rows, entry)
            view[..., : codes.shape[-1]].copy_(codes)
            if s is not None:
                scale.copy_(s)
        if mode == Mode.PLAIN:
            return PagedCache(mode, key, value)
        return PagedCache(mode, key, value, *scales)

    def close(self) -> None:
        self._ctx.close()


def _batch(contexts: list[int], qlens: list[int]):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(contexts, dtype=torch.int32)
    pages = [-(-c // PAGE) for c in contexts]
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(4))
    table = torch.zeros(len(contexts), max(pages), dtype=torch.int32)
    first = 0
    for b, n in enumerate(pages):
        table[b, :n] = perm[first:first + n]
        first += n
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE),
        num_reqs=len(contexts), num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens),
        max_seq_len=int(seq.max()), block_table_tensor=table.to(DEVICE),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEVICE),
        seq_lens_cpu_upper_bound=seq)


def _forward(served: Served, md, cam, seed: int = 5):
    t = cam.num_actual_tokens
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H_Q, served.d, generator=gen).to(torch.bfloat16).to(DEVICE)
    kv = torch.zeros(t, H_KV, served.d, dtype=torch.bfloat16, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    served.impl.forward(served.layer, q, kv, kv, served.kv_cache, md, out)
    return q, out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8_per_token_head",
                                            "int4_per_token_head"])
def test_verify_batches_take_the_fork_kernel(model_dir, fresh, kv_cache_dtype):
    served = Served(_config(model_dir, kv_cache_dtype), kv_cache_dtype)
    try:
        cache = served.cache()
        builder = served.builder()
        cam = _batch([5, 16, 17, 40], [5, 5, 3, 5])
        md = builder.build(0, cam)
        q, out = _forward(served, md, cam)
        assert len(fresh) == 1 and fresh[0]["num_splits"] == 16
        want = ref.verify_attention(q, cache, cam.block_table_tensor, cam.seq_lens,
                                    cam.query_start_loc, D ** -0.5)
        errs = relative_errors(out, want, cam.query_start_loc)
        assert len(errs) == 4 and max(errs) < 1.2e-2, errs
    finally:
        served.close()


def test_batches_the_kernel_does_not_take_stay_on_upstreams_path(model_dir, fresh,
                                                                 monkeypatch):
    from vllm.fork import spec_attn

    served = Served(_config(model_dir, "auto"), "auto")
    try:
        builder = served.builder()
        q = torch.zeros(1, H_Q, D, dtype=torch.bfloat16)
        verify = builder.build(0, _batch([20, 30], [5, 2]))
        assert spec_attn.serves(served.impl, served.layer, verify, q, None)
        assert not spec_attn.serves(served.impl, served.layer, verify, q, torch.ones(1))
        for cam in (_batch([20, 30], [1, 1]), _batch([40], [17])):  # decode; prefill chunk
            assert not spec_attn.serves(served.impl, served.layer, builder.build(0, cam), q,
                                        None)
        windowed = Served(served.config, "auto", sliding_window=8)
        try:
            assert not spec_attn.serves(windowed.impl, windowed.layer, verify, q, None)
        finally:
            windowed.close()
        monkeypatch.setenv("VLLM_TRITON_SPEC_VERIFY_ATTN", "0")
        monkeypatch.setattr(spec_attn, "_enabled", {})
        assert not spec_attn.serves(served.impl, served.layer, verify, q, None)
        monkeypatch.delenv("VLLM_TRITON_SPEC_VERIFY_ATTN")
        monkeypatch.setattr(spec_attn, "_enabled", {})
        # Unset: only on a device MEASURED_FASTER lists for the dtype (this CPU: none).
        assert not spec_attn.serves(served.impl, served.layer, verify, q, None)
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability

        for cap, on in (((9, 0), True), ((8, 9), False)):
            monkeypatch.setattr(current_platform, "get_device_capability",
                                lambda device_id=0, cap=cap: DeviceCapability(*cap))
            monkeypatch.setattr(spec_attn, "_enabled", {})
            assert spec_attn.serves(served.impl, served.layer, verify, q, None) is on, cap
        assert "int8_per_token_head" not in spec_attn.MEASURED_FASTER[(9, 0)]
        assert fresh == []
    finally:
        served.close()


def test_prewarm_query_lens_cover_every_row_layout():
    """A verify batch of any length 2..16 launches a row layout (so a compile key) that
    the prewarm's lengths already launched, at every GQA and head size served."""
    from vllm.specattn.verify import row_blocks

    from vllm.fork import spec_attn

    for gqa in (1, 2, 3, 4, 6, 8, 16):
        for head in (64, 80, 128, 256):
            warmed = {row_blocks(q, gqa, head) for q in spec_attn.PREWARM_QUERY_LENS}
            for q in range(2, spec_attn.MAX_QUERY_LEN + 1):
                assert row_blocks(q, gqa, head) in warmed, (gqa, head, q)


def test_first_verify_batch_compiles_every_variant(model_dir, fresh, monkeypatch, caplog):
    from vllm.fork import spec_attn

    monkeypatch.setattr(spec_attn, "_prewarmed", set())
    served = Served(_config(model_dir, "auto"), "auto")
    try:
        cache = served.cache()
        builder = served.builder()
        cam = _batch([20, 30], [5, 2])
        with caplog.at_level(logging.INFO, logger="vllm.fork.spec_attn"):
            q, out = _forward(served, builder.build(0, cam), cam)
        *warm, real = fresh
        assert sorted((c["max_query_len"], c["num_splits"]) for c in warm) == sorted(
            (n, s) for n in spec_attn.PREWARM_QUERY_LENS for s in (1, 16))
        assert all(c["num_seqs"] == 1 for c in warm)
        assert (real["num_seqs"], real["max_query_len"]) == (2, 5)
        assert any("compiled the fork's kernel for query lengths" in r.getMessage()
                   for r in caplog.records)
        want = ref.verify_attention(q, cache, cam.block_table_tensor, cam.seq_lens,
                                    cam.query_start_loc, D ** -0.5)
        assert max(relative_errors(out, want, cam.query_start_loc)) < 1.2e-2
        # The next batch, of another length, launches itself alone.
        cam = _batch([40, 17, 33], [9, 3, 16])
        _forward(served, builder.build(0, cam), cam)
        assert len(fresh) == len(warm) + 2
    finally:
        served.close()


def _pool_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "vllm.fork.spec_scratch" and r.levelno >= logging.WARNING]


def test_one_pool_per_geometry_reserved_in_the_profile(model_dir, fresh, caplog, monkeypatch):
    from vllm.fork import spec_scratch

    served = Served(_config(model_dir, "auto"), "auto")
    try:
        (pool,) = spec_scratch.pools()  # the profiling forward allocated it
        assert pool.reserved_in_profile
        threshold = 128 // H_KV  # upstream's rule, no full CUDA graphs on CPU
        assert pool.rows == min(threshold, MAX_SEQS) * (1 + K_SPEC)
        assert pool.output.shape == (pool.rows, H_Q, 16, D)
        with caplog.at_level(logging.WARNING, logger="vllm.fork.spec_scratch"):
            a, b = served.builder(), served.builder()
        assert not _pool_warnings(caplog), "a builder allocated outside the profile"
        for builder in (a, b):
            assert builder.seq_threshold_3D == threshold
            assert builder.num_par_softmax_segments == 16
            for mine, pools in ((builder.softmax_segm_output, pool.output),
                                (builder.softmax_segm_max, pool.max),
                                (builder.softmax_segm_expsum, pool.expsum)):
                assert mine.data_ptr() == pools.data_ptr() and mine.shape[0] == pool.rows
        assert spec_scratch.pools() == [pool]
        # Another head size is another geometry, with a pool of its own.
        other = Served(served.config, "auto", head_size=128)
        other.close()
        assert len(spec_scratch.pools()) == 2
        # A builder whose layers never ran the profiling forward says what it costs.
        monkeypatch.setattr(spec_scratch, "_POOLS", {})
        with caplog.at_level(logging.WARNING, logger="vllm.fork.spec_scratch"):
            served.builder()
        (warning,) = _pool_warnings(caplog)
        assert "40 rows needed, 0 reserved in the memory profile" in warning
        assert not spec_scratch.pools()[0].reserved_in_profile
    finally:
        served.close()


def test_pool_rows_follow_the_knob_and_the_speculation(model_dir, fresh, monkeypatch):
    from vllm.fork import spec_attn, spec_scratch

    rows = {}
    for knob, spec in (("1", True), ("0", True), ("1", False)):
        monkeypatch.setenv("VLLM_TRITON_SPEC_VERIFY_ATTN", knob)
        monkeypatch.setattr(spec_attn, "_enabled", {})
        monkeypatch.setattr(spec_scratch, "_POOLS", {})
        served = Served(_config(model_dir, "int8_per_token_head", spec), "int8_per_token_head")
        try:
            rows[knob, spec] = spec_scratch.pools()[0].rows
        finally:
            served.close()
    # Upstream's own 3D path takes one query token on 0.32.0, up to MAX_3D_QUERY_LEN
    # from 0.33.0; the fork's kernel takes the whole verify.
    from vllm.v1.attention.ops import triton_unified_attention

    upstream = min(1 + K_SPEC, getattr(triton_unified_attention, "MAX_3D_QUERY_LEN", 1))
    assert rows == {("1", True): MAX_SEQS * (1 + K_SPEC), ("0", True): MAX_SEQS * upstream,
                    ("1", False): MAX_SEQS}


def test_full_graph_threshold_is_the_builders(model_dir, fresh, caplog):
    """With full CUDA graphs upstream snaps the threshold to a capture size; the pool's
    plan must agree, or the profile reserved the wrong rows."""
    from vllm.config import CUDAGraphMode

    from vllm.fork import spec_scratch

    config = _config(model_dir, "auto")
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 24, 40]
    served = Served(config, "auto")
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.fork.spec_scratch"):
            builder = served.builder()
        assert not _pool_warnings(caplog)
        assert builder.seq_threshold_3D == 40  # nearest capture size to 128 // 2
        assert builder.kiln_scratch.plan.threshold == 40
        assert spec_scratch.pools()[0].rows == min(40, MAX_SEQS) * (1 + K_SPEC)
    finally:
        served.close()


def test_rows_overflow_takes_the_non_split_path_and_counts(model_dir, fresh, monkeypatch):
    from vllm.v1.worker import workspace

    served = Served(_config(model_dir, "auto"), "auto")
    try:
        served.cache()
        builder = served.builder()
        monkeypatch.setattr(workspace, "_manager", None)
        workspace.init_workspace_manager(torch.device(DEVICE))
        workspace.lock_workspace()  # serving: counters count
        pool = builder.kiln_scratch.pool
        # 9 requests of 5 tokens: more rows than the pool's 8 x 5 (a padded batch).
        cam = _batch([5 + i for i in range(9)], [5] * 9)
        md = builder.build(0, cam)
        assert md.seq_threshold_3D == 0 and pool.row_overflow_requests == 9
        _forward(served, md, cam)
        assert fresh[-1]["num_splits"] == 1
        # A small batch on a device with more compute units than its grid fills.
        builder.kiln_scratch.num_compute_units = 1000
        builder.build(0, _batch([20, 30], [5, 5]))
        assert pool.segment_shortfall_requests == 2
        builder.kiln_scratch.num_compute_units = 2
        builder.build(0, _batch([20, 30], [5, 5]))
        assert pool.segment_shortfall_requests == 2
    finally:
        served.close()
        workspace.reset_workspace_manager()
