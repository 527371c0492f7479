"""The KVARN attention backend: vLLM's side of the KVarN cache (vllm.kvarn holds the
format, the host bookkeeping, the reference and the Triton kernels).

Per attention layer the paged pool is uint8 [blocks, KV heads, G, tile_bytes / G] in
layout LBHNC, so one (block, KV head) is one contiguous tile record; the fp16 side pool
(rotated rows not yet final: every request's sink block 0 and its tail) and the
prefill scratch come from the workspace manager during the profiling run, so the
memory profile charges them before the KV pool is sized.

Per real step the builder plans on the host (``kvarn.sidepool``, driven by the runner's
lifecycle through ``kvarn_lifecycle``) and uploads the plan into persistent device
tables in one copy; two small kernels finish it from the device's exact lengths. The
forward then restores evicted hit sinks, stages the new rows, attends (fused decode /
speculative verify over records + side rows; prefill packs over a dequantized fp16
scratch) and flushes every block that is full.
Nothing waits for the device, and a captured CUDA graph reads each step's tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.kvarn import HEAD_DIMS, PagedKV, Preset
from vllm.kvarn.decode_select import DecodeSelector
from vllm.kvarn.sidepool import SidePool, cdiv
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

from vllm.fork.kvarn_config import side_pool_plan
from vllm.fork.kvarn_dtypes import KVARN_CACHE_DTYPES, KVarNCacheDType, is_kvarn_dtype
from vllm.fork.kvarn_lifecycle import SidePoolLifecycle
from vllm.fork.plugin import KVARN_BACKEND, register

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

BACKEND_NAME = KVARN_BACKEND[0]
# Sm80+ (Ampere: the 3090/4090-class cards the fork serves on, and datacenter cards).
MIN_CAPABILITY = 80


def runs_model_runner_v2(vllm_config) -> bool:
    """0.34.0 removed Model Runner V1, and with it VllmConfig.use_v2_model_runner
    (0.33.0's property)."""
    if not hasattr(type(vllm_config), "use_v2_model_runner"):  # 0.34.0 on
        return True
    return vllm_config.use_v2_model_runner


def _run_preset() -> Preset | None:
    config = get_current_vllm_config_or_none()
    if config is None or not is_kvarn_dtype(config.cache_config.cache_dtype):
        return None
    return Preset.parse(config.cache_config.cache_dtype)


def _spec_preset(spec: AttentionSpec, layer_preset: Preset | None = None) -> Preset | None:
    """The preset of a KVarN layer's spec, None for any other spec. The registered
    presets share KVQuantMode.CUSTOM, so the run's preset says which, or outside any
    current config the preset of the layer's backend class."""
    mode = spec.kv_quant_mode
    # By value, against the mode the fork's handler registers (KVQuantMode.CUSTOM):
    # CUSTOM = 12 is an alias, so the member's name is OCTAVE_K3V4. 0.34.0 dropped the
    # is_custom_mode property 0.33.0 had, so the comparison is done here.
    if mode != KVarNCacheDType().quant_mode():
        return None
    if get_current_vllm_config_or_none() is None:
        return layer_preset
    return _run_preset()


class KVarNAttentionBackend(AttentionBackend):
    # The preset of the layers the class serves: None on this class, the one registered
    # as KVARN (it answers from the current config); select_kvarn_backend gives each
    # layer its preset's subclass, because Model Runner V2 asks about a layer's spec
    # outside any current config too.
    preset: ClassVar[Preset | None] = None
    accept_output_buffer: bool = True
    # forward stages the new rows itself: staging, flush and attention share metadata.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KVARN_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int | MultipleOf]:
        """[G]: a kernel block is one tile. Without a spec, G of the layers' preset."""
        preset = None if kv_cache_spec is None else _spec_preset(kv_cache_spec, cls.preset)
        if preset is not None:
            return [preset.group]
        preset = cls.preset or _run_preset()
        if preset is not None:
            return [preset.group]
        return sorted({Preset.parse(n).group for n in KVARN_CACHE_DTYPES})

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        preset = cls.preset or _run_preset()
        return preset.group if preset is not None else default_block_size

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state per token of tile_bytes / G bytes (exact for every preset), so a
        block of G tokens and one KV head is one tile record."""
        preset = _spec_preset(spec, cls.preset)
        if spec.state_content_bytes is not None or preset is None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"KVarN needs equal K and V head sizes, got "
                             f"{spec.head_size} and {spec.head_size_v}")
        return replace(spec, state_content_bytes=preset.bytes_per_token(spec.head_size))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(HEAD_DIMS)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return is_kvarn_dtype(kv_cache_dtype)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        # None: a CPU host, where only the config path and the interpreter run.
        return capability is None or capability.to_int() >= MIN_CAPABILITY

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[KVarNAttentionImpl]:
        return KVarNAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder


class KVarNK4V2G128Backend(KVarNAttentionBackend):
    preset = Preset.parse("kvarn_k4v2_g128")


class KVarNK4V4G128Backend(KVarNAttentionBackend):
    preset = Preset.parse("kvarn_k4v4_g128")


class KVarNK4V2G64Backend(KVarNAttentionBackend):
    preset = Preset.parse("kvarn_k4v2_g64")


class KVarNK4V4G64Backend(KVarNAttentionBackend):
    preset = Preset.parse("kvarn_k4v4_g64")


PRESET_BACKENDS: dict[str, type[KVarNAttentionBackend]] = {
    cls.preset.name: cls for cls in (KVarNK4V2G128Backend, KVarNK4V4G128Backend,
                                     KVarNK4V2G64Backend, KVarNK4V4G64Backend)}


def select_kvarn_backend(selected_backend: AttentionBackendEnum | None,
                         selector: AttentionSelectorConfig,
                         capability: DeviceCapability | None) -> str | None:
    """The platform hook: a kvarn cache dtype always means the KVARN backend (the
    subclass of its preset, PRESET_BACKENDS)."""
    if not is_kvarn_dtype(selector.kv_cache_dtype):
        return None
    if selected_backend is not None and selected_backend.name != BACKEND_NAME:
        raise ValueError(
            f"--attention-backend {selected_backend.name} cannot read "
            f"--kv-cache-dtype {selector.kv_cache_dtype}; allowed: {BACKEND_NAME} (or "
            "leave it unset)")
    reasons = KVarNAttentionBackend.validate_configuration(
        device_capability=capability, **selector._asdict())
    if reasons:
        raise ValueError(f"--kv-cache-dtype {selector.kv_cache_dtype}: the KVARN backend "
                         f"cannot serve this layer ({selector!r}): {', '.join(reasons)}")
    # Idempotent: a caller that builds layers without vLLM's plugin loading
    # (or with VLLM_PLUGINS excluding ours) still finds KVARN in the enum.
    register()
    logger.info_once("Using KVARN attention backend for %s.", selector.kv_cache_dtype)
    return f"{__name__}.{PRESET_BACKENDS[selector.kv_cache_dtype].__qualname__}"


@dataclass
class KVarNMetadata(AttentionMetadata):
    """Device tensors are views of the builder's persistent buffers or the runner's
    own; ints are fixed for a captured graph's shape."""

    seq_lens: torch.Tensor  # int32 [B], this step's query tokens included
    query_start_loc: torch.Tensor  # int32 [B + 1]
    block_table: torch.Tensor  # int32 [B, max blocks]
    side_table: torch.Tensor  # int32 [R, W]: sink, then the tail from F + 1
    num_flushed: torch.Tensor  # int32 [R]: F, logical blocks 1..F are records
    scratch_offset: torch.Tensor  # int32 [R]: a prefill row's first scratch block
    stage_slots: torch.Tensor  # int64 [T]: side slot of each new row, -1 = none
    restore_dst: torch.Tensor  # int32 [restore_grid]: side block to fill, -1 = none
    restore_row: torch.Tensor  # int32 [restore_grid]
    flush_src: torch.Tensor  # int32 [flush_grid]: side block of a flush candidate
    flush_dst: torch.Tensor  # int64 [flush_grid]: its cache block, -1 = skip
    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    decode_selector: DecodeSelector  # the builder's: which decode kernel serves
    prefill_packs: tuple[tuple[int, int, int, int], ...]  # first, end, blocks, max q
    query_start_loc_cpu: np.ndarray
    restore_grid: int  # entries of the restore and flush tables a launch covers
    flush_grid: int


class _Tables:
    """The builder's persistent device tables, one int32 allocation uploaded from a
    host mirror in a single copy per step (through upstream's round-robin pinned
    buffers, so the host never waits), plus the int64 tables the device fills."""

    def __init__(self, rows: int, width: int, num_flush: int, tokens: int,
                 device: torch.device) -> None:
        from vllm.v1.worker.gpu.buffer_utils import UvaBufferPool

        sizes = {"side_table": rows * width, "num_flushed": rows, "tail_start": rows,
                 "hit_end": rows, "scratch_offset": rows, "restore_dst": rows,
                 "restore_row": rows, "flush_src": num_flush, "flush_row": num_flush,
                 "flush_logical": num_flush}
        self.rows, self.width, self.num_flush = rows, width, num_flush
        total = sum(sizes.values())
        self.host = np.zeros(total, np.int32)
        if device.type == "cpu":  # the host mirror is the table itself
            self.device = torch.from_numpy(self.host)
            self._upload = None
        else:
            self.device = torch.zeros(total, dtype=torch.int32, device=device)
            self._upload = UvaBufferPool(total, torch.int32)
        self.host_views: dict[str, np.ndarray] = {}
        self.device_views: dict[str, torch.Tensor] = {}
        offset = 0
        for name, size in sizes.items():
            self.host_views[name] = self.host[offset:offset + size]
            self.device_views[name] = self.device[offset:offset + size]
            offset += size
        self.host_views["side_table"].shape = (rows, width)
        self.device_views["side_table"] = self.device_views["side_table"].view(rows, width)
        self.stage_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.flush_dst = torch.full((num_flush,), -1, dtype=torch.int64, device=device)

    def reset_host(self) -> None:
        self.host.fill(0)
        self.host_views["tail_start"].fill(1)
        self.host_views["restore_dst"].fill(-1)

    def upload(self) -> None:
        if self._upload is not None:
            self._upload.copy_to_gpu(self.host, out=self.device)


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    # Decode and speculative verify are one fused launch; prefill packs run eagerly.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if not runs_model_runner_v2(vllm_config):
            raise ValueError(
                "KVarN cache dtypes run on Model Runner V2 only, whose request lifecycle "
                "drives the side pool; this configuration uses the V1 runner (unset "
                "VLLM_USE_V2_MODEL_RUNNER=0, or drop the feature V2 lacks that the log "
                "names)")
        self.preset = Preset.parse(vllm_config.cache_config.cache_dtype)
        g = self.preset.group
        spec_config = vllm_config.speculative_config
        self.num_spec = (spec_config.num_speculative_tokens or 0) if spec_config else 0
        self._init_reorder_batch_threshold(1 + self.num_spec, supports_spec_as_decode=True)
        plan = side_pool_plan(vllm_config, self.preset, kv_cache_spec.num_kv_heads,
                              kv_cache_spec.head_size)
        self.slack = plan.slack
        self.pool = SidePool(plan.num_blocks, g)
        self.lifecycle = SidePoolLifecycle(self.pool, kv_cache_spec.block_size)
        sched = vllm_config.scheduler_config
        tokens = sched.max_num_batched_tokens
        rows = sched.max_num_seqs
        # Tail columns: a chunk's blocks, one straddled block, the host's slack.
        width = 2 + cdiv(tokens + self.slack, g)
        num_flush = rows * 2 + cdiv(tokens + rows * self.slack, g)
        self.tables = _Tables(rows, width, num_flush, tokens, device)
        self.scratch_blocks = scratch_blocks(vllm_config, self.preset)
        self.decode_selector = DecodeSelector()
        # Its lifecycle has announced no step yet: until it does, every build is a
        # dummy run (0.34.0's dummy runs carry request slots too).
        self._last_step = self.lifecycle.steps
        logger.info_once(
            "KVarN %s: side pool of %d blocks per layer (%.1f MiB per layer; needs %d "
            "for %d seats, %d tokens per step, %d speculative tokens), prefill scratch "
            "of %d blocks", self.preset.name, plan.num_blocks,
            plan.bytes_per_layer / 2**20, plan.required, plan.seats, tokens,
            plan.spec_tokens, self.scratch_blocks)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:
        cam = common_attn_metadata
        step = self.lifecycle.steps
        if step == self._last_step or cam.req_idx is None:
            # Not a step the runner announced: warm-up or another dummy run.
            return self._inert(cam)
        self._last_step = step
        t = self.tables
        num_reqs = cam.num_reqs
        if num_reqs > t.rows or cam.num_actual_tokens > t.stage_slots.shape[0]:
            raise RuntimeError(
                f"KVarN: a step of {num_reqs} rows and {cam.num_actual_tokens} tokens "
                f"exceeds the planned {t.rows} seats and {t.stage_slots.shape[0]} tokens")
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy()
        seq_up = cam.seq_lens_cpu_upper_bound[:num_reqs].numpy()
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        t.reset_host()
        h = t.host_views
        self.pool.begin_step()
        num_flush = 0
        scratch_used = 0
        packs: list[tuple[int, int, int, int]] = []
        pack_first, pack_blocks, pack_q = num_decodes, 0, 0
        g = self.preset.group
        for b in range(num_reqs):
            q = int(qsl[b + 1] - qsl[b])
            if q == 0:
                continue  # a padding row of a full CUDA graph
            length = int(seq_up[b])
            # A short row may be a prefill chunk, not a verify; treating it as one only
            # keeps its blocks a step longer.
            spec = bool(self.num_spec) and q <= 1 + self.num_spec
            plan = self.pool.plan_row(int(cam.req_idx[b]), length, q, self.slack, spec)
            sides = plan.side_blocks
            if len(sides) > t.width:
                raise RuntimeError(f"KVarN: row {b} needs {len(sides)} side table columns, "
                                   f"the table has {t.width}")
            h["side_table"][b, : len(sides)] = sides
            h["tail_start"][b] = plan.tail_start
            h["num_flushed"][b] = plan.tail_start - 1
            h["hit_end"][b] = plan.hit_end
            if plan.restore is not None:
                h["restore_dst"][b] = plan.restore
                h["restore_row"][b] = b
            n = len(plan.flush)
            if num_flush + n > t.num_flush:
                raise RuntimeError(f"KVarN: {num_flush + n} flush candidates exceed the "
                                   f"table's {t.num_flush}")
            for j, (side, logical) in enumerate(plan.flush, num_flush):
                h["flush_src"][j], h["flush_row"][j], h["flush_logical"][j] = side, b, logical
            num_flush += n
            if b >= num_decodes:
                blocks = cdiv(length, g)
                if scratch_used + blocks > self.scratch_blocks:
                    packs.append((pack_first, b, pack_blocks, pack_q))
                    pack_first, pack_blocks, pack_q, scratch_used = b, 0, 0, 0
                h["scratch_offset"][b] = scratch_used
                scratch_used += blocks
                pack_blocks, pack_q = max(pack_blocks, blocks), max(pack_q, q)
        if num_reqs > num_decodes:
            packs.append((pack_first, num_reqs, pack_blocks, pack_q))
        t.upload()
        self._finish_plan(cam, num_reqs, num_flush)
        return self._metadata(cam, num_decodes, num_decode_tokens, tuple(packs),
                              restore_grid=num_reqs, flush_grid=num_flush)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> KVarNMetadata:
        """Inert tables sized for the captured shape; each replayed step's build fills
        the same buffers, within the grids fixed here."""
        cam = common_attn_metadata
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        if num_decodes != cam.num_reqs:
            raise RuntimeError("KVarN captures uniform decode batches only")
        q = num_decode_tokens // max(num_decodes, 1)
        # A decode row can fill at most the blocks its query and the slack reach.
        per_row = 1 + cdiv(q + self.slack, self.preset.group)
        return replace(self._inert(cam), restore_grid=cam.num_reqs,
                       flush_grid=min(cam.num_reqs * per_row, self.tables.num_flush))

    def _inert(self, cam: CommonAttentionMetadata) -> KVarNMetadata:
        self.tables.reset_host()
        self.tables.upload()
        self._finish_plan(cam, 0, 0)
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        return self._metadata(cam, num_decodes, num_decode_tokens, (), 0, 0)

    def _finish_plan(self, cam: CommonAttentionMetadata, num_rows: int,
                     num_flush: int) -> None:
        from vllm.kvarn.plan import flush_targets, stage_slots

        t, d = self.tables, self.tables.device_views
        if num_rows and cam.positions is None:
            raise RuntimeError("KVarN needs the runner's token positions in the metadata")
        stage_slots(cam.positions, cam.query_start_loc, num_rows, d["side_table"],
                    d["tail_start"], d["hit_end"], self.preset.group, t.stage_slots)
        flush_targets(d["flush_row"], d["flush_logical"], num_flush, cam.seq_lens,
                      cam.query_start_loc, d["hit_end"], cam.block_table_tensor,
                      self.preset.group, t.flush_dst)

    def _metadata(self, cam: CommonAttentionMetadata, num_decodes: int,
                  num_decode_tokens: int, packs, restore_grid: int,
                  flush_grid: int) -> KVarNMetadata:
        d = self.tables.device_views
        return KVarNMetadata(
            seq_lens=cam.seq_lens, query_start_loc=cam.query_start_loc,
            block_table=cam.block_table_tensor, side_table=d["side_table"],
            num_flushed=d["num_flushed"], scratch_offset=d["scratch_offset"],
            stage_slots=self.tables.stage_slots, restore_dst=d["restore_dst"],
            restore_row=d["restore_row"], flush_src=d["flush_src"],
            flush_dst=self.tables.flush_dst, num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_query_len=num_decode_tokens // num_decodes if num_decodes else 0,
            decode_selector=self.decode_selector, prefill_packs=packs,
            query_start_loc_cpu=cam.query_start_loc_cpu[: cam.num_reqs + 1].numpy(),
            restore_grid=restore_grid, flush_grid=flush_grid)


def scratch_blocks(vllm_config, preset: Preset) -> int:
    """Scratch blocks for one prefill pack: the longest row fits."""
    return cdiv(vllm_config.model_config.max_model_len, preset.group)


class KVarNAttentionImpl(AttentionImpl[KVarNMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        unsupported = {"alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                       "logits_soft_cap": logits_soft_cap,
                       "kv_sharing_target_layer_name": kv_sharing_target_layer_name}
        used = [k for k, v in unsupported.items() if v is not None]
        if used:
            raise ValueError(f"KVARN backend: {', '.join(used)} not supported; KVarN "
                             "serves plain causal decoder attention")
        self.preset = Preset.parse(kv_cache_dtype)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        config = get_current_vllm_config_or_none()
        assert config is not None, "the KVARN impl is built inside the model's config"
        self.side_plan = side_pool_plan(config, self.preset, self.num_kv_heads, head_size)
        self.scratch_blocks = scratch_blocks(config, self.preset)
        from vllm.kvarn import decode

        spec = config.speculative_config
        q_len = 1 + ((spec.num_speculative_tokens or 0) if spec else 0)
        rows = q_len * (num_heads // self.num_kv_heads)
        logger.info_once("KVarN decode kernel (head dim %d, %d query rows per KV head): %s",
                         head_size, rows, DecodeSelector().describe(
                             decode.default_variant(), self.preset, head_size, rows))

    def _pools(self, layer, kv_cache: torch.Tensor) -> tuple[PagedKV, torch.Tensor]:
        """The layer's paged view and its side pool; on the first call (the profiling
        run) the side pool and the clamp counter come from the workspace manager."""
        ws = current_workspace_manager()
        key = ("kvarn", layer.layer_name)
        side = ws.get_persistent((*key, "side"), self.side_plan.shape, torch.float16,
                                 zero_init=True)
        clamp = ws.get_persistent((*key, "clamp"), (1,), torch.int32, zero_init=True)
        rec = self.preset.tile_bytes(self.head_size)
        # view, never reshape: a copy of a split (non-contiguous) cache would drop writes.
        cache = kv_cache.view(torch.uint8).view(-1, self.num_kv_heads, rec)
        return PagedKV(self.preset, self.head_size, cache, side), clamp

    def _prefill_scratch(self) -> list[torch.Tensor]:
        """fp16 K and V scratch [blocks, G, H, D] for one prefill pack, shared by all
        layers (packs run one at a time) and reserved by the profiling run."""
        shape = (self.scratch_blocks, self.preset.group, self.num_kv_heads, self.head_size)
        return current_workspace_manager().get_simultaneous(
            (shape, torch.float16), (shape, torch.float16))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("KVARN backend: fused output quantization")
        if not is_workspace_manager_initialized():
            raise RuntimeError("KVARN backend needs the workspace manager (GPU worker)")
        kv, clamp = self._pools(layer, kv_cache)
        if attn_metadata is None:  # profiling run: reserve, attend to nothing
            self._prefill_scratch()
            return output.fill_(0)
        from vllm.kvarn import decode, rotate
        from vllm.kvarn.dequant import restore_sinks
        from vllm.kvarn.flush import flush

        md = attn_metadata
        n = query.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        restore_sinks(kv, md.restore_dst[: md.restore_grid], md.restore_row[: md.restore_grid],
                      md.block_table)
        rotate.rotate_and_stage(key[:n].view(n, hkv, d), value[:n].view(n, hkv, d), kv,
                                md.stage_slots[:n], clamp)
        out = output[:n].view(n, hq, d)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd:
            qd = query[:ndt].view(nd, md.decode_query_len, hq, d)
            res = decode.attend(qd, kv, md.block_table[:nd], md.side_table[:nd],
                                md.seq_lens[:nd], md.num_flushed[:nd], sm_scale=self.scale,
                                selector=md.decode_selector)
            out[:ndt] = res.reshape(ndt, hq, d).to(out.dtype)
        for pack in md.prefill_packs:
            self._prefill_pack(pack, query, out, kv, md)
        flush(kv, md.flush_src[: md.flush_grid], md.flush_dst[: md.flush_grid])
        return output

    def _prefill_pack(self, pack, query, out, kv: PagedKV, md: KVarNMetadata) -> None:
        """Rows first..end-1 (prefill chunks, new rows already staged): their whole
        context and themselves, rotated, into the scratch; causal attention there with
        the rotated query; the output is rotated back."""
        from vllm.kvarn import rotate
        from vllm.kvarn.dequant import materialize_rows
        from vllm.kvarn.prefill import prefill_attention

        first, end, max_blocks, max_q = pack
        k_scr, v_scr = self._prefill_scratch()
        materialize_rows(kv, first, end - first, max_blocks, md.block_table, md.side_table,
                         md.num_flushed, md.seq_lens, md.scratch_offset, k_scr, v_scr)
        s, e = int(md.query_start_loc_cpu[first]), int(md.query_start_loc_cpu[end])
        q_rot = rotate.rotate(query[s:e].view(e - s, self.num_heads, self.head_size))
        o_rot = prefill_attention(
            q_rot, k_scr.view(-1, self.num_kv_heads, self.head_size),
            v_scr.view(-1, self.num_kv_heads, self.head_size),
            md.query_start_loc[first:end + 1] - md.query_start_loc[first],
            md.seq_lens[first:end], md.scratch_offset[first:end] * self.preset.group,
            max_q, self.scale)
        out[s:e] = rotate.rotate(o_rot, out.dtype)
