"""What the GPU tier runs: the models (``kiln.testing.tinymodel.preset`` arguments) and each
scenario's (function in scenarios.py, model, spec)."""
from __future__ import annotations

import os
import re

GIB = 1 << 30
COPY_PERIOD = 257
PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
# Reconstruction NMSE of the format on iid Gaussian tiles (kvarn-spec.md, asserted by
# tests/kernels): K 4-bit 0.010, V 2-bit 0.25, V 4-bit 0.010.
PRESET_NMSE = {
    "kvarn_k4v2_g128": (0.010, 0.25, 128), "kvarn_k4v4_g128": (0.010, 0.010, 128),
    "kvarn_k4v2_g64": (0.010, 0.25, 64), "kvarn_k4v4_g64": (0.010, 0.010, 64),
}

MODELS = {
    "d128": dict(name="d128", dtype="bfloat16"),
    "d64": dict(name="d64", dtype="bfloat16"),
    "copy128": dict(name="d128", dtype="bfloat16", copy_period=COPY_PERIOD),
    "copy64": dict(name="d64", dtype="bfloat16", copy_period=COPY_PERIOD),
    "hybrid128": dict(name="d128", dtype="bfloat16", hybrid=True, init="transformers"),
    "large": dict(name="large"),
    # The Qwen3.5 27B's layer shapes in 8 layers (3:1 Gated DeltaNet / gated attention at
    # head dim 256, GQA 6) and its MTP layer; ~3.5B parameters, drawn on the GPU.
    "hybrid27": dict(name="hybrid27", device="cuda"),
    # Its copying variant (kiln/testing/tinymodel/hybridcopy.py): both gated attention
    # layers copy the token one period back, so greedy answers are known; CPU-drawn.
    "copy27": dict(name="hybrid27", copy_period=COPY_PERIOD),
    # A random DFlash2 drafter (kiln.testing.tinymodel.DrafterSpec fields) for a target above.
    "drafter128": dict(dflash2_drafter=dict(target="copy128", block_size=16)),
    "drafter27": dict(dflash2_drafter=dict(target="copy27", block_size=16)),
    # The deployment's weight budget: 20 layers of the 27B's shapes (15 GiB of bf16,
    # about what a 4-bit 27B's weights take on a 24 GB card) and its MTP layer, with a
    # DFlash2 drafter reading five of its layers as real drafters do.
    "deploy27": dict(name="hybrid27", num_layers=20, device="cuda"),
    "drafter-deploy27": dict(dflash2_drafter=dict(target="deploy27", block_size=16,
                                                  target_layer_ids=(1, 5, 9, 13, 17))),
}


# Engines side by side: a small share each for the start-up check and a fixed KV size,
# since a memory profile sees the other engines' allocations as its own.
SHARED = dict(gpu_memory_utilization=0.04, kv_cache_memory_bytes=GIB // 2)


def _kvarn_copy(preset: str, mode: str) -> dict:
    g = 128 if preset.endswith("g128") else 64
    # 4 seats of prompts up to 8-9 blocks share a pool smaller than two of them:
    # requests are preempted and recomputed.
    return dict(SHARED, kv_cache_dtype=preset, mode=mode, max_num_seqs=4,
                max_num_batched_tokens=256, max_model_len=1536,
                num_gpu_blocks_override=16 if g == 128 else 32)


def _parity(mode: str, **extra) -> dict:
    return dict(SHARED, mode=mode, max_num_batched_tokens=1024, **extra)


def _spec(speculative: dict | None, kv: str = "auto", **extra) -> dict:
    return dict(SHARED, mode="eager", kv_cache_dtype=kv, max_model_len=2560,
                max_num_batched_tokens=1024, speculative=speculative, **extra)


def _dflash2(k: int, **kiln) -> dict:
    config = {"method": "dflash", "model": "DRAFTER", "num_speculative_tokens": k,
              "attention_backend": "TRITON_ATTN"}
    if kiln:
        config["kiln_dflash2"] = kiln
    return config


NGRAM7 = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
          "prompt_lookup_max": 5}
# Greedy output with each method against none: bf16, and KVarN (which takes the
# draft-free methods only).
SPEC_RUNS = {
    "spec-none-bf16": _spec(None),
    "spec-ngram-bf16": _spec(NGRAM7),
    "spec-dflash2-chains-bf16": _spec(_dflash2(7), drafter="drafter128"),
    "spec-dflash2-lookup-bf16": _spec(_dflash2(15, lookup=True, draft_tokens=7),
                                      drafter="drafter128"),
    "spec-none-kvarn": _spec(None, "kvarn_k4v2_g128"),
    "spec-ngram-kvarn": _spec(NGRAM7, "kvarn_k4v2_g128"),
}
MTP3 = {"method": "mtp", "num_speculative_tokens": 3}
CACHES27 = {"bf16": "auto", "kvarn": "kvarn_k4v2_g128"}
# A 24 GB card as the engine can use it (torch sees 23.7 GiB of a 3090's 24 GiB; the
# CUDA context takes some of that), the engine alone on the lent GPU.
CARD24 = dict(budget_gib=23.5, long_prompt=100_000, exclusive=True)
CARD_SPECS = ("off", "ngram", "mtp", "dflash2")
CARD_BUDGET_MIB = 24 * 1024


def _card24(profile: str, spec: str, **extra) -> tuple[str, str, dict]:
    """A card_budget scenario on deploy27; spec=dflash2 gets the model's drafter."""
    drafter = {"drafter": "drafter-deploy27"} if spec == "dflash2" else {}
    return ("card_budget", "deploy27", dict(CARD24, profile=profile, **drafter, **extra))


# The same check on the 27B-shaped hybrid's copying variant, each engine alone on the
# GPU (7 GB of weights), eager and under CUDA graphs: bf16 with n-gram, MTP (k = 3, as
# the deployment runs it) and DFlash2 (k = 7, its random drafter), KVarN with n-gram
# (the methods KVarN takes today).
SPEC27_METHODS = {"none": None, "ngram": NGRAM7, "mtp": MTP3, "dflash2": _dflash2(7)}
SPEC27_RUNS = {
    f"spec27-{method}-{cache}-{mode}": dict(
        mode=mode, kv_cache_dtype=kv, max_model_len=2560, max_num_batched_tokens=1024,
        kv_cache_memory_bytes=2 * GIB, gpu_memory_utilization=0.3, exclusive=True,
        speculative=speculative, **({"drafter": "drafter27"} if method == "dflash2" else {}))
    for mode in ("eager", "graphs")
    for cache, kv in CACHES27.items()
    for method, speculative in SPEC27_METHODS.items()
    if cache == "bf16" or method in ("none", "ngram")
}
# DFlash2 under CUDA graphs at k = 3 (upstream's drafter alone), 7 and 15, watched by
# upstream's JIT monitor after boot (k = 7 in mode error, the others log each compile).
JIT_RUNS = {
    f"dflash2-jit-k{k}": dict(
        SHARED, mode="graphs", max_model_len=2048, max_num_batched_tokens=1024,
        max_num_seqs=8, drafter="drafter128", jit_monitor_mode=mode,
        speculative=_dflash2(k, **kiln))
    for k, mode, kiln in ((3, "warn", dict(ngram_chains=False)), (7, "error", {}),
                          (15, "warn", {}))
}


MAX_SPEED_CONTEXT = 131072


def speed_shapes(value: str | None = None) -> list[tuple[int, int]]:
    """The speed runs' (batch, context) pairs: 1, 8, 64 x 4K, 16K, or those of
    $KILN_GPU_SPEED_SHAPES ("64x16384 8x4096": each item one pair)."""
    value = os.environ.get("KILN_GPU_SPEED_SHAPES", "") if value is None else value
    if not value.strip():
        return [(b, c) for c in (4096, 16384) for b in (1, 8, 64)]
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in value.split()]
    except ValueError:
        pairs = [()]
    if any(len(pair) != 2 or not 1 <= pair[0] <= 64 or not 1 <= pair[1] <= MAX_SPEED_CONTEXT
           for pair in pairs):
        raise ValueError(f"KILN_GPU_SPEED_SHAPES={value!r}: allowed: BATCHxCONTEXT items, "
                         f"batch 1..64, context 1..{MAX_SPEED_CONTEXT}, e.g. '64x16384 1x4096'")
    return list(dict.fromkeys(pairs))


SPEED_DTYPES_DEFAULT = ("auto", "fp8", "kvarn_k4v2_g128")
SPEED_DTYPES_ALLOWED = ("auto", "fp8", "int8_per_token_head", "int4_per_token_head", *PRESETS)
SPEED_MODELS_ALLOWED = ("large", "hybrid27")


def speed_runs(dtypes: str | None = None, models: str | None = None) -> list[tuple[str, str]]:
    """(model, cache dtype) of each speed run: $KILN_GPU_SPEED_MODELS (default "large")
    x $KILN_GPU_SPEED_DTYPES (default bf16, fp8 and kvarn_k4v2_g128)."""
    dtypes = os.environ.get("KILN_GPU_SPEED_DTYPES", "") if dtypes is None else dtypes
    models = os.environ.get("KILN_GPU_SPEED_MODELS", "") if models is None else models
    chosen_dtypes = dtypes.split() or list(SPEED_DTYPES_DEFAULT)
    chosen_models = models.split() or ["large"]
    for name, chosen, allowed in (("KILN_GPU_SPEED_DTYPES", chosen_dtypes, SPEED_DTYPES_ALLOWED),
                                  ("KILN_GPU_SPEED_MODELS", chosen_models, SPEED_MODELS_ALLOWED)):
        unknown = [c for c in chosen if c not in allowed]
        if unknown:
            raise ValueError(f"{name}: {' '.join(unknown)} not allowed; allowed: "
                             f"{' '.join(allowed)}")
    return [(m, d) for m in chosen_models for d in chosen_dtypes]


def speed_profile_steps(value: str | None = None) -> int:
    """Decode steps the speed runs profile after their table ($KILN_GPU_SPEED_PROFILE;
    0, the default, profiles none): the largest shape under vLLM's torch profiler."""
    value = os.environ.get("KILN_GPU_SPEED_PROFILE", "") if value is None else value
    if not value.strip():
        return 0
    if not value.strip().isdigit() or int(value) > 256:
        raise ValueError(f"KILN_GPU_SPEED_PROFILE={value!r}: allowed: a step count "
                         "0..256 (0 profiles nothing)")
    return int(value)


PROFILE_TOTAL = re.compile(r"^Self (CPU|CUDA) time total: ([0-9.]+)(s|ms|us)$", re.M)


def profiled_time_us(table: str, kind: str = "CUDA") -> float | None:
    """The "Self CUDA (or CPU) time total" at the foot of a torch profiler table, in us;
    None where the table has no such line (no device activity was recorded)."""
    unit = {"s": 1e6, "ms": 1e3, "us": 1.0}
    for found, number, suffix in PROFILE_TOTAL.findall(table):
        if found == kind:
            return float(number) * unit[suffix]
    return None


PROFILE_STEP = re.compile(
    r"^\s*(execute_context_\d+\(\d+\)_generation_\d+\(\d+\))\s.*?(\d+)\s*$", re.M)


def profiled_steps(table: str) -> dict[str, int]:
    """The engine steps a torch profiler table covers, by vLLM's per-step annotation
    ("execute_context_C(tokens)_generation_G(tokens)", its "# of Calls" column)."""
    return {name: int(calls) for name, calls in PROFILE_STEP.findall(table)}


SPEED_SHAPES = speed_shapes()
SPEED_PROFILE_STEPS = speed_profile_steps()
SPEED_RUNS = speed_runs()
# Datasheet HBM bandwidth of the cards the tier runs on: the speed table's roofline.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}


def hbm_bytes_per_s(device_name: str) -> float | None:
    """The roofline bandwidth of a card by its CUDA name (None for a card not listed)."""
    return next((bw for card, bw in HBM_BYTES_PER_S.items() if card in device_name), None)


def kv_bytes_per_token_head(cache_dtype: str, head_dim: int) -> float:
    """K and V bytes of one token and KV head as the cache stores them: KVarN's record
    share (kvarn/preset.py), else the page upstream's Triton backend lays out
    (TritonAttentionBackend.customize_spec: the per-token-head modes' inline scales)."""
    import torch
    from vllm.kvarn import Preset

    if cache_dtype.startswith("kvarn_"):
        return Preset.parse(cache_dtype).bytes_per_token(head_dim)
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    dtype = torch.bfloat16 if cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]
    spec = TritonAttentionBackend.customize_spec(FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=head_dim, dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(cache_dtype)))
    return spec.page_size_bytes / 16


def kv_bytes_per_step(cache_dtype: str, batch: int, context: int, model: str) -> float:
    """Bytes of KV cache one decode step must read on a kiln.testing.tinymodel size: every
    attention layer's keys and values of every request's context."""
    from kiln.testing.tinymodel import attention_layers, preset

    size = preset(model)
    return (kv_bytes_per_token_head(cache_dtype, size.head_dim) * size.num_kv_heads
            * attention_layers(size) * batch * context)

SCENARIOS: dict[str, tuple[str, str, dict]] = {
    **{name: ("spec_decode", "copy128", spec) for name, spec in SPEC_RUNS.items()},
    **{name: ("dflash2_jit", "copy128", spec) for name, spec in JIT_RUNS.items()},
    **{name: ("spec_decode", "copy27", spec) for name, spec in SPEC27_RUNS.items()},
    # Exact parity on the copy models; the random ones give agreement statistics.
    **{f"parity-copy{d}-{m}": ("parity", f"copy{d}", _parity(
        m, copy=True, transformers=m == "eager", lengths=[COPY_PERIOD + 1, 600, 1000],
        max_tokens=48)) for d in (128, 64) for m in ("eager", "graphs", "compile")
        if d == 128 or m != "compile"},
    **{f"parity-d{d}-{m}": ("parity", f"d{d}", _parity(m, transformers=m == "eager"))
       for d in (128, 64) for m in ("eager", "graphs")},
    **{f"kvarn-{p}-{m}": ("kvarn_copy", "copy128", _kvarn_copy(p, m))
       for p in PRESETS for m in ("eager", "graphs")},
    "kvarn-d64-kvarn_k4v4_g64-eager": ("kvarn_copy", "copy64",
                                       _kvarn_copy("kvarn_k4v4_g64", "eager")),
    # 0.34.0's extensible KV cache is on by default on CUDA but off wherever the pool's
    # size is given (every side-by-side run above): this one sizes it by measurement,
    # alone on the GPU, under graphs.
    "kvarn-extensible-graphs": ("kvarn_copy", "copy128", dict(
        kv_cache_dtype="kvarn_k4v2_g128", mode="graphs", max_num_seqs=4,
        max_num_batched_tokens=256, max_model_len=1536, gpu_memory_utilization=0.3,
        exclusive=True)),
    **{f"agree-{dt}": ("agreement", "d128", dict(
        SHARED, kv_cache_memory_bytes=GIB, kv_cache_dtype=dt, max_num_seqs=4,
        max_num_batched_tokens=128, mode="eager"))
       for dt in ("auto", "fp8", *PRESETS)},
    "noise-reference": ("noise_reference", "d128", dict(presets=PRESET_NMSE)),
    **{f"hybrid-{dt}": ("hybrid", "hybrid128", dict(
        SHARED, kv_cache_dtype=dt, mode="eager", max_num_batched_tokens=1024))
       for dt in ("auto", "kvarn_k4v2_g128")},
    # Alone on the GPU (7 GB of weights), under CUDA graphs as users serve; MTP as the
    # deployment runs it (k = 3). KVarN with MTP is refused until it works (issue 27).
    **{f"hybrid27-{name}": ("hybrid", "hybrid27", dict(
        kv_cache_memory_bytes=4 * GIB, gpu_memory_utilization=0.3, mode="graphs",
        max_model_len=4096, max_num_batched_tokens=2048, exclusive=True, **extra))
       for name, extra in (("auto", {}), ("mtp", dict(speculative=dict(
           method="mtp", num_speculative_tokens=3))))},
    # Prefix reuse on the 27B-shaped hybrid's copying variant, alone on the GPU under
    # graphs, chunked prefill of 2048: one conversation of three turns (16K, then 4K
    # new tokens a turn) beside its cold prefills; eight at once in a 1 GiB pool.
    **{f"conv27-{cache}": ("conversation", "copy27", dict(
        kv_cache_dtype=kv, mode="graphs", max_model_len=32768, max_num_batched_tokens=2048,
        kv_cache_memory_bytes=4 * GIB, gpu_memory_utilization=0.35, exclusive=True,
        turns=[16384, 4096, 4096], cold=True)) for cache, kv in CACHES27.items()},
    **{f"crowd27-{cache}": ("conversation", "copy27", dict(
        kv_cache_dtype=kv, mode="graphs", max_model_len=8192, max_num_batched_tokens=2048,
        kv_cache_memory_bytes=GIB, gpu_memory_utilization=0.3, exclusive=True,
        turns=[4000, 1000], conversations=8)) for cache, kv in CACHES27.items()},
    # Every --kiln-profile card=24g combination in a 24 GB card's memory, and upstream's
    # int4 cache beside ctx=huge's with the same speculator (tests/gpu/test_card_budget.py).
    **{f"card24-{ctx}-{spec}{'-pc' if pc else ''}": _card24(
        f"card=24g,ctx={ctx},spec={spec}{',prefix-cache' if pc else ''}", spec)
       for ctx in ("fast", "long", "huge") for spec in CARD_SPECS for pc in (False, True)},
    **{f"card24-int4-{spec}-pc": _card24(f"card=24g,spec={spec},prefix-cache", spec,
                                         args=["--kv-cache-dtype", "int4_per_token_head"])
       for spec in CARD_SPECS},
    "serve-kvarn_k4v2_g128": ("serve", "copy128", dict(kv_cache_dtype="kvarn_k4v2_g128")),
    "profile-huge-ngram": ("profile", "copy128",
                           dict(profile="ctx=huge,spec=ngram,prefix-cache")),
    # As a user serves: prefix caching on (upstream's default), fresh prompts, the
    # cache sized by profiling at 0.85 of the card. TRITON_ATTN for the upstream dtypes:
    # the bundle stands in for FlashAttention with an empty module.
    **{f"speed-{model}-{dt}": ("speed", model, dict(
        kv_cache_dtype=dt, mode="graphs", gpu_memory_utilization=0.85,
        max_model_len=max(c for _, c in SPEED_SHAPES) + 256, shapes=SPEED_SHAPES,
        profile_steps=SPEED_PROFILE_STEPS, exclusive=True))
       for model, dt in SPEED_RUNS},
}
