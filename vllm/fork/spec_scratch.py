"""The spec-decode scratch pool: one split-softmax scratch per geometry, shared by
every Triton attention metadata builder, allocated inside the memory-profiling run.

Upstream's TritonAttentionMetadataBuilder allocates its own 3D-path scratch when it is
built, which is after the memory profile has sized the KV pool, sized for one query
token per request (64 segments on SM120). Here the attention layers' profiling forward
(``attn_metadata is None``) reserves one pool per (H_q, D_pad, segments, dtype, device)
sized in query tokens, verify tokens included (``scratch_sizing``), so the profile
charges it before the KV pool is sized; each builder then takes views of its geometry's
pool. 16 segments everywhere; batches whose grid would have wanted more (upstream's
SM120 rule) are counted, and so are batches the pool's rows could not hold (they take
the non-split path).

The counts are attributes of each pool (``ScratchPool.segment_shortfall_requests``,
``row_overflow_requests``); a worker logs them at exit and at DEBUG each time one first
passes a power of two. They are not Prometheus metrics: the pools live in the worker
processes, and vLLM's metrics come from the engine's scheduler stats.
"""
from __future__ import annotations

import atexit
from dataclasses import dataclass

import torch
from vllm.config import SpeculativeConfig, VllmConfig, get_current_vllm_config
from vllm.logger import init_logger

from vllm.fork import scratch_sizing as sizing

logger = init_logger(__name__)

# Upstream's MIN_LAUNCH_GRID_SIZE_2D (backends/triton_attn.py), read from there when a
# builder attaches; the profiling reservation runs before any builder exists.
# mirrors: vllm.v1.attention.backends.triton_attn.MIN_LAUNCH_GRID_SIZE_2D
MIN_LAUNCH_GRID_SIZE_2D = 128


@dataclass(frozen=True)
class Geometry:
    num_heads_q: int
    head_size_padded: int
    segments: int
    dtype: torch.dtype
    device: str


class ScratchPool:
    """The three scratch tensors of one geometry, and its counters."""

    def __init__(self, geometry: Geometry, rows: int, reserved: bool) -> None:
        g = geometry
        dev = torch.device(g.device)
        self.geometry = geometry
        self.rows = rows
        self.reserved_in_profile = reserved
        self.output = torch.empty((rows, g.num_heads_q, g.segments, g.head_size_padded),
                                  dtype=g.dtype, device=dev)
        self.max = torch.empty((rows, g.num_heads_q, g.segments), dtype=g.dtype, device=dev)
        self.expsum = torch.empty((rows, g.num_heads_q, g.segments), dtype=g.dtype,
                                  device=dev)
        self.segment_shortfall_requests = 0
        self.row_overflow_requests = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.output, self.max, self.expsum))

    def count(self, shortfall: int, overflow: int) -> None:
        for name, n in (("segment_shortfall_requests", shortfall),
                        ("row_overflow_requests", overflow)):
            if n:
                before = getattr(self, name)
                setattr(self, name, before + n)
                if (before + n).bit_length() > before.bit_length():
                    logger.debug("spec-decode scratch pool %s: %s = %d", self.geometry, name,
                                 before + n)


_POOLS: dict[Geometry, ScratchPool] = {}


def pools() -> list[ScratchPool]:
    return list(_POOLS.values())


@atexit.register
def _log_counters() -> None:
    for pool in _POOLS.values():
        if pool.segment_shortfall_requests or pool.row_overflow_requests:
            logger.info("spec-decode scratch pool %d rows x %d heads: %d requests would have "
                        "needed more than %d segments; %d took the non-split path (rows "
                        "full)", pool.rows, pool.geometry.num_heads_q,
                        pool.segment_shortfall_requests, pool.geometry.segments,
                        pool.row_overflow_requests)


@dataclass(frozen=True)
class Plan:
    threshold: int
    query_len: int
    rows: int


def drafts_in_parallel(spec: SpeculativeConfig) -> bool:
    """Whether the drafter runs all its draft positions in one pass (DFlash, DSpark).
    0.34.0 moved the flag to the speculator's config; its SpeculativeConfig field of the
    same name is deprecated there and reads None."""
    if hasattr(spec, "speculator_config"):  # 0.34.0 on
        return bool(spec.speculator_config.parallel_drafting)
    return bool(spec.parallel_drafting)  # 0.33.0


def plan(vllm_config: VllmConfig, num_kv_heads: int, kv_cache_dtype: str,
         min_grid: int = MIN_LAUNCH_GRID_SIZE_2D) -> Plan:
    """The pool's rows for a layer group with ``num_kv_heads`` KV heads."""
    from vllm.config import CUDAGraphMode

    from vllm.fork import spec_attn

    compilation = vllm_config.compilation_config
    full_graphs = compilation.cudagraph_mode in (
        CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL)
    threshold = sizing.seq_threshold_3d(
        num_kv_heads, min_grid, compilation.cudagraph_capture_sizes if full_graphs else None)
    spec = vllm_config.speculative_config
    k = (spec.num_speculative_tokens or 0) if spec is not None else 0
    query_len = sizing.split_query_len(
        k, spec is not None and drafts_in_parallel(spec),
        upstream_max=spec_attn.upstream_split_query_len(kv_cache_dtype),
        fork_max=spec_attn.MAX_QUERY_LEN if spec_attn.enabled(kv_cache_dtype) else 0)
    rows = sizing.pool_rows(threshold, vllm_config.scheduler_config.max_num_seqs, query_len)
    return Plan(threshold, query_len, rows)


def _pool(geometry: Geometry, rows: int, reserving: bool) -> ScratchPool:
    pool = _POOLS.get(geometry)
    if pool is not None and pool.rows >= rows:
        return pool
    if not reserving:
        logger.warning(
            "spec-decode scratch pool for %s: %d rows needed, %d reserved in the memory "
            "profile; allocating %.1f MiB outside it", geometry, rows,
            pool.rows if pool else 0,
            sizing.pool_bytes(rows, geometry.num_heads_q, geometry.head_size_padded,
                              geometry.segments) / 2**20)
    pool = ScratchPool(geometry, rows, reserved=reserving)
    _POOLS[geometry] = pool
    return pool


def reserve(impl, device: torch.device) -> None:
    """The profiling forward of a Triton attention layer: allocate its geometry's pool,
    so the memory profile charges it."""
    geometry = Geometry(impl.num_heads, sizing.next_power_of_2(impl.head_size),
                        sizing.SEGMENTS, torch.float32, str(device))
    if geometry in _POOLS:
        return
    p = plan(get_current_vllm_config(), impl.num_kv_heads, impl.kv_cache_dtype)
    pool = _pool(geometry, p.rows, reserving=True)
    logger.info_once("spec-decode scratch pool: %d query-token rows x %d heads x %d segments "
                     "(%.1f MiB), reserved in the memory profile", pool.rows,
                     geometry.num_heads_q, geometry.segments, pool.nbytes / 2**20)


@dataclass
class Attachment:
    pool: ScratchPool
    plan: Plan
    num_kv_heads: int
    num_compute_units: int


# mirrors: vllm.v1.attention.backends.triton_attn.TritonAttentionMetadataBuilder.__init__ (the scratch it allocates)
def attach(builder, vllm_config: VllmConfig, kv_cache_spec, device: torch.device) -> None:
    """Give a TritonAttentionMetadataBuilder views of its geometry's pool in place of
    the scratch it just allocated (16 segments; the SM120 64-segment path off)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.kv_cache_interface import KVQuantMode

    cache_dtype = ("auto" if kv_cache_spec.kv_quant_mode == KVQuantMode.NONE
                   else vllm_config.cache_config.cache_dtype)
    p = plan(vllm_config, builder.num_heads_kv, cache_dtype,
             min_grid=triton_attn.MIN_LAUNCH_GRID_SIZE_2D)
    if p.threshold != builder.seq_threshold_3D:
        # Upstream's rule moved away from scratch_sizing.seq_threshold_3d: the builder's
        # threshold decides which batches split, so size for it.
        logger.warning("spec-decode scratch pool: planned for %d requests per split batch, "
                       "the builder splits up to %d", p.threshold, builder.seq_threshold_3D)
        rows = sizing.pool_rows(builder.seq_threshold_3D,
                                vllm_config.scheduler_config.max_num_seqs, p.query_len)
        p = Plan(builder.seq_threshold_3D, p.query_len, rows)
    geometry = Geometry(builder.num_heads_q, sizing.next_power_of_2(builder.headdim),
                        sizing.SEGMENTS, torch.float32, str(torch.device(device)))
    pool = _pool(geometry, p.rows, reserving=False)
    try:
        units = current_platform.num_compute_units()
    except NotImplementedError:
        units = 0
    builder.num_par_softmax_segments = geometry.segments
    builder.max_seqs_64_segments = 0
    builder.softmax_segm_output = pool.output[: p.rows]
    builder.softmax_segm_max = pool.max[: p.rows]
    builder.softmax_segm_expsum = pool.expsum[: p.rows]
    builder.kiln_scratch = Attachment(pool, p, builder.num_heads_kv, units)


def _serving() -> bool:
    """After warm-up and CUDA-graph capture: both runners lock the workspace then."""
    from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

    return is_workspace_manager_initialized() and current_workspace_manager().is_locked()


def observe(builder, attn_metadata, common_attn_metadata) -> None:
    """Per build: a batch the rows cannot hold takes the non-split path (its threshold
    set to 0). Once serving, count those requests, and the requests of split batches
    that wanted more segments."""
    a: Attachment = builder.kiln_scratch
    cam = common_attn_metadata
    num_reqs = cam.num_reqs
    if not sizing.is_split_batch(num_reqs, cam.max_query_len, a.plan.threshold,
                                 a.plan.query_len):
        return
    overflow = cam.num_actual_tokens > a.plan.rows
    if overflow:
        attn_metadata.seq_threshold_3D = 0
    if _serving():
        shortfall = 0 if overflow else sizing.segment_shortfall(
            num_reqs, a.num_kv_heads, a.num_compute_units, a.pool.geometry.segments)
        a.pool.count(shortfall, num_reqs if overflow else 0)
