"""The KVARN attention backend: vLLM's side of the KVarN cache (vllm.kvarn holds the
format, the reference and the Triton kernels).

Per attention layer the paged pool is uint8 [blocks, KV heads, G, tile_bytes / G] in
layout LBHNC, so one (block, KV head) is one contiguous tile record; the fp16 side pool
(rotated rows not yet quantized: every request's sink block 0 and its tail) and the
prefill scratch come from the workspace manager during the profiling run, so the
memory profile charges them before the KV pool is sized.

Per step the metadata builder decides, on the host, which committed full blocks to
flush and where each new row is staged; forward then flushes, stages, and attends:
fused decode / speculative verify over records + side rows, and for prefill chunks
causal attention over the raw chunk plus the dequantized context.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from vllm.config import get_current_vllm_config_or_none
from vllm.fork.kvarn_config import side_pool_plan
from vllm.fork.kvarn_dtypes import KVARN_CACHE_DTYPES, is_kvarn_dtype
from vllm.kvarn import HEAD_DIMS, PagedKV, Preset
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
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout
from vllm.v1.worker.workspace import (
    current_workspace_manager,
    is_workspace_manager_initialized,
)

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

# Sm80+ (Ampere: the 3090/4090-class cards the fork serves on, and datacenter cards).
MIN_CAPABILITY = 80


def _run_preset() -> Preset | None:
    config = get_current_vllm_config_or_none()
    if config is None or not is_kvarn_dtype(config.cache_config.cache_dtype):
        return None
    return Preset.parse(config.cache_config.cache_dtype)


def _spec_preset(spec: AttentionSpec) -> Preset:
    return Preset.parse(spec.kv_quant_mode.name.lower())


class KVarNAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    # forward stages the new rows itself: staging, flush and attention share metadata.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KVARN_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "KVARN"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        """[G]: a kernel block is one tile. Without a spec, G of the run's preset."""
        if kv_cache_spec is not None and kv_cache_spec.kv_quant_mode.is_kvarn:
            return [_spec_preset(kv_cache_spec).group]
        preset = _run_preset()
        if preset is not None:
            return [preset.group]
        return sorted({Preset.parse(n).group for n in KVARN_CACHE_DTYPES})

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        preset = _run_preset()
        return preset.group if preset is not None else default_block_size

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One state per token of tile_bytes / G bytes (exact for every preset), so a
        block of G tokens and one KV head is one tile record."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_kvarn:
            return spec
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"KVarN needs equal K and V head sizes, got "
                             f"{spec.head_size} and {spec.head_size_v}")
        preset = _spec_preset(spec)
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


def select_kvarn_backend(selected_backend: AttentionBackendEnum | None,
                         selector: AttentionSelectorConfig,
                         capability: DeviceCapability | None) -> str | None:
    """The platform hook: a kvarn cache dtype always means the KVARN backend."""
    if not is_kvarn_dtype(selector.kv_cache_dtype):
        return None
    if selected_backend not in (None, AttentionBackendEnum.KVARN):
        raise ValueError(
            f"--attention-backend {selected_backend.name} cannot read "
            f"--kv-cache-dtype {selector.kv_cache_dtype}; allowed: KVARN (or leave it unset)")
    reasons = KVarNAttentionBackend.validate_configuration(
        device_capability=capability, **selector._asdict())
    if reasons:
        raise ValueError(f"--kv-cache-dtype {selector.kv_cache_dtype}: the KVARN backend "
                         f"cannot serve this layer ({selector!r}): {', '.join(reasons)}")
    logger.info_once("Using KVARN attention backend for %s.", selector.kv_cache_dtype)
    return AttentionBackendEnum.KVARN.get_path()


@dataclass
class KVarNMetadata(AttentionMetadata):
    seq_lens: torch.Tensor  # int32 [B], including this step's query tokens
    query_start_loc: torch.Tensor  # int32 [B + 1]
    block_table: torch.Tensor  # int32 [B, max blocks]
    num_flushed: torch.Tensor  # int32 [B]: logical blocks 1..F are records
    side_table: torch.Tensor  # int32 [B, 1 + max tail]: sink, then the tail
    stage_slots: torch.Tensor  # int64 [T]: side block * G + row of each new row
    flush_src: torch.Tensor  # int64 [N]: side blocks whose tokens are all committed
    flush_dst: torch.Tensor  # int64 [N]: their cache blocks
    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_flushed_cpu: np.ndarray
    side_table_cpu: np.ndarray


class SideBlockMap:
    """Which side block holds each cache block's fp16 rows, shared by all layers of a
    KV group (their side pools are indexed alike).

    Keyed by cache block id, not by request: a prefix-cache hit on a sink finds the
    sink's rows, since equal block ids hold equal tokens. A sink stays until its block
    id shows up at another logical position (the page was recycled); sinks not in the
    current batch are evicted oldest first when the pool runs out.
    """

    def __init__(self, num_side_blocks: int) -> None:
        self.num_side_blocks = num_side_blocks
        self.side_of: dict[int, int] = {}
        self.is_sink: dict[int, bool] = {}
        self.free = list(range(num_side_blocks - 1, -1, -1))
        self.released: list[int] = []  # freed by this step's flush: reusable next step

    def begin_step(self) -> None:
        self.free.extend(self.released)
        self.released.clear()

    def lookup(self, cache_block: int, sink: bool, fresh: bool, live: set[int]) -> int:
        """The side block of cache_block; fresh: its rows are all written this step."""
        side = self.side_of.get(cache_block)
        if side is not None and self.is_sink[cache_block] != sink:
            self._drop(cache_block)  # recycled page: its old rows are someone else's
            side = None
        if side is None:
            if not fresh:
                raise RuntimeError(
                    f"KVarN: the fp16 rows of cache block {cache_block} "
                    f"({'sink' if sink else 'tail'}) are gone; a prefix-cache hit on an "
                    "evicted sink cannot be served")
            side = self._allocate(live)
            self.side_of[cache_block] = side
            self.is_sink[cache_block] = sink
        return side

    def flushed(self, cache_block: int) -> int:
        side = self.side_of.pop(cache_block)
        del self.is_sink[cache_block]
        self.released.append(side)
        return side

    def _drop(self, cache_block: int) -> None:
        self.free.append(self.side_of.pop(cache_block))
        del self.is_sink[cache_block]

    def _allocate(self, live: set[int]) -> int:
        if not self.free:
            for block, sink in list(self.is_sink.items()):  # dicts keep insertion order
                if sink and block not in live:
                    self._drop(block)
                    break
        if not self.free:
            raise RuntimeError(f"KVarN: all {self.num_side_blocks} side blocks are in "
                               "use by the running batch; lower --max-num-seqs")
        return self.free.pop()


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    # Speculative verify is one fused launch; prefill chunks run eagerly.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.preset = _spec_preset(kv_cache_spec)
        spec_config = vllm_config.speculative_config
        num_spec = spec_config.num_speculative_tokens if spec_config else 0
        self._init_reorder_batch_threshold(1 + num_spec, supports_spec_as_decode=True)
        plan = side_pool_plan(vllm_config, self.preset, kv_cache_spec.num_kv_heads,
                              kv_cache_spec.head_size)
        self.side_map = SideBlockMap(plan.num_blocks)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:
        cam = common_attn_metadata
        g = self.preset.group
        num_reqs = cam.num_reqs
        qsl = cam.query_start_loc_cpu[: num_reqs + 1].numpy()
        seq_lens = cam.seq_lens_cpu_upper_bound[:num_reqs].numpy()
        cols = int(-(-int(seq_lens.max(initial=0)) // g))
        # Host copy of the live columns; the v2 runner can hand these over without a sync.
        table = cam.block_table_tensor[:num_reqs, :cols].cpu().numpy()
        self.side_map.begin_step()
        live = {int(b) for b in table.reshape(-1)}
        num_flushed = np.zeros(num_reqs, np.int32)
        side_rows: list[list[int]] = []
        stage = np.full(cam.num_actual_tokens, -1, np.int64)
        flush_src: list[int] = []
        flush_dst: list[int] = []
        for b in range(num_reqs):
            q = int(qsl[b + 1] - qsl[b])
            total = int(seq_lens[b])
            committed = total - q
            f = max(0, committed // g - 1)
            num_flushed[b] = f
            for i in range(1, f + 1):
                block = int(table[b, i])
                if block in self.side_map.side_of and not self.side_map.is_sink[block]:
                    flush_src.append(self.side_map.flushed(block))
                    flush_dst.append(block)
            logical = [0, *range(f + 1, -(-total // g))]
            row = []
            for i in logical:
                fresh = i * g >= committed  # every row of the block is new this step
                row.append(self.side_map.lookup(int(table[b, i]), i == 0, fresh, live))
            side_rows.append(row)
            side_of_logical = dict(zip(logical, row))
            pos = np.arange(committed, total)
            stage[qsl[b]: qsl[b + 1]] = (
                np.array([side_of_logical[int(p) // g] for p in pos], np.int64) * g
                + pos % g)
        width = max((len(r) for r in side_rows), default=1)
        side_table = np.zeros((num_reqs, width), np.int32)
        for b, row in enumerate(side_rows):
            side_table[b, : len(row)] = row
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold, require_uniform=True)
        device = cam.seq_lens.device

        def dev(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a)).to(device, non_blocking=True)

        return KVarNMetadata(
            seq_lens=cam.seq_lens[:num_reqs], query_start_loc=cam.query_start_loc,
            block_table=cam.block_table_tensor[:num_reqs],
            num_flushed=dev(num_flushed), side_table=dev(side_table),
            stage_slots=dev(stage), flush_src=dev(np.array(flush_src, np.int64)),
            flush_dst=dev(np.array(flush_dst, np.int64)),
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            decode_query_len=num_decode_tokens // num_decodes if num_decodes else 0,
            query_start_loc_cpu=cam.query_start_loc_cpu, seq_lens_cpu=torch.from_numpy(
                seq_lens.copy()), num_flushed_cpu=num_flushed, side_table_cpu=side_table)


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
        self.max_model_len = config.model_config.max_model_len
        self.debug = False

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
        """K and V of the longest context, fp16 [tokens, KV heads, D] each: shared by
        all layers (one prefill at a time), reserved by the profiling run."""
        shape = (self.max_model_len, self.num_kv_heads, self.head_size)
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
        from vllm.kvarn import decode, flush, rotate

        md = attn_metadata
        n = md.stage_slots.shape[0]
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        flush.flush(kv, md.flush_src, md.flush_dst, debug=self.debug)
        rotate.rotate_and_stage(key[:n].view(n, self.num_kv_heads, self.head_size),
                                value[:n].view(n, self.num_kv_heads, self.head_size),
                                kv, md.stage_slots, clamp)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd:
            qd = q[:ndt].view(nd, md.decode_query_len, self.num_heads, self.head_size)
            res = decode.attend(qd, kv, md.block_table[:nd], md.side_table[:nd],
                                md.seq_lens[:nd], md.num_flushed[:nd],
                                sm_scale=self.scale, debug=self.debug)
            out[:ndt] = res.reshape(ndt, self.num_heads, self.head_size).to(out.dtype)
        for b in range(nd, md.seq_lens_cpu.shape[0]):
            self._prefill_one(b, q, key, value, out, kv, md)
        return output

    def _prefill_one(self, b: int, q, key, value, out, kv: PagedKV,
                     md: KVarNMetadata) -> None:
        """Causal attention of one prefill chunk over its context and itself, in the
        model frame. The first chunk attends over the raw rows; a continuation
        dequantizes the records and reads the sink and tail rows from the side pool."""
        from vllm.kvarn import dequant, rotate

        s, e = int(md.query_start_loc_cpu[b]), int(md.query_start_loc_cpu[b + 1])
        total = int(md.seq_lens_cpu[b])
        committed = total - (e - s)
        k_new = key[s:e].view(-1, self.num_kv_heads, self.head_size)
        v_new = value[s:e].view(-1, self.num_kv_heads, self.head_size)
        if committed == 0:
            k_all, v_all = k_new, v_new
        else:
            g, f = self.preset.group, int(md.num_flushed_cpu[b])
            k_buf, v_buf = self._prefill_scratch()
            sides = torch.as_tensor(md.side_table_cpu[b], device=kv.side.device)
            sink = kv.side[sides[0]]  # [2, H, G, D], rotated frame
            k_buf[:g], v_buf[:g] = sink[0].transpose(0, 1), sink[1].transpose(0, 1)
            if f:
                kr, vr = dequant.dequantize_blocks(kv, md.block_table[b, 1:f + 1].long())
                k_buf[g:(f + 1) * g] = kr.reshape(-1, self.num_kv_heads, self.head_size)
                v_buf[g:(f + 1) * g] = vr.reshape(-1, self.num_kv_heads, self.head_size)
            n_tail = -(-committed // g) - (f + 1)
            if n_tail > 0:
                tail = kv.side[sides[1:1 + n_tail].long()]  # [n, 2, H, G, D]
                k_buf[(f + 1) * g:(f + 1 + n_tail) * g] = tail[:, 0].transpose(1, 2).reshape(
                    -1, self.num_kv_heads, self.head_size)
                v_buf[(f + 1) * g:(f + 1 + n_tail) * g] = tail[:, 1].transpose(1, 2).reshape(
                    -1, self.num_kv_heads, self.head_size)
            # H is self-inverse: rotating again returns the context to the model frame.
            k_ctx = rotate.rotate(k_buf[:committed], q.dtype)
            v_ctx = rotate.rotate(v_buf[:committed], q.dtype)
            k_all, v_all = torch.cat([k_ctx, k_new]), torch.cat([v_ctx, v_new])
        out[s:e] = _causal_attention(q[s:e], k_all, v_all, self.scale)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [Tq, Hq, D] over k, v [Tk, H, D]; query row i sees keys 0..Tk - Tq + i."""
    tq, tk = q.shape[0], k.shape[0]
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                       v.transpose(0, 1), attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o.transpose(0, 1)
