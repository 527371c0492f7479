"""Pure-torch stand-ins for the compiled CPU ops, registered only when absent.

The wheel users install carries CUDA binaries only, so on a CPU-only host
``torch.ops._C`` lacks the ops that the CPU worker, the CPU_ATTN backend, the
rotary embedding and the sampler call. Registering these stand-ins (schemas as
upstream's CPU extension declares them, csrc/cpu/torch_bindings.cpp) lets that
very wheel serve on CPU, slowly. Ops already present (a real CPU build) are
never shadowed.

From 0.34.0 upstream's x86 CPU path needs Triton (triton-cpu), which a CUDA
build of Triton without a GPU does not give; ``serves_without_triton`` lets the
platform take upstream's standalone CPU runner there instead, as upstream does
off x86, on the stand-ins for its ops (``cpu_runner_ops``, ``cpu_sampling_ops``).
Each stand-in names the C++ kernel it mirrors (``# mirrors: FILE::FUNCTION``,
FILE under the sdist's root).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from vllm.fork import cpu_runner_ops, cpu_sampling_ops

if TYPE_CHECKING:
    from vllm.platforms.interface import Platform

logger = init_logger(__name__)

_NAMESPACE = "_C"
# Kept alive for the life of the process: dropping a Library unregisters it.
_LIBRARY: torch.library.Library | None = None
# The ops this process defined: the rest of torch.ops._C came compiled.
_STOOD_IN: set[str] = set()
# Every build of upstream's CPU extension defines it, no CUDA build does.
_CPU_EXTENSION_MARKER = "init_cpu_memory_env"


# mirrors: csrc/cpu/utils.cpp::init_cpu_memory_env
def _init_cpu_memory_env(node_ids: Sequence[int]) -> None:
    # The compiled op binds allocations to NUMA nodes; plain torch allocates
    # wherever the OS puts it, which is correct, only less local.
    return None


# mirrors: csrc/cpu/cpu_attn.cpp::cpu_attn_has_isa
def _cpu_attn_has_isa(isa: str) -> bool:
    return False


# mirrors: csrc/cpu/cpu_attn.cpp::get_scheduler_metadata
def _get_scheduler_metadata(
    num_req: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    casual: bool,
    window_size: int,
    isa_hint: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    # The stand-in attention plans nothing ahead; the backend only passes
    # this tensor back to cpu_attention_with_kv_cache.
    return torch.empty(0, dtype=torch.int8)


def _require_plain_kv_cache(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        raise NotImplementedError(
            f"the pure-torch CPU attention fallback stores the KV cache in the "
            f"model dtype only (kv_cache_dtype='auto'), got {kv_cache_dtype!r}"
        )


# mirrors: csrc/cpu/cpu_attn.cpp::cpu_attn_reshape_and_cache
def _cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write key/value [tokens, kv_heads, head] into [blocks, kv_heads, block, head]."""
    _require_plain_kv_cache(kv_cache_dtype)
    block_size = key_cache.size(2)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0  # negative slots are padding
    tokens = keep.nonzero().flatten()
    slots = slots[tokens]
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices around a slice put the token dim first: [n, heads, head].
    key_cache[blocks, :, offsets] = key[tokens].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[tokens].to(value_cache.dtype)


def _gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, length: int
) -> torch.Tensor:
    """[blocks, kv_heads, block, head] pages -> [kv_heads, length, head]."""
    gathered = cache.index_select(0, pages)
    heads, head = gathered.size(1), gathered.size(3)
    return gathered.transpose(0, 1).reshape(heads, -1, head)[:, :length]


# mirrors: csrc/cpu/cpu_attn.cpp::cpu_attention_with_kv_cache
def _cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window_size: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Paged attention, one request at a time, in float32."""
    _require_plain_kv_cache(kv_cache_dtype)
    if dynamic_causal is not None:
        raise NotImplementedError(
            "the pure-torch CPU attention fallback supports a fixed causal flag "
            "only, not per-request dynamic_causal masks"
        )
    head_size = key_cache.size(-1)
    block_size = key_cache.size(2)
    q_all = query.reshape(query.size(0), -1, head_size)
    out_all = output.view(output.size(0), -1, head_size)
    num_heads = q_all.size(1)
    group = num_heads // key_cache.size(1)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for req, kv_len in enumerate(lengths):
        q_lo, q_hi = starts[req], starts[req + 1]
        n_q = q_hi - q_lo
        if n_q == 0 or kv_len == 0:
            continue
        pages = block_table[req, : math.ceil(kv_len / block_size)].to(torch.int64)
        k = _gather_pages(key_cache, pages, kv_len).float()
        v = _gather_pages(value_cache, pages, kv_len).float()
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        q = q_all[q_lo:q_hi].transpose(0, 1).float()  # [heads, n_q, head]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        # The queries are the last n_q positions of the sequence.
        q_pos = torch.arange(kv_len - n_q, kv_len).unsqueeze(1)
        k_pos = torch.arange(kv_len).unsqueeze(0)
        if alibi_slopes is not None:
            bias = (k_pos - q_pos).float()
            scores = scores + alibi_slopes.float().view(-1, 1, 1) * bias
        visible = torch.ones(n_q, kv_len, dtype=torch.bool)
        if causal:
            visible &= k_pos <= q_pos
        if sliding_window_size > 0:
            visible &= q_pos - k_pos < sliding_window_size
        scores = scores.masked_fill(~visible, float("-inf"))
        if s_aux is not None:
            # A sink is one extra logit per head that takes probability mass
            # but contributes no value.
            sink = s_aux.float().view(-1, 1, 1).expand(-1, n_q, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        else:
            probs = scores.softmax(dim=-1)
        out_all[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(output.dtype)


# mirrors: csrc/cpu/utils.cpp::compute_slot_mapping_kernel_impl
def _compute_slot_mapping_kernel_impl(
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    counts = query_start_loc[1:] - query_start_loc[:-1]
    num_tokens = int(query_start_loc[-1])
    rows = torch.repeat_interleave(
        torch.arange(counts.numel()), counts.to(torch.int64)
    )
    pos = positions[:num_tokens].to(torch.int64)
    pages = block_table[rows, pos // block_size].to(torch.int64)
    slot_mapping[:num_tokens] = (pages * block_size + pos % block_size).to(
        slot_mapping.dtype
    )


# mirrors: csrc/cpu/pos_encoding.cpp::rotary_embedding
def _rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """Rotate query/key in place: NeoX halves or GPT-J interleaved pairs."""
    flat = positions.flatten().to(torch.int64)
    cos, sin = cos_sin_cache.index_select(0, flat).float().chunk(2, dim=-1)
    if inverse:
        sin = -sin
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos_sin_cache.size(-1)
    for tensor in (query, key):
        if tensor is None:
            continue
        heads = tensor.view(flat.numel(), -1, head_size)
        part = heads[..., rope_dim_offset : rope_dim_offset + rot_dim]
        if is_neox:
            x1, x2 = part.chunk(2, dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
        # Both results are computed before either half is overwritten.
        a, b = x1.float(), x2.float()
        rotated_1, rotated_2 = a * cos - b * sin, b * cos + a * sin
        x1.copy_(rotated_1)
        x2.copy_(rotated_2)


# mirrors: csrc/cpu/sampling_kernels.cpp::greedy_argmax
def _greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1).view(-1)


# mirrors: csrc/cpu/sampling_kernels.cpp::fused_gumbel_argmax
def _fused_gumbel_argmax(logits: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling with one seeded stream per row."""
    out = torch.empty(logits.size(0), dtype=torch.int64)
    generator = torch.Generator()
    for row, seed in enumerate(seeds.tolist()):
        generator.manual_seed(int(seed))
        uniform = torch.rand(logits.size(1), generator=generator, dtype=torch.float64)
        # Clamp away from 0 so log(-log(u)) stays finite.
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
        out[row] = torch.argmax(logits[row].double() + gumbel)
    return out


# mirrors: csrc/cpu/sgl-kernels/gemm.cpp::convert_weight_packed
def _convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    # No packing: weight_packed_linear below consumes the plain layout.
    return weight


# mirrors: csrc/cpu/sgl-kernels/gemm.cpp::weight_packed_linear
def _weight_packed_linear(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    bias: torch.Tensor | None,
    is_vnni: bool,
) -> None:
    result = torch.nn.functional.linear(mat1, mat2.to(mat1.dtype))
    if bias is not None:
        result = result + bias.to(result.dtype)
    out.copy_(result)


# name -> (schema after the name, implementation). The dispatcher passes a
# Python kernel only the arguments the caller gave, so each implementation
# repeats the schema's defaults.
_OPS: dict[str, tuple[str, Callable[..., object]]] = {
    "init_cpu_memory_env": ("(SymInt[] node_ids) -> ()", _init_cpu_memory_env),
    "cpu_attn_has_isa": ("(str isa) -> bool", _cpu_attn_has_isa),
    "get_scheduler_metadata": (
        ("(int num_req, int num_heads_q, int num_heads_kv, int head_dim, "
        "Tensor seq_lens, ScalarType dtype, Tensor query_start_loc, bool casual, "
        "int window_size, str isa_hint, bool enable_kv_split, "
        'Tensor? dynamic_causal, str kv_cache_dtype="auto") -> Tensor'),
        _get_scheduler_metadata,
    ),
    "cpu_attn_reshape_and_cache": (
        ("(Tensor key, Tensor value, Tensor(a2!) key_cache, "
        "Tensor(a3!) value_cache, Tensor slot_mapping, str isa, "
        'float k_scale=1.0, float v_scale=1.0, str kv_cache_dtype="auto") -> ()'),
        _cpu_attn_reshape_and_cache,
    ),
    "cpu_attention_with_kv_cache": (
        ("(Tensor query, Tensor key_cache, Tensor value_cache, Tensor(a3!) output, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool causal, "
        "Tensor? alibi_slopes, SymInt sliding_window_size, Tensor block_table, "
        "float softcap, Tensor scheduler_metadata, Tensor? s_aux, "
        "Tensor? dynamic_causal, float k_scale=1.0, float v_scale=1.0, "
        'str kv_cache_dtype="auto") -> ()'),
        _cpu_attention_with_kv_cache,
    ),
    "compute_slot_mapping_kernel_impl": (
        ("(Tensor query_start_loc, Tensor positions, Tensor block_table, "
        "Tensor(a3!) slot_mapping, SymInt block_size) -> ()"),
        _compute_slot_mapping_kernel_impl,
    ),
    "rotary_embedding": (
        ("(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, "
        "bool inverse=False) -> ()"),
        _rotary_embedding,
    ),
    "greedy_argmax": ("(Tensor logits) -> Tensor", _greedy_argmax),
    "fused_gumbel_argmax": (
        "(Tensor logits, Tensor seeds) -> Tensor",
        _fused_gumbel_argmax,
    ),
    "convert_weight_packed": ("(Tensor! weight) -> Tensor", _convert_weight_packed),
    "weight_packed_linear": (
        ("(Tensor(a0!) out, Tensor mat1, Tensor mat2, Tensor? bias, "
        "bool is_vnni) -> ()"),
        _weight_packed_linear,
    ),
    # Upstream's standalone CPU runner (vllm/_cpu_ops.py); its compiled ops are
    # built into non-x86 CPU wheels only.
    "gather_block_table_cpu": (
        ("(Tensor block_table, Tensor(a1!) output, Tensor idx_mapping, "
        "Tensor num_blocks, SymInt num_reqs_padded) -> ()"),
        cpu_runner_ops.gather_block_table,
    ),
    "compute_slot_mapping_cpu": (
        ("(Tensor block_table, Tensor(a1!) slot_mapping, Tensor idx_mapping, "
        "Tensor query_start_loc, Tensor positions, SymInt block_size, "
        "bool mapping_enabled, SymInt pad_slot_id) -> ()"),
        cpu_runner_ops.compute_slot_mapping,
    ),
    "prepare_prefill_inputs_cpu": (
        ("(Tensor(a0!) input_ids, Tensor(a1!) next_prefill_tokens, "
        "Tensor idx_mapping, Tensor query_start_loc, Tensor all_token_ids, "
        "Tensor prefill_len, Tensor num_computed_tokens) -> ()"),
        cpu_runner_ops.prepare_prefill_inputs,
    ),
    "get_prompt_logprobs_token_ids_cpu": (
        ("(SymInt num_tokens, Tensor query_start_loc, Tensor idx_mapping, "
        "Tensor num_computed_tokens, Tensor all_token_ids) -> Tensor"),
        cpu_runner_ops.get_prompt_logprobs_token_ids,
    ),
    "prepare_pos_seq_lens_cpu": (
        ("(Tensor idx_mapping, Tensor query_start_loc, Tensor num_computed_tokens, "
        "Tensor(a3!) pos, Tensor(a4!) seq_lens) -> ()"),
        cpu_runner_ops.prepare_pos_seq_lens,
    ),
    "prepare_mrope_positions_cpu": (
        ("(Tensor(a0!) positions, Tensor prefill_positions, Tensor prefill_delta, "
        "Tensor idx_mapping, Tensor query_start_loc, Tensor prefill_lens, "
        "Tensor num_computed_tokens) -> ()"),
        cpu_runner_ops.prepare_mrope_positions,
    ),
    "combine_sampled_and_draft_tokens_cpu": (
        ("(Tensor(a0!) input_ids, Tensor idx_mapping, Tensor last_sampled_tokens, "
        "Tensor query_start_loc, Tensor seq_lens, Tensor prefill_len, "
        "Tensor draft_tokens, Tensor cu_num_logits, SymInt num_logits, "
        "SymInt num_new_sampled_tokens) -> Tensor"),
        cpu_runner_ops.combine_sampled_and_draft_tokens,
    ),
    "post_update_cpu": (
        ("(Tensor idx_mapping, Tensor(a1!) num_computed_tokens, "
        "Tensor(a2!) last_sampled_tokens, Tensor(a3!)? output_bin_counts, "
        "Tensor sampled_tokens, Tensor num_sampled, Tensor num_rejected, "
        "Tensor? query_start_loc, Tensor(a8!) all_token_ids, "
        "Tensor(a9!) total_len) -> ()"),
        cpu_runner_ops.post_update,
    ),
    "gumbel_sample_cpu": (
        ("(Tensor logits, Tensor expanded_idx_mapping, Tensor temperature, "
        "Tensor seeds, Tensor positions, bool apply_temperature, "
        "bool is_drafting, bool use_fp64) -> Tensor"),
        cpu_sampling_ops.gumbel_sample,
    ),
    "apply_logit_bias_cpu": (
        ("(Tensor(a0!) logits, Tensor expanded_idx_mapping, Tensor positions, "
        "Tensor num_allowed_token_ids, Tensor allowed_token_ids, "
        "Tensor num_logit_bias, Tensor logit_bias_token_ids, Tensor logit_bias, "
        "Tensor min_lens, Tensor num_stop_token_ids, "
        "Tensor restore_when_all_masked, Tensor stop_token_ids, "
        "bool check_all_masked_rows) -> ()"),
        cpu_sampling_ops.apply_logit_bias,
    ),
}


def missing_ops() -> list[str]:
    """Names in ``torch.ops._C`` that the CPU path calls and nothing defines."""
    namespace = getattr(torch.ops, _NAMESPACE)
    return [name for name in _OPS if not hasattr(namespace, name)]


def register_missing_ops() -> list[str]:
    """Define a pure-torch ``_C::<op>`` for each missing op; returns their names.

    Idempotent: a second call finds nothing missing.
    """
    global _LIBRARY
    names = missing_ops()
    if not names:
        return []
    if _LIBRARY is None:
        # FRAGMENT: adds to the namespace without claiming it.
        _LIBRARY = torch.library.Library(_NAMESPACE, "FRAGMENT")
    for name in names:
        schema, impl = _OPS[name]
        _LIBRARY.define(name + schema)
        # Ops without tensor arguments have no device to dispatch on.
        key = "CPU" if "Tensor" in schema else "CompositeExplicitAutograd"
        _LIBRARY.impl(name, impl, key)
        _STOOD_IN.add(name)
    logger.warning(
        "Compiled CPU ops are absent from this vLLM build; registered slow "
        "pure-torch fallbacks for: %s",
        ", ".join(names),
    )
    return names


def serves_without_triton(platform: type[Platform]) -> bool:
    """Whether the CPU platform serves with no Triton, on the stand-ins.

    True where this build lacks upstream's compiled CPU extension (the CUDA
    wheel on a CPU host): CpuPlatform then takes upstream's standalone CPU
    runner on x86 too, where upstream would demand triton-cpu. A real CPU
    build keeps upstream's rule. ``platform.import_kernels()`` (idempotent)
    first tries the compiled extension, then registers what is missing.
    """
    platform.import_kernels()
    return _CPU_EXTENSION_MARKER in _STOOD_IN
