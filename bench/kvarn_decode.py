"""KVarN decode attention and flush on a GPU, against fp16 paged decode baselines.

    python bench/kvarn_decode.py [--json FILE] [--presets ...] [--head-dims ...] [--no-tune]
    TRITON_INTERPRET=1 python bench/kvarn_decode.py --smoke   # CPU: the code path, no speed

For batch x context in {1x4K, 1x32K, 8x32K, 64x16K, 256x8K}, 8 KV heads, GQA 4 and 8,
every preset, head_dim 128 and 256 (512 on request): kernel time (median, cold L2:
triton's do_bench clears it before every call; single-sequence shapes, whose launch
and combine overheads vary run to run, take the median of --repeats such medians) and
achieved bandwidth = all bytes the kernel must read / time, against the
4.8 TB/s HBM roofline, side by side with a Triton fp16 paged decode
(bench/_fp16_paged_decode.py), torch SDPA (enable_gqa) over contiguous fp16 K/V, and a
plain torch paged reference. Then flush throughput and its cost per decode step.
Targets are reported, not asserted: >= 60% of 4.8 TB/s at batch x context >= 1M tokens,
and <= 0.45x the fp16 kernel's time at 64x16K.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fp16_paged_decode import fp16_paged_decode  # noqa: E402
from kvarn import HEAD_DIMS, PagedKV, Preset  # noqa: E402
from kvarn import reference as ref  # noqa: E402
from kvarn.decode import attend, attend_rotated, default_splits  # noqa: E402
from kvarn.flush import flush  # noqa: E402

HBM_BPS = 4.8e12
PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
SHAPES = [(1, 4096), (1, 32768), (8, 32768), (64, 16384), (256, 8192)]
# --smoke: a few blocks per sequence, so the interpreter runs every path on a CPU.
SMOKE_SHAPES = [(1, 520), (2, 300)]
REFERENCE_SHAPE = (64, 16384)  # the flush cost and the time-ratio target are read here
HEADS = 8
TUNE_FP16 = [(4, 2), (4, 3), (8, 2), (8, 3)]  # (num_warps, num_stages)
# (num_warps, num_stages, maxnreg, tile_tokens, prefetch): the kernel is latency-bound on
# its record loads, so the L2 prefetch distance and the inner sub-tile are the main knobs.
TUNE = [(4, 1, None, 128, 2), (4, 1, None, 64, 2), (4, 1, None, 64, 0), (4, 1, None, 64, 4),
        (4, 1, None, 32, 2), (8, 1, None, 64, 2)]


def bench(fn, repeats: int = 1) -> float:
    """Median milliseconds (of ``repeats`` medians); on a CPU, one wall-clock call."""
    if not torch.cuda.is_available():
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    return statistics.median(
        triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
        for _ in range(repeats))


def kvarn_state(p: Preset, bsz: int, ctx: int, D: int, dev: str):
    """Decode step at seq_len = ctx: every committed full block after the sink flushed."""
    g = p.group
    flushed = (ctx - 1) // g - 1
    tail = -(-ctx // g) - flushed - 1
    n_rec = bsz * flushed
    kv = PagedKV.allocate(p, D, HEADS, n_rec, bsz * (1 + tail), device=dev)
    kv.side.normal_()
    # 64 real tiles per head, replicated: realistic bytes without encoding every block
    pool = ref.encode_tiles(torch.randn(64, HEADS, g, D, device=dev),
                            torch.randn(64, HEADS, g, D, device=dev), p)
    kv.cache.copy_(pool[torch.arange(n_rec, device=dev) % 64])
    perm = torch.randperm(n_rec, device=dev).to(torch.int32)
    bt = torch.zeros(bsz, flushed + tail + 1, dtype=torch.int32, device=dev)
    bt[:, 1:flushed + 1] = perm.view(bsz, flushed)
    st = torch.arange(bsz * (1 + tail), device=dev, dtype=torch.int32).view(bsz, 1 + tail)
    seq = torch.full((bsz,), ctx, dtype=torch.int32, device=dev)
    nf = torch.full((bsz,), flushed, dtype=torch.int32, device=dev)
    read = (n_rec * HEADS * p.tile_bytes(D)  # records
            + bsz * (1 + tail) * 2 * HEADS * g * D * 2  # fp16 sink + tail blocks
            + bt.numel() * 4 + st.numel() * 4)
    return kv, bt, st, seq, nf, read


def run_shape(p: Preset, bsz: int, ctx: int, gqa: int, D: int, tune: bool, dev: str,
              repeats: int) -> dict:
    hq = HEADS * gqa
    kv, bt, st, seq, nf, kv_read = kvarn_state(p, bsz, ctx, D, dev)
    q = torch.randn(bsz, 1, hq, D, device=dev, dtype=torch.float16)
    qo_bytes = 2 * q.numel() * 2
    r = {"preset": p.name, "head_dim": D, "batch": bsz, "context": ctx, "gqa": gqa,
         "tokens": bsz * ctx}
    reps = repeats if bsz == 1 else 1

    splits0 = default_splits(bsz, HEADS, bt.shape[1])
    configs = [(splits0, *TUNE[0])]
    if tune:
        configs = [(s, *c) for s in sorted({splits0, 2 * splits0}) for c in TUNE]
    best = None
    r["kvarn_all_configs"] = []
    for s, w, n, nreg, ts, pf in configs:
        t = bench(lambda: attend_rotated(q, kv, bt, st, seq, nf, num_splits=s, num_warps=w,
                                         num_stages=n, maxnreg=nreg, tile_tokens=ts,
                                         prefetch=pf), reps)
        r["kvarn_all_configs"].append({"splits": s, "num_warps": w, "num_stages": n,
                                       "maxnreg": nreg, "tile_tokens": ts, "prefetch": pf,
                                       "ms": t})
        if best is None or t < best[0]:
            best = (t, s, w, n, nreg, ts, pf)
    t, s, w, n, nreg, ts, pf = best
    r["kvarn_ms"] = t
    r["kvarn_config"] = {"splits": s, "num_warps": w, "num_stages": n, "maxnreg": nreg,
                         "tile_tokens": ts, "prefetch": pf}
    r["kvarn_bytes"] = kv_read + qo_bytes
    r["kvarn_TBps"] = r["kvarn_bytes"] / t / 1e9
    r["kvarn_pct_roofline"] = 100 * r["kvarn_bytes"] / HBM_BPS / (t * 1e-3)
    r["kvarn_with_rotations_ms"] = bench(
        lambda: attend(q, kv, bt, st, seq, nf, num_splits=s, num_warps=w, num_stages=n,
                       maxnreg=nreg, tile_tokens=ts, prefetch=pf), reps)
    del kv

    # fp16 baselines over the same shape
    g = p.group
    nblk = -(-ctx // g)
    cache16 = torch.randn(bsz * nblk, 2, HEADS, g, D, device=dev, dtype=torch.float16)
    bt16 = torch.randperm(bsz * nblk, device=dev).to(torch.int32).view(bsz, nblk)
    q16 = q[:, 0].contiguous()
    fp16_bytes = bsz * ctx * HEADS * D * 2 * 2 + qo_bytes + bt16.numel() * 4
    fs = default_splits(bsz, HEADS, nblk)
    t16 = min(bench(lambda: fp16_paged_decode(q16, cache16, bt16, seq, fs, w16, n16), reps)
              for w16, n16 in (TUNE_FP16 if tune else [(4, 2)]))
    r["fp16_triton_ms"] = t16
    r["fp16_bytes"] = fp16_bytes
    r["fp16_triton_TBps"] = fp16_bytes / t16 / 1e9
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
    err = (got.float() - sdpa()[:, :, 0].float()).abs().max().item()
    r["fp16_triton_vs_sdpa_maxabs"] = err
    del k, v

    def plain():
        kk = cache16[bt16.long(), 0].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, -1, D)
        vv = cache16[bt16.long(), 1].permute(0, 2, 1, 3, 4).reshape(bsz, HEADS, -1, D)
        qq = q16.view(bsz, HEADS, gqa, D).float()
        s_ = torch.einsum("bhgd,bhld->bhgl", qq, kk.float())[..., :ctx] * D ** -0.5
        return torch.einsum("bhgl,bhld->bhgd", s_.softmax(-1), vv[:, :, :ctx].float())

    r["torch_plain_ms"] = bench(plain, reps) if bsz * ctx <= (1 << 20) else None
    r["roofline_kvarn_ms"] = r["kvarn_bytes"] / HBM_BPS * 1e3
    r["roofline_fp16_ms"] = fp16_bytes / HBM_BPS * 1e3
    r["kvarn_over_fp16_triton"] = t / t16
    r["kvarn_over_sdpa"] = t / r["sdpa_ms"]
    del cache16
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    ap.add_argument("--head-dims", nargs="+", type=int, default=[128, 256], choices=HEAD_DIMS)
    ap.add_argument("--gqa", nargs="+", type=int, default=[4, 8])
    ap.add_argument("--repeats", type=int, default=5,
                    help="single-sequence shapes: the median of this many timed medians")
    ap.add_argument("--no-tune", action="store_true", help="default launch config only")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, default config, CPU allowed (TRITON_INTERPRET=1): checks "
                         "that every path runs, times mean nothing")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: allowed: 1 or more")
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench/kvarn_decode.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tune = not (args.no_tune or args.smoke)
    reference = shapes[-1] if args.smoke else REFERENCE_SHAPE
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__,
               "roofline_TBps": HBM_BPS / 1e12, "smoke": args.smoke,
               "decode": [], "flush": []}
    for D in args.head_dims:
        for name in args.presets:
            p = Preset.parse(name)
            for bsz, ctx in shapes:
                for gqa in args.gqa:
                    r = run_shape(p, bsz, ctx, gqa, D, tune, dev, args.repeats)
                    results["decode"].append(r)
                    print(json.dumps(r), flush=True)
            ref_step = next(r for r in results["decode"] if r["preset"] == name
                            and r["head_dim"] == D and (r["batch"], r["context"]) == reference)
            results["flush"].append(run_flush(p, D, dev, ref_step["kvarn_ms"], reference[0],
                                              8 if args.smoke else 512))
    big = [r for r in results["decode"] if r["tokens"] >= (1 << 20)] or results["decode"]
    at_ref = [r for r in results["decode"] if (r["batch"], r["context"]) == reference]
    results["targets"] = {
        "min_pct_roofline_at_1M_tokens": min(r["kvarn_pct_roofline"] for r in big),
        "bandwidth_target_met": all(r["kvarn_pct_roofline"] >= 60 for r in big),
        "max_time_ratio_vs_fp16_at_64x16K": max(r["kvarn_over_fp16_triton"] for r in at_ref),
        "time_ratio_target_met": all(r["kvarn_over_fp16_triton"] <= 0.45 for r in at_ref),
    }
    print(json.dumps(results))
    hdr = (f"{'preset':16} {'D':>3} {'BxL':>9} {'gqa':>3} {'kvarn ms':>9} {'TB/s':>5} "
           f"{'%roof':>5} {'+rot ms':>8} {'fp16trt':>8} {'sdpa':>7} {'torch':>7} "
           f"{'roof ms':>7} {'kv/fp16':>7} cfg")
    print(hdr)
    for r in results["decode"]:
        plain = f"{r['torch_plain_ms']:.3f}" if r["torch_plain_ms"] else "-"
        c = r["kvarn_config"]
        print(f"{r['preset']:16} {r['head_dim']:>3} {r['batch']:>3}x{r['context'] / 1024:>4.1f}K "
              f"{r['gqa']:>3} {r['kvarn_ms']:9.4f} {r['kvarn_TBps']:5.2f} "
              f"{r['kvarn_pct_roofline']:5.1f} {r['kvarn_with_rotations_ms']:8.4f} "
              f"{r['fp16_triton_ms']:8.4f} {r['sdpa_ms']:7.4f} {plain:>7} "
              f"{r['roofline_kvarn_ms']:7.4f} {r['kvarn_over_fp16_triton']:7.3f} "
              f"s{c['splits']}w{c['num_warps']}n{c['num_stages']}r{c['maxnreg'] or '-'}"
              f"t{c['tile_tokens']}p{c['prefetch']}")
    for f in results["flush"]:
        print(f"flush {f['preset']} D={f['head_dim']}: {f['tiles_per_s'] / 1e6:.2f} M tiles/s; "
              f"steady state {f['per_decode_step_ms'] * 1e3:.2f} us per reference step = "
              f"{f['cost_vs_decode_step_pct']:.2f}% of the decode step")
    print("targets:", json.dumps(results["targets"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
