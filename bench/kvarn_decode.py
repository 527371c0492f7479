"""KVarN decode attention and flush on a GPU, against fp16 paged decode baselines.

    python bench/kvarn_decode.py [--json FILE] [--presets ...] [--head-dims ...] [--no-tune]
        [--fa3 DIR/0.33.0]
    python bench/kvarn_decode.py --extract-fa3 DIR   # upstream's FA3, from the pinned wheel
    TRITON_INTERPRET=1 python bench/kvarn_decode.py --smoke   # CPU: the code path, no speed

1. Sweep (unless --no-tune): the Triton decode kernel ("prefetch",
   ``kvarn.decode.VARIANTS``) over a grid of launch configurations (tile tokens, warps,
   pipeline stages, L2 prefetch, programs per SM for the split-K grid) at SWEEP_SHAPES
   (64 x 16K and 1 x 32K), kvarn_k4v2_g128, GQA 4, each head dim; every time is
   recorded, and the best configuration per (variant, head dim) is the one with the
   lowest geometric mean of time / best time over the sweep shapes.
2. Table: batch x context in {1x4K, 1x32K, 8x32K, 64x16K, 256x8K}, 8 KV heads, GQA 4
   (and 8 for the default preset), every preset, head_dim 128 and 256 (512 on request):
   the Triton kernel's time with its best (or default) configuration, the CUDA C++ kernel
   (``kvarn.decode_cuda``, "cuda": the library from $KVARN_CUDA_LIB or next to the
   package; its rows say why when it cannot run, e.g. on a CPU), side by side with a
   Triton fp16 paged decode (bench/_fp16_paged_decode.py), torch SDPA (enable_gqa) over
   contiguous fp16 K/V, a plain torch paged reference, upstream's FlashAttention-3 paged
   decode over the same values in bf16 (vLLM's default bf16 attention on Hopper; with
   --fa3, see bench/_fa3_upstream.py), and the roofline: all bytes the
   kernel must read / 4.8 TB/s. Times are medians of triton's do_bench (L2 cleared before
   every call); single-sequence shapes take the median of --repeats such medians.
3. Flush throughput and its steady-state cost per decode step.
--cuda-sweep (before the table) times the CUDA kernel over split counts at
CUDA_SWEEP_SHAPES (or --shapes), the first preset, every head dim, and records its
default beside the best; --no-table stops after the sweeps.

Targets are reported, not asserted: >= 60% of 4.8 TB/s at batch x context >= 1M tokens,
<= 0.45x the fp16 kernel's time at 64x16K and <= 0.6x at 1x32K. The JSON is rewritten
after every row, so a run stopped by --budget-s (or killed) keeps what it measured.
--prewarm-only compiles the Triton kernel's sweep grid for the planned presets, GQA ratios
and head dims in --workers processes (its binaries do not depend on shapes), so a test
run can overlap the compiles.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _fa3_upstream  # noqa: E402
from _fp16_paged_decode import fp16_paged_decode  # noqa: E402

from kvarn import (  # noqa: E402
    HEAD_DIMS,
    PagedKV,
    Preset,
    decode_cuda,  # noqa: E402
)
from kvarn import reference as ref  # noqa: E402
from kvarn.decode import LAUNCH_DEFAULTS, VARIANTS, attend, attend_rotated, default_splits, launch_config  # noqa: E402
from kvarn.flush import flush  # noqa: E402

HBM_BPS = 4.8e12
PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
SHAPES = [(1, 4096), (1, 32768), (8, 32768), (64, 16384), (256, 8192)]
SWEEP_SHAPES = [(64, 16384), (1, 32768)]
# --smoke: a few blocks per sequence, so the interpreter runs every path on a CPU.
SMOKE_SHAPES = [(1, 520), (2, 300)]
REFERENCE_SHAPE = (64, 16384)  # the flush cost and the time-ratio target are read here
SINGLE_SHAPE = (1, 32768)  # the single-sequence time-ratio target
HEADS = 8
SWEEP_GQA = 4
TUNE_FP16 = [(4, 2), (4, 3), (8, 2), (8, 3)]  # (num_warps, num_stages)
# Launch grids (compiled configurations; each is timed at every programs_per_sm below).
# On sm_90, from ptxas (registers/thread at D=128, k4v2_g128): 234 (2 CTAs of 4 warps
# per SM).
SWEEP_GRID = {
    "prefetch": [
        {"num_warps": 4, "num_stages": 1, "tile_tokens": 128, "prefetch": 2},
        {"num_warps": 4, "num_stages": 3, "tile_tokens": 128, "prefetch": 2},
        {"num_warps": 4, "num_stages": 3, "tile_tokens": 64, "prefetch": 0},
    ],
}
SWEEP_PROGRAMS_PER_SM = [2, 4]
# The CUDA kernel's launch knob: its split-K count (capped by a request's records).
CUDA_SWEEP_SHAPES = [(64, 16384), (256, 8192), (1, 32768), (1, 4096)]
CUDA_SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bench(fn, repeats: int = 1) -> float:
    """Median milliseconds (of ``repeats`` medians); on a CPU, one wall-clock call."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    return statistics.median(
        triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        for _ in range(repeats))


def kvarn_state(p: Preset, bsz: int, ctx: int, D: int, dev: str):
    """Decode step at seq_len = ctx: every committed full block after the sink flushed."""
    g = p.group
    flushed = max(0, (ctx - 1) // g - 1)
    tail = -(-ctx // g) - flushed - 1
    n_rec = max(1, bsz * flushed)
    kv = PagedKV.allocate(p, D, HEADS, n_rec, bsz * (1 + tail), device=dev)
    kv.side.normal_()
    # 64 real tiles per head, replicated: realistic bytes without encoding every block
    pool = ref.encode_tiles(torch.randn(64, HEADS, g, D, device=dev),
                            torch.randn(64, HEADS, g, D, device=dev), p)
    kv.cache.copy_(pool[torch.arange(n_rec, device=dev) % 64])
    perm = torch.randperm(bsz * flushed, device=dev).to(torch.int32)
    bt = torch.zeros(bsz, flushed + tail + 1, dtype=torch.int32, device=dev)
    bt[:, 1:flushed + 1] = perm.view(bsz, flushed)
    st = torch.arange(bsz * (1 + tail), device=dev, dtype=torch.int32).view(bsz, 1 + tail)
    seq = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
    nf = torch.full((bsz,), flushed, dtype=torch.int32, device=dev)
    read = (bsz * flushed * HEADS * p.tile_bytes(D)  # records
            + bsz * (1 + tail) * 2 * HEADS * g * D * 2  # fp16 sink + tail blocks
            + bt.numel() * 4 + st.numel() * 4)
    return kv, bt, st, seq, nf, read


def cfg_label(cfg: dict) -> str:
    short = {"num_warps": "w", "num_stages": "n", "tile_tokens": "t", "prefetch": "p",
             "maxnreg": "r", "programs_per_sm": "s", "flat": "f"}
    return "".join(f"{short[k]}{int(v) if isinstance(v, bool) else v}"
                   for k, v in sorted(cfg.items()) if v is not None and k in short)


class Run:
    """Results, rewritten to --json after every row; a time budget for optional work."""

    def __init__(self, args, dev: str):
        self.args, self.dev = args, dev
        self.started = time.monotonic()
        self.results = {
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "roofline_TBps": HBM_BPS / 1e12, "smoke": args.smoke, "variants": list(VARIANTS),
            "launch_defaults": LAUNCH_DEFAULTS, "sweep": [], "best_config": {},
            "cuda_library": str(decode_cuda.library_path()),
            "cuda_unavailable": decode_cuda.unavailable_reason(),
            "cuda_sweep": [], "cuda_best": [], "decode": [], "flush": [], "truncated": False}
        self.fa3 = _fa3_upstream.load(args.fa3)
        self.results["fa3_unavailable"] = self.fa3 if isinstance(self.fa3, str) else None

    def over_budget(self) -> bool:
        if self.args.budget_s and time.monotonic() - self.started > self.args.budget_s:
            self.results["truncated"] = True
            return True
        return False

    def save(self) -> None:
        self.results["elapsed_s"] = time.monotonic() - self.started
        if self.args.json:
            tmp = self.args.json + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(self.results, fh, indent=1)
            os.replace(tmp, self.args.json)


def kvarn_ms(variant: str, cfg: dict, state, q, reps: int) -> tuple[float, int]:
    kv, bt, st, seq, nf, _ = state
    splits = default_splits(q.shape[0], HEADS, bt.shape[1],
                            launch_config(variant, kv.head_dim, **cfg)["programs_per_sm"])
    t = bench(lambda: attend_rotated(q, kv, bt, st, seq, nf, num_splits=splits,
                                     variant=variant, **cfg), reps)
    return t, splits


def cuda_ms(state, q, reps: int, triton_out) -> dict:
    """The CUDA kernel at its default split count, timed like the Triton kernel, and
    its largest difference from the Triton output on the same cache (a sanity check)."""
    kv, bt, st, seq, nf, _ = state
    why = decode_cuda.unavailable_reason()
    rows = q.shape[1] * q.shape[2] // HEADS
    if why is None and not decode_cuda.supports(kv.preset, kv.head_dim, rows):
        why = f"no CUDA instance for {kv.preset.name}, D={kv.head_dim}, {rows} rows"
    if why is not None:
        return {"ms": None, "skipped": why}
    splits = decode_cuda.default_splits(q.shape[0], HEADS, bt.shape[1])
    fn = lambda: decode_cuda.attend_rotated_cuda(q, kv, bt, st, seq, nf, num_splits=splits)
    try:  # a failing launch is recorded in the row; the Triton columns still come out
        diff = (fn() - triton_out()).abs().max().item()
        return {"ms": bench(fn, reps), "splits": splits, "vs_triton_maxabs": diff}
    except RuntimeError as exc:
        return {"ms": None, "skipped": f"{type(exc).__name__}: {str(exc)[:300]}"}


def cuda_sweep(run: Run, D: int, shapes, preset: str) -> None:
    """The CUDA kernel at every split count of the grid at each shape; each shape's
    default and best go to results["cuda_best"]."""
    p = Preset.parse(preset)
    why = decode_cuda.unavailable_reason()
    if why is None and not decode_cuda.supports(p, D, SWEEP_GQA):
        why = f"no CUDA instance for {p.name}, D={D}"
    if why is not None:
        run.results["cuda_best"].append({"preset": p.name, "head_dim": D, "skipped": why})
        return
    for bsz, ctx in shapes:
        if run.over_budget():
            break
        state = kvarn_state(p, bsz, ctx, D, run.dev)
        kv, bt, st, seq, nf, read = state
        q = torch.randn(bsz, 1, HEADS * SWEEP_GQA, D, device=run.dev, dtype=torch.float16)
        nbytes = read + 2 * q.numel() * 2
        reps = run.args.repeats if bsz == 1 else 1
        records = max(1, int(nf.max()))
        default = decode_cuda.default_splits(bsz, HEADS, bt.shape[1])
        rows = []
        for splits in sorted({*(s_ for s_ in CUDA_SWEEP_SPLITS if s_ <= records), default}):
            t = bench(lambda: decode_cuda.attend_rotated_cuda(
                q, kv, bt, st, seq, nf, num_splits=splits), reps)
            row = {"preset": p.name, "head_dim": D, "batch": bsz, "context": ctx,
                   "splits": splits, "ms": t, "pct_roofline": 100 * nbytes / HBM_BPS / (t * 1e-3),
                   "default": splits == default}
            rows.append(row)
            run.results["cuda_sweep"].append(row)
        best = min(rows, key=lambda r: r["ms"])
        dflt = next(r for r in rows if r["default"])
        summary = {"preset": p.name, "head_dim": D, "batch": bsz, "context": ctx,
                   "default": {k: dflt[k] for k in ("splits", "ms", "pct_roofline")},
                   "best": {k: best[k] for k in ("splits", "ms", "pct_roofline")},
                   "roofline_ms": nbytes / HBM_BPS * 1e3}
        run.results["cuda_best"].append(summary)
        print(json.dumps(summary), flush=True)
        del state, kv
        run.save()


def sweep(run: Run, D: int, shapes=SWEEP_SHAPES, grid=SWEEP_GRID,
          programs_per_sm=SWEEP_PROGRAMS_PER_SM, preset: str = PRESETS[0]) -> None:
    """Phase 1 at shapes: every configuration of every variant; picks the best."""
    p = Preset.parse(preset)
    times: dict[tuple[str, str], dict] = {}
    for bsz, ctx in shapes:
        state = kvarn_state(p, bsz, ctx, D, run.dev)
        q = torch.randn(bsz, 1, HEADS * SWEEP_GQA, D, device=run.dev, dtype=torch.float16)
        reps = run.args.repeats if bsz == 1 else 1
        for variant in VARIANTS:
            for base, pps in itertools.product(grid[variant], programs_per_sm):
                cfg = {**base, "programs_per_sm": pps}
                try:
                    t, splits = kvarn_ms(variant, cfg, state, q, reps)
                except Exception as exc:  # a config that does not compile here is recorded
                    t, splits = None, None
                    err = f"{type(exc).__name__}: {str(exc)[:200]}"
                else:
                    err = None
                row = {"variant": variant, "head_dim": D, "batch": bsz, "context": ctx,
                       "gqa": SWEEP_GQA, "config": cfg, "label": cfg_label(cfg),
                       "splits": splits, "ms": t, "error": err,
                       "pct_roofline": None if t is None else
                       100 * state[5] / HBM_BPS / (t * 1e-3)}
                run.results["sweep"].append(row)
                times.setdefault((variant, cfg_label(cfg)), {"cfg": cfg})[(bsz, ctx)] = t
                print(json.dumps(row), flush=True)
        del state
        run.save()
    for variant in VARIANTS:
        cands = [v for (var, _), v in times.items() if var == variant
                 and all(v.get(s) for s in shapes)]
        if not cands:
            continue
        best_at = {s: min(c[s] for c in cands) for s in shapes}
        score = lambda c: math.exp(sum(math.log(c[s] / best_at[s]) for s in shapes)
                                   / len(shapes))
        best = min(cands, key=score)
        run.results["best_config"][f"{variant}/{D}"] = {
            "config": best["cfg"], "label": cfg_label(best["cfg"]),
            "geomean_vs_best": score(best),
            "ms": {f"{b}x{c}": best[(b, c)] for b, c in shapes},
            "best_ms_per_shape": {f"{b}x{c}": best_at[(b, c)] for b, c in shapes}}
    # which variant kvarn.decode should default to at this head dim, and with what
    geo = {v: math.exp(sum(math.log(t) for t in b["ms"].values()) / len(b["ms"]))
           for v in VARIANTS if (b := run.results["best_config"].get(f"{v}/{D}"))}
    if geo:
        win = min(geo, key=geo.get)
        run.results.setdefault("suggested_defaults", {})[str(D)] = {
            "variant": win, "launch": run.results["best_config"][f"{win}/{D}"]["config"],
            "geomean_ms": geo}
    run.save()


def fp16_baseline(r: dict, q, bsz: int, ctx: int, gqa: int, D: int, g: int, tune: bool,
                  dev: str, reps: int, fa3) -> None:
    nblk = -(-ctx // g)
    cache16 = torch.randn(bsz * nblk, 2, HEADS, g, D, device=dev, dtype=torch.float16)
    bt16 = torch.randperm(bsz * nblk, device=dev).to(torch.int32).view(bsz, nblk)
    seq = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
    q16 = q[:, 0].contiguous()
    qo_bytes = 2 * q.numel() * 2
    fp16_bytes = bsz * ctx * HEADS * D * 2 * 2 + qo_bytes + bt16.numel() * 4
    fs = default_splits(bsz, HEADS, nblk)
    tuned = tune and (bsz, ctx) in SWEEP_SHAPES
    t16 = min(bench(lambda: fp16_paged_decode(q16, cache16, bt16, seq, fs, w16, n16), reps)
              for w16, n16 in (TUNE_FP16 if tuned else [(4, 2)]))
    r.update(fp16_triton_ms=t16, fp16_triton_tuned=tuned, fp16_bytes=fp16_bytes,
             fp16_triton_TBps=fp16_bytes / t16 / 1e9)
    # contiguous K/V for SDPA, and a plain torch paged reference (gather, then attend)
    k = cache16[bt16.long(), 0].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, nblk * g, D)
    v = cache16[bt16.long(), 1].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, nblk * g, D)
    k, v = k[:, :, :ctx].contiguous(), v[:, :, :ctx].contiguous()
    qs = q16[:, :, None, :]
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
    r["sdpa_ms"] = bench(sdpa, reps)
    r["sdpa_TBps"] = fp16_bytes / r["sdpa_ms"] / 1e9
    # the Triton baseline must compute what SDPA computes
    got = fp16_paged_decode(q16, cache16, bt16, seq, fs)
    want = sdpa()[:, :, 0]
    r["fp16_triton_vs_sdpa_maxabs"] = (got.float() - want.float()).abs().max().item()
    del k, v
    fa3_baseline(r, fa3, q16, cache16, bt16, seq, ctx, D, want, reps)

    def plain():
        kk = cache16[bt16.long(), 0].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, -1, D)
        vv = cache16[bt16.long(), 1].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, -1, D)
        qq = q16.view(bsz, HEADS, gqa, D).float()
        s_ = torch.einsum("bhgd,bhld->bhgl", qq, kk.float())[..., :ctx] * D ** -0.5
        return torch.einsum("bhgl,bhld->bhgd", s_.softmax(-1), vv[:, :, :ctx].float())

    r["torch_plain_ms"] = bench(plain, reps) if bsz * ctx <= (1 << 20) else None
    r["roofline_fp16_ms"] = fp16_bytes / HBM_BPS * 1e3


def fa3_baseline(r: dict, fa3, q16, cache16, bt16, seq, ctx: int, D: int, sdpa_out,
                 reps: int) -> None:
    """FA3 over the fp16 baseline's values in bf16 (pages of G tokens, NHD), or why not;
    its largest difference from SDPA's fp16 output says it computed the same attention."""
    if isinstance(fa3, str):
        r.update(fa3_ms=None, fa3_skipped=fa3)
        return
    k = cache16[:, 0].transpose(1, 2).to(torch.bfloat16).contiguous()  # [N, G, H, D]
    v = cache16[:, 1].transpose(1, 2).to(torch.bfloat16).contiguous()
    qb = q16.to(torch.bfloat16)
    out = torch.empty_like(qb)
    cu_q = torch.arange(qb.shape[0] + 1, dtype=torch.int32, device=qb.device)
    fn = lambda: fa3.paged_decode(qb, k, v, bt16, seq, ctx, D ** -0.5, out, cu_q)
    try:  # a failing launch is recorded in the row; the other columns still come out
        got = fn()
        r["fa3_vs_sdpa_maxabs"] = (got.float() - sdpa_out.float()).abs().max().item()
        r["fa3_ms"] = bench(fn, reps)
        r["fa3_TBps"] = r["fp16_bytes"] / r["fa3_ms"] / 1e9
    except RuntimeError as exc:
        r.update(fa3_ms=None, fa3_skipped=f"{type(exc).__name__}: {str(exc)[:300]}")


def table_row(run: Run, p: Preset, bsz: int, ctx: int, gqa: int, D: int) -> dict:
    args, dev = run.args, run.dev
    state = kvarn_state(p, bsz, ctx, D, dev)
    q = torch.randn(bsz, 1, HEADS * gqa, D, device=dev, dtype=torch.float16)
    reps = args.repeats if bsz == 1 else 1
    r = {"preset": p.name, "head_dim": D, "batch": bsz, "context": ctx, "gqa": gqa,
         "tokens": bsz * ctx, "variants": {}}
    for variant in VARIANTS:
        best = run.results["best_config"].get(f"{variant}/{D}")
        cfg = dict(best["config"]) if best else {}
        t, splits = kvarn_ms(variant, cfg, state, q, reps)
        r["variants"][variant] = {"ms": t, "config": cfg, "label": cfg_label(cfg) or "default",
                                  "splits": splits, "tuned": bool(best)}
    old = r["variants"]["prefetch"]
    if launch_config("prefetch", D, **old["config"]) != launch_config("prefetch", D):
        # the old kernel as it ships today, for the old-vs-new column
        r["prefetch_default_ms"] = kvarn_ms("prefetch", {}, state, q, reps)[0]
    else:
        r["prefetch_default_ms"] = old["ms"]
    fastest = min(r["variants"], key=lambda v: r["variants"][v]["ms"])
    t = r["variants"][fastest]["ms"]
    cfg = r["variants"][fastest]["config"]
    qo_bytes = 2 * q.numel() * 2
    r.update(kvarn_variant=fastest, kvarn_ms=t, kvarn_config=cfg,
             kvarn_bytes=state[5] + qo_bytes)
    r["kvarn_TBps"] = r["kvarn_bytes"] / t / 1e9
    r["kvarn_pct_roofline"] = 100 * r["kvarn_bytes"] / HBM_BPS / (t * 1e-3)
    kv, bt, st, seq, nf, _ = state
    splits = r["variants"][fastest]["splits"]
    r["cuda"] = cuda_ms(state, q, reps, lambda: attend_rotated(
        q, kv, bt, st, seq, nf, num_splits=splits, variant=fastest, **cfg))
    r["kvarn_with_rotations_ms"] = bench(
        lambda: attend(q, kv, bt, st, seq, nf, num_splits=splits, variant=fastest, **cfg), reps)
    del state, kv
    fp16_baseline(r, q, bsz, ctx, gqa, D, p.group, not (args.no_tune or args.smoke), dev, reps,
                  run.fa3)
    r["roofline_kvarn_ms"] = r["kvarn_bytes"] / HBM_BPS * 1e3
    r["kvarn_over_fp16_triton"] = t / r["fp16_triton_ms"]
    r["kvarn_over_sdpa"] = t / r["sdpa_ms"]
    for v in [*r["variants"].values()] + ([r["cuda"]] if r["cuda"]["ms"] else []):
        v["over_fp16_triton"] = v["ms"] / r["fp16_triton_ms"]
        v["pct_roofline"] = 100 * r["kvarn_bytes"] / HBM_BPS / (v["ms"] * 1e-3)
        v["TBps"] = r["kvarn_bytes"] / v["ms"] / 1e9
        v["over_fa3"] = v["ms"] / r["fa3_ms"] if r["fa3_ms"] else None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return r


def run_flush(p: Preset, D: int, dev: str, decode_ms: float, bsz: int, n_blocks: int) -> dict:
    kv = PagedKV.allocate(p, D, HEADS, n_blocks, n_blocks, device=dev)
    kv.side.normal_()
    ids = torch.arange(n_blocks, device=dev)
    t = bench(lambda: flush(kv, ids, ids))
    tiles = n_blocks * HEADS
    per_s = tiles / (t * 1e-3)
    # steady state: each request adds one token per step, so B*H/G tiles per step
    per_step_ms = bsz * HEADS / p.group / per_s * 1e3
    return {"preset": p.name, "head_dim": D, "tiles": tiles, "ms": t, "tiles_per_s": per_s,
            "per_decode_step_ms": per_step_ms, "decode_step_ms": decode_ms,
            "cost_vs_decode_step_pct": 100 * per_step_ms / decode_ms}


def _prewarm_one(task) -> str:
    """Compile one configuration by running it on a tiny state (the binary does not
    depend on shapes: the kernels' runtime ints are not value-specialized)."""
    variant, name, D, gqa, cfg = task
    p = Preset.parse(name)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    kv, bt, st, seq, nf, _ = kvarn_state(p, 1, 4 * p.group + 3, D, dev)
    q = torch.randn(1, 1, HEADS * gqa, D, device=dev, dtype=torch.float16)
    try:
        attend_rotated(q, kv, bt, st, seq, nf, num_splits=1, variant=variant, **cfg)
        if dev == "cuda":
            torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def prewarm(args) -> None:
    import multiprocessing as mp
    tasks = [(variant, name, D, gqa, cfg)
             for D in args.head_dims
             for name, gqa in plan_combos(args)
             for variant in VARIANTS
             for cfg in SWEEP_GRID[variant]]
    started = time.monotonic()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        done = pool.map(_prewarm_one, tasks, chunksize=1)
    bad = [(t[:4], d) for t, d in zip(tasks, done) if d != "ok"]
    print(json.dumps({"prewarm_tasks": len(tasks), "failed": bad,
                      "seconds": time.monotonic() - started}), flush=True)


def plan_combos(args) -> list[tuple[str, int]]:
    """(preset, gqa) pairs of the table: every GQA for the default preset, the first
    for the others (compiles are per GQA ratio; the format's cost is not)."""
    return [(name, gqa) for name in args.presets
            for gqa in (args.gqa if name == PRESETS[0] else args.gqa[:1])]


def print_table(results: dict) -> None:
    for c in results["cuda_best"]:
        if "skipped" in c:
            print(f"cuda sweep {c['preset']} D={c['head_dim']}: skipped: {c['skipped']}")
            continue
        d, b = c["default"], c["best"]
        print(f"cuda sweep {c['preset']} D={c['head_dim']} {c['batch']}x{c['context']}: "
              f"default splits {d['splits']} {d['ms']:.4f} ms ({d['pct_roofline']:.1f}%), "
              f"best splits {b['splits']} {b['ms']:.4f} ms ({b['pct_roofline']:.1f}%), "
              f"roofline {c['roofline_ms']:.4f} ms")
    if results["best_config"]:
        print("best configurations (sweep at " + ", ".join(f"{b}x{c}" for b, c in SWEEP_SHAPES)
              + f", {PRESETS[0]}, GQA {SWEEP_GQA}):")
        for key, b in results["best_config"].items():
            print(f"  {key:14} {b['label']:16} ms {json.dumps(b['ms'])} "
                  f"(best per shape {json.dumps(b['best_ms_per_shape'])})")
    for D, sug in results.get("suggested_defaults", {}).items():
        print(f"suggested for kvarn.decode at D={D}: variant {sug['variant']!r}, "
              f"LAUNCH_DEFAULTS_BY_HEAD_DIM[({sug['variant']!r}, {D})] = {sug['launch']}")
    if results["decode"]:
        print(f"{'preset':16} {'D':>3} {'BxL':>9} {'gqa':>3} {'kvarn ms':>9} {'TB/s':>5} "
              f"{'%roof':>5} {'prefetch':>9} {'cuda':>9} {'%roof':>5} "
              f"{'cu/fp16':>7} {'cu/fa3':>6} {'old dflt':>9} {'+rot ms':>8} "
              f"{'fp16trt':>8} {'sdpa':>7} {'fa3':>7} {'torch':>7} {'roof ms':>7} "
              f"{'kv/fp16':>7} best")
    for r in results["decode"]:
        plain = f"{r['torch_plain_ms']:.3f}" if r["torch_plain_ms"] else "-"
        var = r["variants"]
        old = r.get("prefetch_default_ms")
        cu = r.get("cuda", {})
        cu_cols = (f"{cu['ms']:9.4f} {cu['pct_roofline']:5.1f} {cu['over_fp16_triton']:7.3f}"
                   if cu.get("ms") else f"{'-':>9} {'-':>5} {'-':>7}")
        cu_fa3 = f"{cu['over_fa3']:6.3f}" if cu.get("over_fa3") else f"{'-':>6}"
        fa3 = f"{r['fa3_ms']:7.4f}" if r.get("fa3_ms") else f"{'-':>7}"
        print(f"{r['preset']:16} {r['head_dim']:>3} {r['batch']:>3}x{r['context'] / 1024:>4.1f}K "
              f"{r['gqa']:>3} {r['kvarn_ms']:9.4f} {r['kvarn_TBps']:5.2f} "
              f"{r['kvarn_pct_roofline']:5.1f} {var['prefetch']['ms']:9.4f} "
              f"{cu_cols} {cu_fa3} "
              f"{old if old is None else round(old, 4)!s:>9} "
              f"{r['kvarn_with_rotations_ms']:8.4f} {r['fp16_triton_ms']:8.4f} "
              f"{r['sdpa_ms']:7.4f} {fa3} {plain:>7} {r['roofline_kvarn_ms']:7.4f} "
              f"{r['kvarn_over_fp16_triton']:7.3f} {r['kvarn_variant']}:"
              f"{var[r['kvarn_variant']]['label']}")
    for f in results["flush"]:
        print(f"flush {f['preset']} D={f['head_dim']}: {f['tiles_per_s'] / 1e6:.2f} M tiles/s; "
              f"steady state {f['per_decode_step_ms'] * 1e3:.2f} us per reference step = "
              f"{f['cost_vs_decode_step_pct']:.2f}% of the decode step")
    skipped = {r["cuda"]["skipped"] for r in results["decode"] if r.get("cuda", {}).get("skipped")}
    for why in sorted(skipped):
        print(f"cuda rows skipped: {why}")
    for why in sorted({r["fa3_skipped"] for r in results["decode"] if r.get("fa3_skipped")}):
        print(f"fa3 column skipped: {why}")
    print("targets:", json.dumps(results.get("targets", {})))
    if results["truncated"]:
        print("truncated: the --budget-s ran out before every row was measured")


def targets(results: dict, reference, single) -> dict:
    rows = results["decode"]
    out = {}
    for D in sorted({r["head_dim"] for r in rows}):
        mine = [r for r in rows if r["head_dim"] == D]
        big = [r for r in mine if r["tokens"] >= (1 << 20)]
        at_ref = [r for r in mine if (r["batch"], r["context"]) == reference]
        at_single = [r for r in mine if (r["batch"], r["context"]) == single]
        t = {}
        if big:
            t["min_pct_roofline_at_1M_tokens"] = min(r["kvarn_pct_roofline"] for r in big)
            t["bandwidth_target_met"] = all(r["kvarn_pct_roofline"] >= 60 for r in big)
        if at_ref:
            t["max_time_ratio_vs_fp16_at_64x16K"] = max(r["kvarn_over_fp16_triton"]
                                                        for r in at_ref)
            t["time_ratio_64x16K_target_met"] = all(r["kvarn_over_fp16_triton"] <= 0.45
                                                    for r in at_ref)
        if at_single:
            t["max_time_ratio_vs_fp16_at_1x32K"] = max(r["kvarn_over_fp16_triton"]
                                                       for r in at_single)
            t["time_ratio_1x32K_target_met"] = all(r["kvarn_over_fp16_triton"] <= 0.6
                                                   for r in at_single)
        cu = [r for r in mine if r.get("cuda", {}).get("ms")]
        cu_big = [r for r in cu if r["tokens"] >= (1 << 20)]
        if cu_big:
            t["cuda_min_pct_roofline_at_1M_tokens"] = min(r["cuda"]["pct_roofline"]
                                                          for r in cu_big)
            t["cuda_bandwidth_target_met"] = all(r["cuda"]["pct_roofline"] >= 60 for r in cu_big)
        for shape, key, bound in ((reference, "64x16K", 0.45), (single, "1x32K", 0.6)):
            at = [r for r in cu if (r["batch"], r["context"]) == shape]
            if at:
                worst = max(r["cuda"]["over_fp16_triton"] for r in at)
                t[f"cuda_max_time_ratio_vs_fp16_at_{key}"] = worst
                t[f"cuda_time_ratio_{key}_target_met"] = worst <= bound
                if all(r["cuda"].get("over_fa3") for r in at):
                    worst = max(r["cuda"]["over_fa3"] for r in at)
                    t[f"cuda_max_time_ratio_vs_fa3_at_{key}"] = worst
                    t[f"cuda_time_ratio_vs_fa3_{key}_target_met"] = worst <= bound
        out[f"D{D}"] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here (rewritten after every row)")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128, 256], choices=HEAD_DIMS)
    ap.add_argument("--gqa", nargs="+", type=int, default=[4, 8],
                    help="GQA ratios of the table (the first only, for non-default presets)")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="BxL",
                    help="table shapes, e.g. 64x16384 (default: " +
                         " ".join(f"{b}x{c}" for b, c in SHAPES) + ")")
    ap.add_argument("--repeats", type=int, default=5,
                    help="single-sequence shapes: the median of this many timed medians")
    ap.add_argument("--no-tune", action="store_true",
                    help="no sweep: every variant at its launch defaults; fp16 untuned")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="stop adding table rows and flush runs after this many seconds")
    ap.add_argument("--cuda-sweep", action="store_true",
                    help="first time the CUDA kernel over split counts at --shapes (default: " +
                         " ".join(f"{b}x{c}" for b, c in CUDA_SWEEP_SHAPES) + ")")
    ap.add_argument("--no-table", action="store_true",
                    help="stop after the sweeps (no table, no flush)")
    ap.add_argument("--prewarm-only", action="store_true",
                    help="only compile the kernels' sweep grids, in --workers processes")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--fa3", metavar="DIR", default=None,
                    help="time upstream's FA3 paged decode from this --extract-fa3 folder "
                         "(DIR/0.33.0); on sm_90 only")
    ap.add_argument("--extract-fa3", metavar="DIR", default=None,
                    help="only write DIR/0.33.0: FA3 out of the pinned upstream wheel "
                         "(downloaded into kiln's cache when missing), xz-compressed")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, default config, CPU allowed (TRITON_INTERPRET=1): checks "
                         "that every path runs, times mean nothing")
    ap.add_argument("--smoke-sweep", action="store_true",
                    help="with --smoke: also a sweep of two configurations per variant at the "
                         "tiny shapes (the sweep's code path)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: allowed: 1 or more")
    if args.workers < 1:
        ap.error(f"--workers {args.workers}: allowed: 1 or more")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        try:
            shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
            assert all(len(s) == 2 and min(s) >= 1 for s in shapes)
        except (ValueError, AssertionError):
            ap.error(f"--shapes {' '.join(args.shapes)}: allowed: BATCHxCONTEXT, e.g. 64x16384")
    if args.extract_fa3:
        _fa3_upstream.extract(Path(args.extract_fa3))
        return
    if args.prewarm_only:
        prewarm(args)
        return
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench/kvarn_decode.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tune = not (args.no_tune or args.smoke)
    reference = shapes[-1] if args.smoke else REFERENCE_SHAPE
    single = shapes[0] if args.smoke else SINGLE_SHAPE
    torch.manual_seed(0)
    run = Run(args, dev)
    if tune:
        for D in args.head_dims:
            sweep(run, D)
    elif args.smoke and args.smoke_sweep:
        for D in args.head_dims:
            sweep(run, D, shapes, {v: g[:2] for v, g in SWEEP_GRID.items()}, [2],
                  args.presets[0])
    if args.cuda_sweep:
        sweep_shapes = shapes if args.shapes or args.smoke else CUDA_SWEEP_SHAPES
        for D in args.head_dims:
            cuda_sweep(run, D, sweep_shapes, args.presets[0])
    if args.no_table:
        run.save()
        print_table(run.results)
        return
    ref_ms = {}
    # Most wanted rows first, so a --budget-s cut loses the least: the default preset at
    # the first GQA ratio and the target shapes, every head dim, then the rest.
    first = [s for s in (reference, single) if s in shapes]
    order = sorted(shapes, key=lambda s: (s not in first, first.index(s) if s in first else 0))
    for (name, gqa), D in itertools.product(plan_combos(args), args.head_dims):
        p = Preset.parse(name)
        for bsz, ctx in order:
            if run.over_budget():
                break
            r = table_row(run, p, bsz, ctx, gqa, D)
            run.results["decode"].append(r)
            if (bsz, ctx) == reference:
                ref_ms.setdefault((name, D), r["kvarn_ms"])
            print(json.dumps(r), flush=True)
            run.save()
    for (name, D), ms in ref_ms.items():
        if run.over_budget():
            break
        run.results["flush"].append(run_flush(Preset.parse(name), D, dev, ms, reference[0],
                                              8 if args.smoke else 512))
        run.save()
    run.results["targets"] = targets(run.results, reference, single)
    run.save()
    print(json.dumps(run.results))
    print_table(run.results)


if __name__ == "__main__":
    main()
