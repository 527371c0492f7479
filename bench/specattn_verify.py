"""Speculative verify attention: the fork's split-KV kernel (specattn) against upstream's
Triton paths on the same paged caches.

    python bench/specattn_verify.py [--json FILE] [--upstream-033 DIR] [--dtypes ...] ...
    python bench/specattn_verify.py --extract-upstream build/upstream-ops
    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python bench/specattn_verify.py --smoke

For each cache dtype, geometry (head size x KV heads x GQA), batch x context (16K, 64K)
and query tokens per request (2-16), the same q, paged cache (upstream's TRITON_ATTN
layout, block size 16) and block table go to:

* ``fork``: ``specattn.verify_attention``, split into 16 segments when the batch is
  small enough for upstream's split path (requests <= 128 / KV heads), as the
  spec-decode-attn topic launches it;
* ``up032_2d``: the installed vLLM's ``unified_attention`` without the split scratch,
  so on its 2D path, the one vLLM 0.32.0 takes for every multi-token batch (needs vLLM
  importable; on a 0.33.0 fork wheel this is 0.33.0's 2D kernel);
* ``up033_3d``: vLLM 0.33.0's ``unified_attention`` with the split scratch, whose 3D
  path takes causal batches of up to 8 query tokens (not int4); loaded from the pristine
  0.33.0 sdist's ``triton_unified_attention.py`` and ``triton_attention_helpers.py``,
  which ``--extract-upstream DIR`` copies out of kiln's sha256-checked cache into
  ``DIR/0.33.0/`` (a git-ignored folder: build/ is ignored) and ``--upstream-033
  DIR/0.33.0`` reads.

Times are medians of ``triton.testing.do_bench_cudagraph`` (each call replayed from a
CUDA graph, as the serving engine runs verify batches), ``do_bench`` where a capture
fails; ratios are upstream time / fork time (> 1: the fork is faster). Nothing is
asserted about speed. --smoke runs tiny fp16 shapes on a CPU under the interpreter.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specattn import CACHE_DTYPES, Mode, PagedCache, verify_attention  # noqa: E402

HBM_BPS = 4.8e12
PAGE = 16
SEGMENTS = 16
MIN_GRID = 128  # upstream's MIN_LAUNCH_GRID_SIZE_2D: requests <= 128 / KV heads split
UPSTREAM_OPS = ("triton_unified_attention.py", "triton_attention_helpers.py")
DTYPES = ("bfloat16", "float16", "fp8", "int8_per_token_head", "fp8_per_token_head",
          "int4_per_token_head")
GEOMETRIES = {"d128_kv8_gqa4": (128, 8, 4), "d256_kv4_gqa6": (256, 4, 6)}
SMOKE_GEOMETRIES = {"d64_kv2_gqa4": (64, 2, 4)}
DEFAULT_DTYPES = ["bfloat16", "fp8", "int8_per_token_head", "int4_per_token_head"]
DEFAULT_PAIRS = ([(t, "d128_kv8_gqa4") for t in DEFAULT_DTYPES]
                 + [("bfloat16", "d256_kv4_gqa6"), ("int4_per_token_head", "d256_kv4_gqa6")])


# --------------------------------------------------------------------------- upstream


def extract_upstream(folder: Path, version: str = "0.33.0") -> Path:
    """Copy upstream's Triton attention op files out of the pinned, sha256-checked sdist
    (kiln's cache; downloaded if missing) into folder/version/."""
    import tarfile

    from kiln.upstream.fetch import download_from_index, fetch_pinned
    from kiln.upstream.lock import UpstreamLock

    release = UpstreamLock.load().release(version)
    sdist = fetch_pinned(release.sdist, lambda d: download_from_index(release.sdist, d), print)
    out = folder / version
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        for name in UPSTREAM_OPS:
            member = tar.getmember(f"vllm-{version}/vllm/v1/attention/ops/{name}")
            (out / name).write_bytes(tar.extractfile(member).read())
    return out


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_upstream_033(folder: Path):
    """0.33.0's unified_attention module, over 0.33.0's helpers (the installed 0.32.0
    vllm supplies the rest it imports: envs, logger, platforms, KVQuantMode)."""
    missing = [n for n in UPSTREAM_OPS if not (folder / n).is_file()]
    if missing:
        raise SystemExit(f"--upstream-033 {folder}: missing {', '.join(missing)}; make them "
                         "with --extract-upstream DIR (then pass DIR/0.33.0)")
    helpers_name = "vllm.v1.attention.ops.triton_attention_helpers"
    import vllm.v1.attention.ops.triton_attention_helpers as installed

    helpers = _load("kiln_upstream_033.triton_attention_helpers",
                    folder / "triton_attention_helpers.py")
    sys.modules[helpers_name] = helpers  # what 0.33.0's module imports at its import
    try:
        return _load("kiln_upstream_033.triton_unified_attention",
                     folder / "triton_unified_attention.py")
    finally:
        sys.modules[helpers_name] = installed


# --------------------------------------------------------------------------- caches


def make_cache(kv_cache_dtype: str, num_blocks: int, kv_heads: int, d: int, dev: str,
               model_dtype: torch.dtype, gen: torch.Generator):
    """Random entries in upstream's packed layout (logical [B, H, N, 2C], NHD strides,
    per-token-head scales inline), as (PagedCache, quant mode name, per-tensor scales)."""
    mode = CACHE_DTYPES[kv_cache_dtype]
    pth = mode in (Mode.PER_TOKEN_HEAD, Mode.INT4)
    storage = {Mode.PLAIN: model_dtype, Mode.FP8: torch.uint8, Mode.INT4: torch.uint8,
               Mode.PER_TOKEN_HEAD: torch.int8 if kv_cache_dtype.startswith("int8")
               else torch.uint8}[mode]
    data = d // 2 if mode == Mode.INT4 else d
    half = data + (4 // storage.itemsize if pth else 0)
    raw = torch.empty(num_blocks, PAGE, kv_heads, 2 * half, dtype=storage, device=dev)
    if mode == Mode.PLAIN:
        raw.normal_(generator=gen)
    elif mode == Mode.INT4 or storage == torch.int8:
        raw.view(torch.uint8).random_(0, 256, generator=gen)
    else:  # fp8 codes: random finite e4m3 values
        raw.copy_(torch.randn(raw.shape, generator=gen, device=dev).mul_(8)
                  .to(torch.float8_e4m3fn).view(torch.uint8))
    key, value = raw.split(half, dim=-1)  # == logical.transpose(1, 2).split(half)
    k_scale = v_scale = None
    if mode == Mode.FP8:
        key, value = key.view(torch.float8_e4m3fn), value.view(torch.float8_e4m3fn)
        k_scale = torch.tensor([0.02], device=dev)
        v_scale = torch.tensor([0.03], device=dev)
    elif pth:
        if kv_cache_dtype == "fp8_per_token_head":
            key, value = key.view(torch.float8_e4m3fn), value.view(torch.float8_e4m3fn)
        f32 = raw.view(torch.uint8).view(num_blocks, PAGE, kv_heads, -1).view(torch.float32)
        per = half * storage.itemsize // 4
        k_scale, v_scale = f32[..., per - 1], f32[..., 2 * per - 1]
        scale = torch.rand(num_blocks, PAGE, kv_heads, generator=gen, device=dev) * 0.02 + 0.01
        if mode == Mode.INT4:  # zero point in the 4 low mantissa bits
            # Below the codes' mean 7.5: V rows not centred on 0, so the output (a mean over
            # the context) is not ~0, where rounding alone reads as a 5-10% relative error.
            zp = torch.randint(0, 4, scale.shape, generator=gen, device=dev, dtype=torch.int32)
            scale = ((scale.view(torch.int32) & ~0xF) | zp).view(torch.float32)
        k_scale.copy_(scale)
        v_scale.copy_(scale.flip(0))
    return PagedCache(mode, key, value, k_scale, v_scale)


def kv_bytes(kv_cache_dtype: str, tokens: int, kv_heads: int, d: int) -> int:
    """Bytes a kernel must read for this many context tokens (K and V, scales)."""
    mode = CACHE_DTYPES[kv_cache_dtype]
    per_elem = {Mode.PLAIN: 2, Mode.FP8: 1, Mode.PER_TOKEN_HEAD: 1, Mode.INT4: 0.5}[mode]
    scale = 4 if mode in (Mode.PER_TOKEN_HEAD, Mode.INT4) else 0
    return int(tokens * kv_heads * 2 * (d * per_elem + scale))


# --------------------------------------------------------------------------- timing


def bench(fn, graphs: bool) -> tuple[float, str]:
    if not torch.cuda.is_available():
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3, "wall"
    if graphs:
        # do_bench_cudagraph runs fn on a stream of its own that does not wait for this
        # one: unsynced, fn read inputs still being written (illegal accesses at 8 x 64K).
        torch.cuda.synchronize()
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"), "graph"
        except Exception as e:  # a capture that fails falls back, and says so
            print(f"cudagraph timing failed ({type(e).__name__}: {e}); using do_bench",
                  file=sys.stderr)
    return triton.testing.do_bench(fn, warmup=10, rep=30, return_mode="median"), "eager"


def run_case(kv_cache_dtype: str, geometry: str, batch: int, context: int,
             query_lens: list[int], up032, up033, args, dev: str) -> list[dict]:
    d, kv_heads, gqa = (SMOKE_GEOMETRIES if args.smoke else GEOMETRIES)[geometry]
    hq = kv_heads * gqa
    model_dtype = torch.float16 if args.smoke or kv_cache_dtype == "float16" else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(batch * 7919 + context)
    pages = -(-context // PAGE)
    cache = make_cache(kv_cache_dtype, batch * pages + 1, kv_heads, d, dev, model_dtype, gen)
    table = torch.randperm(batch * pages, generator=gen, device=dev).to(torch.int32)
    table = table.view(batch, pages)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    split = batch <= MIN_GRID // kv_heads
    rows = []
    for q_len in query_lens:
        t = batch * q_len
        q = torch.randn(t, hq, d, generator=gen, device=dev).to(model_dtype)
        qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=dev)
        pad = triton.next_power_of_2(d)
        scratch = (torch.empty(t, hq, SEGMENTS, pad, device=dev),
                   torch.empty(t, hq, SEGMENTS, device=dev),
                   torch.empty(t, hq, SEGMENTS, device=dev))
        outs = {name: torch.empty_like(q) for name in ("fork", "up032_2d", "up033_3d")}
        fork = lambda: verify_attention(  # noqa: E731
            q, cache, table, seq_lens, qsl, q_len, d ** -0.5, outs["fork"],
            num_splits=SEGMENTS if split else 1, scratch=scratch if split else None)
        r = {"kv_cache_dtype": kv_cache_dtype, "geometry": geometry, "head_size": d,
             "kv_heads": kv_heads, "gqa": gqa, "batch": batch, "context": context,
             "query_len": q_len, "fork_splits": SEGMENTS if split else 1,
             "kv_bytes": kv_bytes(kv_cache_dtype, batch * context, kv_heads, d)}
        fork()
        r["fork_ms"], r["timing"] = bench(fork, not args.eager)
        r["fork_TBps"] = r["kv_bytes"] / r["fork_ms"] / 1e9
        for name, module, take in (("up032_2d", up032, True),
                                   ("up033_3d", up033, q_len <= 8 and cache.mode != Mode.INT4)):
            r[f"{name}_ms"] = None
            if module is None or not take:
                continue
            call = upstream_call(module, kv_cache_dtype, cache, q, outs[name], qsl, q_len,
                                 seq_lens, context, table,
                                 scratch if name == "up033_3d" else None, d)
            call()
            r[f"{name}_ms"], _ = bench(call, not args.eager)
            ref = outs[name].float()
            r[f"fork_vs_{name}_relerr"] = float((outs["fork"].float() - ref).norm() / ref.norm())
            r[f"{name}_over_fork"] = r[f"{name}_ms"] / r["fork_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del scratch, outs
    del cache, table
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def upstream_call(module, kv_cache_dtype, cache: PagedCache, q, out, qsl, q_len, seq_lens,
                  context, table, scratch, d):
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    mode = get_kv_quant_mode(kv_cache_dtype)
    pth = cache.mode in (Mode.PER_TOKEN_HEAD, Mode.INT4)
    batch = seq_lens.shape[0]
    descale = (None if pth else
               (cache.k_scale if cache.k_scale is not None else torch.ones(1, device=q.device)))
    v_descale = (None if pth else
                 (cache.v_scale if cache.v_scale is not None else torch.ones(1, device=q.device)))
    return lambda: module.unified_attention(
        q=q, k=cache.key, v=cache.value, out=out, cu_seqlens_q=qsl, max_seqlen_q=q_len,
        seqused_k=seq_lens, max_seqlen_k=context, softmax_scale=d ** -0.5, causal=True,
        window_size=(-1, -1), block_table=table, softcap=0, q_descale=None,
        k_descale=None if descale is None else descale.expand(batch, cache.num_kv_heads),
        v_descale=None if v_descale is None else v_descale.expand(batch, cache.num_kv_heads),
        seq_threshold_3D=None if scratch is None else MIN_GRID // cache.num_kv_heads,
        num_par_softmax_segments=None if scratch is None else SEGMENTS,
        softmax_segm_output=None if scratch is None else scratch[0],
        softmax_segm_max=None if scratch is None else scratch[1],
        softmax_segm_expsum=None if scratch is None else scratch[2], kv_quant_mode=mode,
        k_scale_cache=cache.k_scale if pth else None,
        v_scale_cache=cache.v_scale if pth else None)


# --------------------------------------------------------------------------- main


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(rows: list[dict]) -> str:
    def ms(x):
        return f"{x:8.4f}" if x is not None else "       -"

    def ratio(x):
        return f"{x:6.2f}" if x is not None else "     -"

    lines = [(f"{'kv cache dtype':20} {'geometry':14} {'BxL':>8} {'q':>2} {'fork ms':>8} "
             f"{'TB/s':>5} {'2D path':>8} {'0.33 3D':>8} {'2D/fork':>7} {'3D/fork':>7}")]
    for r in rows:
        lines.append(
            f"{r['kv_cache_dtype']:20} {r['geometry']:14} "
            f"{r['batch']:>3}x{_tokens(r['context']):>4} {r['query_len']:>2} "
            f"{r['fork_ms']:8.4f} {r['fork_TBps']:5.2f} {ms(r['up032_2d_ms'])} "
            f"{ms(r['up033_3d_ms'])} {ratio(r.get('up032_2d_over_fork'))}  "
            f"{ratio(r.get('up033_3d_over_fork'))}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    out = {}
    for name in ("up032_2d", "up033_3d"):
        ratios = [r[f"{name}_over_fork"] for r in rows if r.get(f"{name}_over_fork")]
        if ratios:
            out[name] = {"cases": len(ratios), "fork_faster": sum(x > 1 for x in ratios),
                         "median_ratio": statistics.median(ratios),
                         "min_ratio": min(ratios), "max_ratio": max(ratios)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES,
                    help="with --geometries, every pair; default: bfloat16 fp8 "
                         "int8_per_token_head int4_per_token_head at d128, bfloat16 and "
                         "int4_per_token_head at d256 (--smoke: float16 int8_per_token_head "
                         "int4_per_token_head)")
    ap.add_argument("--geometries", nargs="+", choices=[*GEOMETRIES, *SMOKE_GEOMETRIES])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--contexts", nargs="+", type=int, default=[16384, 65536])
    ap.add_argument("--query-lens", nargs="+", type=int, default=[2, 4, 8, 16])
    ap.add_argument("--upstream-033", type=Path,
                    help="folder with 0.33.0's triton_unified_attention.py and "
                         "triton_attention_helpers.py (see --extract-upstream)")
    ap.add_argument("--extract-upstream", type=Path, metavar="DIR",
                    help="write a pin's two op files into DIR/VERSION and exit")
    ap.add_argument("--extract-version", default="0.33.0", metavar="VERSION",
                    help="the pin --extract-upstream reads (default 0.33.0; 0.34.0's split "
                         "path loads the same way, through --upstream-033 DIR/0.34.0)")
    ap.add_argument("--no-upstream", action="store_true", help="time the fork's kernel only")
    ap.add_argument("--eager", action="store_true", help="time without CUDA graphs")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny fp16 shapes, CPU allowed (TRITON_INTERPRET=1; with vLLM on a "
                         "CPU also CUDA_VISIBLE_DEVICES= so vLLM keeps Triton): every path "
                         "runs, times mean nothing")
    args = ap.parse_args(argv)
    if args.extract_upstream:
        print(extract_upstream(args.extract_upstream, args.extract_version))
        return 0
    bad = [q for q in args.query_lens if not 1 <= q <= 16]
    if bad:
        ap.error(f"--query-lens {bad}: allowed 1..16")
    if args.smoke:
        args.geometries, args.batches = list(SMOKE_GEOMETRIES), [2]
        args.contexts, args.query_lens = [40, 100], [2, 5]
        args.dtypes = args.dtypes or ["float16", "int8_per_token_head", "int4_per_token_head"]
    elif not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    if args.dtypes or args.geometries:
        pairs = [(t, g) for t in args.dtypes or DEFAULT_DTYPES
                 for g in args.geometries or list(GEOMETRIES)]
    else:
        pairs = DEFAULT_PAIRS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    up032 = up033 = None
    if not args.no_upstream:
        try:
            from vllm.v1.attention.ops import triton_unified_attention as up032
        except ImportError as e:
            print(f"upstream 0.32.0 path not timed: vLLM not importable ({e})", file=sys.stderr)
        if args.upstream_033 is not None and up032 is not None:
            up033 = load_upstream_033(args.upstream_033)
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
               "upstream_032": up032 is not None, "upstream_033": up033 is not None,
               "rows": []}
    for kv_cache_dtype, geometry in pairs:
        for context in args.contexts:
            for batch in args.batches:
                results["rows"] += run_case(kv_cache_dtype, geometry, batch, context,
                                            args.query_lens, up032, up033, args, dev)
    results["summary"] = summary(results["rows"])
    print(table(results["rows"]))
    print("summary:", json.dumps(results["summary"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
