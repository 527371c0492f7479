"""The GPU tier's workloads: each runs one vLLM engine (or server) in its own process
and writes what it measured as JSON; the tests assert on those results.

    python3 -m tests.gpu.scenarios NAME SPEC_JSON OUT_JSON

A spec names the model folder and the knobs; tokens are always given as ids, so
lengths are exact. Engines that run side by side get a fixed KV-cache size
(``kv_cache_memory_bytes``), since the memory profile cannot tell their allocations
apart; the speed runs are alone on the GPU and size their pools by profiling.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
SPECIAL_IDS = 3  # the tiny models' tokenizers put their special tokens first
PROFILE_DELAY_STEPS = 4


def _mode_kwargs(mode: str) -> dict[str, Any]:
    """eager; graphs: full CUDA graphs for decode, no torch.compile; compile: both."""
    if mode == "eager":
        return {"enforce_eager": True}
    if mode == "graphs":
        return {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                       "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]}}
    if mode == "compile":
        return {"compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}
    raise ValueError(f"unknown mode {mode!r}; allowed: eager, graphs, compile")


def _llm(spec: dict[str, Any], **extra: Any):
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=spec["model"], dtype="bfloat16", seed=0, disable_log_stats=False,
        max_model_len=spec.get("max_model_len", 2048),
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        enable_prefix_caching=spec.get("prefix_caching", True),
        attention_backend=None if "kvarn" in spec.get("kv_cache_dtype", "") else "TRITON_ATTN",
        **_mode_kwargs(spec.get("mode", "eager")),
    )
    if "kv_cache_memory_bytes" in spec:
        kwargs["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if _is_hybrid(spec["model"]):
        # On Hopper upstream's "auto" GDN prefill is FlashInfer, which the bundle does
        # not carry; Triton is what "auto" takes on the 3090/4090-class cards users run.
        kwargs["additional_config"] = {"gdn_prefill_backend": "triton"}
    for key in ("max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override",
                "gpu_memory_utilization"):
        if key in spec:
            kwargs[key] = spec[key]
    kwargs.update(extra)
    return LLM(**kwargs)


def _is_hybrid(model: str) -> bool:
    """Whether the folder's model has Gated DeltaNet (linear attention) layers."""
    config = json.loads((Path(model) / "config.json").read_text())
    return "linear_attention" in config.get("layer_types", ())


def _greedy(max_tokens: int, **extra: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def _prompts(ids: list[list[int]]):
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in ids]


def _generate(llm, ids: list[list[int]], params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(ids), params,
                                                               use_tqdm=False)]


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(SPECIAL_IDS, vocab) for _ in range(n)]


def _vocab(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def _pool(llm) -> dict[str, Any]:
    cache = llm.llm_engine.vllm_config.cache_config
    return {"num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "pool_tokens": (cache.num_gpu_blocks or 0) * cache.block_size,
            # 0.34.0's pool that grows after warm-up (None on a pin without it)
            "extensible_kv_cache": getattr(cache, "enable_extensible_kv_cache", None)}


def _counter(llm, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in llm.get_metrics()
               if m.name in (name, name + "_total"))


# -- scenarios --------------------------------------------------------------------


def parity(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens of fixed prompts under one execution mode (and transformers')."""
    rng = random.Random(1)
    vocab = _vocab(spec["model"])
    lengths = spec.get("lengths", [5, 37, 130, 300])
    n = spec.get("max_tokens", 24)
    result: dict[str, Any] = {}
    if spec.get("copy"):
        from kiln.testing import tinymodel

        period = tinymodel.read_spec(Path(spec["model"])).copy_period
        ids = [tinymodel.copy_prompt(spec["model"], k, seed=k) for k in lengths]
        result["expected"] = [tinymodel.copy_continuation(p, n, period) for p in ids]
    else:
        ids = [_random_ids(rng, k, vocab) for k in lengths]
    llm = _llm(spec, max_num_seqs=8)
    result["tokens"] = _generate(llm, ids, _greedy(n, ignore_eos=True))
    if spec.get("transformers"):
        del llm
        result["transformers"] = _transformers_greedy(spec["model"], ids, n)
    return result


def _transformers_greedy(model: str, ids: list[list[int]], n: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    out = []
    with torch.no_grad():
        for p in ids:
            x = torch.tensor([p], device="cuda")
            y = hf.generate(x, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                            pad_token_id=0)
            out.append(y[0, len(p):].tolist())
    return out


def kvarn_copy(spec: dict[str, Any]) -> dict[str, Any]:
    """The copy model through one cache path: prompts around every block boundary (at
    least 4 full blocks), a residue sweep of 128 lengths each sent twice (the second a
    prefix-cache hit), chunked prefill over records (small token budget), a pool small
    enough to preempt, and many more requests than seats."""
    from kiln.testing import tinymodel

    model = spec["model"]
    llm = _llm(spec)
    g = llm.llm_engine.vllm_config.cache_config.block_size
    period = tinymodel.read_spec(Path(model)).copy_period
    # At least 4 full blocks, and a whole period before the first generated token.
    base = max(4, -(-period // g))
    boundary = sorted({base * g - 1, base * g, base * g + 1, (base + 1) * g - 1,
                       (base + 1) * g, (base + 1) * g + 1, (base + 2) * g + 7,
                       (base + 3) * g + 1, (base + 4) * g - 1})
    cases: list[tuple[str, list[int]]] = [
        (f"boundary-{n}", tinymodel.copy_prompt(model, n, seed=n)) for n in boundary]
    n_new = spec.get("max_tokens", 40)
    outputs: dict[str, list[int]] = {}
    for name, out in zip([c for c, _ in cases],
                         _generate(llm, [p for _, p in cases], _greedy(n_new))):
        outputs[name] = out
    sweep = spec.get("residues", 128)
    for start in range(0, sweep, 4):
        group = [(f"residue-{r}", tinymodel.copy_prompt(model, base * g + r, seed=1000 + r))
                 for r in range(start, min(start + 4, sweep))]
        cases += group
        ids = [p for _, p in group]
        first = _generate(llm, ids, _greedy(8))
        second = _generate(llm, ids, _greedy(8))  # prefix-cache hits on the first
        for (name, _), a, b in zip(group, first, second):
            outputs[name], outputs[name + "-again"] = a, b
    expected = {}
    for name, prompt in cases:
        n = len(outputs[name])
        expected[name] = tinymodel.copy_continuation(prompt, n, period)
        if name + "-again" in outputs:
            expected[name + "-again"] = expected[name]
    broken = sorted(k for k in outputs if outputs[k] != expected[k])
    return {
        "block_size": g, "outputs": outputs, "broken": broken,
        "finished": len(outputs), "prompt_lengths": {n: len(p) for n, p in cases},
        "preemptions": _counter(llm, "vllm:num_preemptions"),
        "prefix_hits": _counter(llm, "vllm:prefix_cache_hits"),
        "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
        **_pool(llm),
    }


def agreement(spec: dict[str, Any]) -> dict[str, Any]:
    """Teacher-forced: the top-1 token and the forced token's logprob at every position
    of fixed sequences, prefilled in small chunks so later chunks read the cache."""
    rng = random.Random(7)
    vocab = _vocab(spec["model"])
    seqs = [_random_ids(rng, spec.get("length", 1024), vocab)
            for _ in range(spec.get("sequences", 4))]
    llm = _llm(spec)
    outs = llm.generate(_prompts(seqs), _greedy(1, prompt_logprobs=1), use_tqdm=False)
    top1, forced = [], []
    for seq, out in zip(seqs, outs):
        t, f = [], []
        for tok, lp in zip(seq[1:], out.prompt_logprobs[1:]):
            t.append(min(lp, key=lambda k: lp[k].rank))
            f.append(lp[tok].logprob)
        top1.append(t)
        forced.append(f)
    return {"top1": top1, "forced_logprob": forced, **_pool(llm)}


def noise_reference(spec: dict[str, Any]) -> dict[str, Any]:
    """What the format's error alone does to the same teacher-forced positions: the
    model in transformers, clean and with Gaussian noise of each preset's measured
    reconstruction NMSE added to every key and value row past the fp16 sink block."""
    import torch
    from transformers import AutoModelForCausalLM

    rng = random.Random(7)
    vocab = _vocab(spec["model"])
    seqs = [_random_ids(rng, spec.get("length", 1024), vocab)
            for _ in range(spec.get("sequences", 4))]
    hf = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16).cuda()
    hf.eval()
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = {"k": 0.0, "v": 0.0, "sink": 0}

    def noisy(which):
        def hook(_module, _inputs, out):
            rel = state[which]
            if not rel:
                return out
            x = out.float()
            rms = x.pow(2).mean(-1, keepdim=True).sqrt()
            noise = torch.randn(x.shape, generator=gen, device=x.device) * rms * rel
            noise[:, : state["sink"]] = 0
            return (x + noise).to(out.dtype)
        return hook

    for layer in hf.model.layers:
        layer.self_attn.k_norm.register_forward_hook(noisy("k"))
        layer.self_attn.v_proj.register_forward_hook(noisy("v"))

    def run() -> list[list[int]]:
        with torch.no_grad():
            return [hf(torch.tensor([s], device="cuda")).logits[0, :-1].argmax(-1).tolist()
                    for s in seqs]

    result = {"clean": run()}
    for name, (k_nmse, v_nmse, group) in spec["presets"].items():
        state.update(k=k_nmse ** 0.5, v=v_nmse ** 0.5, sink=group)
        result[name] = run()
    return result


def needs_missing_flashinfer(model: str) -> str | None:
    """Why ``model`` cannot be served here, or None: from vLLM 0.34.0 Qwen3.5 on NVIDIA
    runs vllm/models/qwen3_5/nvidia, whose every norm calls FlashInfer's Gemma RMSNorm.
    A pip install of the fork brings FlashInfer; the GPU bundle, which cannot carry it
    (101 MB), installs a torch stand-in of its ``flashinfer.norm``
    (kiln/testing/standins/flashinfer)."""
    import importlib.util

    arch = json.loads((Path(model) / "config.json").read_text())["architectures"][0]
    if arch.startswith("Qwen3_5") and importlib.util.find_spec("vllm.models.qwen3_5") \
            and importlib.util.find_spec("flashinfer") is None:
        return (f"{arch} runs vllm/models/qwen3_5/nvidia on CUDA (vLLM 0.34.0), which "
                "needs FlashInfer's norm: install flashinfer-python or run from the bundle")
    return None


def hybrid(spec: dict[str, Any]) -> dict[str, Any]:
    """The Gated DeltaNet + attention model serving greedy requests (with the spec's
    speculative method, if any: tokens per step from the spec-decode counters)."""
    if reason := needs_missing_flashinfer(spec["model"]):
        return {"skipped": reason}
    rng = random.Random(3)
    vocab = _vocab(spec["model"])
    ids = [_random_ids(rng, n, vocab) for n in (200, 333, 512, 700)]
    llm = _llm(spec, max_num_seqs=4, **_speculative(spec))
    params = _greedy(32, ignore_eos=True)
    if "speculative" not in spec:
        return {"tokens": _generate(llm, ids, params), "vocab": vocab, **_pool(llm)}
    out: dict[str, Any] = {}
    counts = _tokens_per_step(llm, lambda: out.update(tokens=_generate(llm, ids, params)))
    return {**out, **counts, "vocab": vocab, **_pool(llm)}


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm serve` with --api-key: the residue sweep and the copy probe through HTTP."""
    import subprocess
    import urllib.error
    import urllib.request

    from tests.e2e.vllm_server import VllmServer

    out_dir = Path(spec["log_dir"])
    key = "kiln-gpu-key"
    server = VllmServer(
        model=spec["model"], api_key=key, log_path=out_dir / "serve.log",
        env={"VLLM_TARGET_DEVICE": "cuda"},
        args=["--dtype", "bfloat16", "--kv-cache-dtype", spec["kv_cache_dtype"],
              "--enable-prefix-caching", "--max-model-len", "4096",
              "--gpu-memory-utilization", "0.04",
              "--kv-cache-memory-bytes", str(GIB), "--max-num-seqs", "8",
              "--max-num-batched-tokens", "512", "--enforce-eager"])
    server.start(timeout=600)
    try:
        try:
            urllib.request.urlopen(server.url + "/v1/models", timeout=10)
            unauthenticated = 200
        except urllib.error.HTTPError as e:
            unauthenticated = e.code
        probes = {}
        bench = Path(__file__).resolve().parents[2] / "bench" / "probes"
        for name, args in (("residue_sweep", ["--base-blocks", "4", "--max-tokens", "8"]),
                           ("copy_probe", ["--max-tokens", "64", "--repeat", "3",
                                           "--max-chars", "6000"])):
            run = subprocess.run(
                [sys.executable, str(bench / f"{name}.py"), "--base-url", server.url,
                 "--api-key", key, *args], capture_output=True, text=True, timeout=600)
            probes[name] = {"exit": run.returncode, "stderr": run.stderr[-2000:],
                            **(json.loads(run.stdout) if run.stdout.strip() else {})}
        return {"unauthenticated_status": unauthenticated, "probes": probes,
                "startup_s": server.startup_seconds}
    finally:
        server.stop()


def _complete(server, model: str, ids: list[int], n: int, timeout: float = 600,
              **extra: Any) -> dict[str, Any]:
    """One greedy /v1/completions request to a VllmServer; its JSON reply."""
    import urllib.request

    body = json.dumps({"model": model, "prompt": ids, "max_tokens": n, "temperature": 0.0,
                       **extra}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def profile(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm serve --kiln-profile ctx=huge,spec=ngram,prefix-cache` on the copy model:
    the resolved arguments from the start-up log, exact copies through the server, and
    tokens per step from the server's spec-decode counters."""
    import re
    import urllib.request

    from kiln.testing import tinymodel
    from tests.e2e.vllm_server import VllmServer

    model = spec["model"]
    period = tinymodel.read_spec(Path(model)).copy_period
    server = VllmServer(
        model=model, log_path=Path(spec["log_dir"]) / "profile.log",
        env={"VLLM_TARGET_DEVICE": "cuda"},
        args=["--dtype", "bfloat16", "--kiln-profile", spec["profile"],
              "--max-model-len", "4096", "--gpu-memory-utilization", "0.04",
              "--kv-cache-memory-bytes", str(GIB), "--max-num-seqs", "8",
              "--enforce-eager"])
    server.start(timeout=600)
    try:
        prompts = [tinymodel.copy_prompt(model, n, seed=n) for n in (300, 700, 1200, 2000)]
        broken = 0
        for ids in prompts:
            got = _complete(server, model, ids, 96, timeout=300,
                            return_token_ids=True)["choices"][0]["token_ids"]
            broken += got != tinymodel.copy_continuation(ids, 96, period)
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()

        def counter(name: str) -> float:
            return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$",
                                                    metrics, re.M))

        log = server.log_text()
        resolved = re.search(r"--kiln-profile \S+ resolved: (.*)", log)
        return {"resolved": resolved.group(1) if resolved else None, "broken": broken,
                "prompts": len(prompts), "kvarn_backend": "Using KVARN attention backend" in log,
                "drafts": counter("spec_decode_num_drafts_total"),
                "accepted": counter("spec_decode_num_accepted_tokens_total")}
    finally:
        server.stop()


def _gpu_used_mib() -> int:
    """Memory every process holds on the GPU (nvidia-smi), the CUDA contexts included:
    what a 24 GB card would have to hold. The engine runs alone (exclusive)."""
    import subprocess

    out = subprocess.run(["nvidia-smi", "--query-compute-apps=used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         check=True).stdout
    return sum(int(line) for line in out.split() if line.strip().isdigit())


def card_budget(spec: dict[str, Any]) -> dict[str, Any]:
    """`vllm serve --kiln-profile card=24g,...` inside a 24 GB card's memory on a larger
    card: --gpu-memory-utilization is the budget's share of this card (an explicit
    argument, which the profile leaves alone). Start-up either refuses, with its one
    error line, or serves: the KV pool and the context auto-fit gave it, four seats
    answering at once, then one prompt of spec["long_prompt"] tokens (bounded by that
    context), and the GPU memory every process held after each (nvidia-smi)."""
    import concurrent.futures
    import re
    import urllib.request

    import torch

    from tests.e2e.vllm_server import ServerStartError, VllmServer

    model = spec["model"]
    total = torch.cuda.mem_get_info()[1]
    util = spec["budget_gib"] * GIB / total
    args = ["--dtype", "bfloat16", "--kiln-profile", spec["profile"],
            "--gpu-memory-utilization", f"{util:.4f}", *spec.get("args", [])]
    if "drafter" in spec:
        args += ["--speculative-config", json.dumps({"model": spec["drafter"]})]
    server = VllmServer(model=model, log_path=Path(spec["log_dir"]) / "card.log",
                        env={"VLLM_TARGET_DEVICE": "cuda"}, args=args)
    try:
        server.start(timeout=900)
    except ServerStartError:
        errors = [line for line in server.log_text().splitlines()
                  if line.startswith("vllm serve: error:") or "Error:" in line]
        return {"refused": errors[-1] if errors else server.log_tail(20), "util": util}
    try:
        log = server.log_text()
        with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
            max_model_len = json.loads(r.read())["data"][0]["max_model_len"]
        sizes = re.findall(r"KV cache size: ([\d,]+) tokens", log)
        rng = random.Random(17)
        vocab = _vocab(model)

        def complete(ids: list[int], n: int) -> int:
            return _complete(server, model, ids, n, ignore_eos=True)["usage"][
                "completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(4) as workers:
            seats = list(workers.map(lambda n: complete(_random_ids(rng, n, vocab), 64),
                                   (500, 1000, 2000, 4000)))
        after_seats = _gpu_used_mib()
        long_tokens = min(spec["long_prompt"], max_model_len - 64)
        long_answer = complete(_random_ids(rng, long_tokens, vocab), 32)
        resolved = re.search(r"--kiln-profile \S+ resolved: (.*)", log)
        return {"util": util, "max_model_len": max_model_len,
                "pool_tokens": int(sizes[-1].replace(",", "")) if sizes else None,
                "seats_answered": seats, "long_prompt_tokens": long_tokens,
                "long_answered": long_answer, "used_mib_after_seats": after_seats,
                "used_mib_after_long": _gpu_used_mib(),
                "resolved": resolved.group(1) if resolved else None,
                "startup_s": server.startup_seconds}
    finally:
        server.stop()


def _fresh(rng: random.Random, batch: int, context: int, vocab: int) -> list[list[int]]:
    return [_random_ids(rng, context, vocab) for _ in range(batch)]


def speed(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode tokens/s at each batch x context as a user sees it, the engine alone on
    the GPU: every timed generation prefills fresh prompts, which the prefix cache
    (left as the spec sets it: on, upstream's default) cannot hold, and decode =
    (time of a 129-token generation - time of a 1-token one) / 128, each over its own
    fresh prompts of the shape, so the two prefills cancel. A warm-up generation over
    other fresh prompts takes each shape's Triton JIT compiles out of the timing.
    With spec["profile_steps"], that many decode steps of the largest shape run under
    vLLM's torch profiler afterwards (the profiler idles through the timed runs)."""
    import torch

    rng = random.Random(11)
    vocab = _vocab(spec["model"])
    shapes = [tuple(shape) for shape in spec["shapes"]]
    steps = spec.get("profile_steps", 0)
    trace_dir = Path(tempfile.mkdtemp(prefix="kiln-speed-profile-")) if steps else None
    profiler = {"profiler_config": {
        "profiler": "torch", "torch_profiler_dir": str(trace_dir),
        "torch_profiler_with_stack": False, "ignore_frontend": True}} if steps else {}
    llm = _llm(spec, max_num_seqs=max(b for b, _ in shapes), **profiler)
    table = []
    for batch, ctx in shapes:
        _generate(llm, _fresh(rng, batch, ctx, vocab), _greedy(2, ignore_eos=True))
        times = {}
        for n in (1, 129):
            ids = _fresh(rng, batch, ctx, vocab)
            started = time.perf_counter()
            _generate(llm, ids, _greedy(n, ignore_eos=True))
            times[n] = time.perf_counter() - started
        step = (times[129] - times[1]) / 128
        table.append({"batch": batch, "context": ctx, "ms_per_step": step * 1e3,
                      "tokens_per_s": batch / step, "prefill_s": times[1]})
    result = {"table": table, "device": torch.cuda.get_device_name(),
              "prefix_caching": spec.get("prefix_caching", True),
              "decode_kernel": [line for line in _log_lines() if "KVarN decode kernel" in line],
              **_pool(llm)}
    if steps:
        batch, ctx = max(shapes, key=lambda shape: shape[0] * shape[1])
        ids = _fresh(rng, batch, ctx, vocab)
        result["profile"] = _profiled_decode(llm, ids, steps, trace_dir)
    return result


def _profiled_decode(llm, ids: list[list[int]], steps: int, trace_dir: Path) -> dict[str, Any]:
    """``steps`` decode steps over fresh ``ids`` under the torch profiler: the prefill
    chunks (one engine step per max_num_batched_tokens) and the first decodes are
    skipped, then the worker writes its table of kernels by device time, which names
    the steps it covers."""
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    prefill_steps = -(-sum(map(len, ids)) // budget)
    llm.start_profile(delay_iterations=prefill_steps + PROFILE_DELAY_STEPS,
                      max_iterations=steps)
    started = time.perf_counter()
    _generate(llm, ids, _greedy(PROFILE_DELAY_STEPS + steps + 2, ignore_eos=True))
    seconds = time.perf_counter() - started
    llm.stop_profile()  # ignored by the worker once max_iterations stopped it
    tables = sorted(trace_dir.glob("*.profiler_out.txt"))
    if not tables:
        return {"steps": steps, "error": f"the profiler wrote no table under {trace_dir}: "
                                         f"{sorted(p.name for p in trace_dir.iterdir())}"}
    return {"steps": steps, "batch": len(ids), "context": len(ids[0]),
            "generate_s": seconds, "table": tables[0].read_text()}


def _speculative(spec: dict[str, Any]) -> dict[str, Any]:
    """The scenario's --speculative-config, with the drafter's folder filled in."""
    config = spec.get("speculative")
    if config is None:
        return {}
    config = dict(config)
    if config.get("model") == "DRAFTER":
        config["model"] = spec["drafter"]
    return {"speculative_config": config}


def _tokens_per_step(llm, run) -> dict[str, float]:
    """Mean tokens per verify step over ``run()``, from the spec-decode counters."""
    before = (_counter(llm, "vllm:spec_decode_num_drafts"),
              _counter(llm, "vllm:spec_decode_num_accepted_tokens"))
    run()
    drafts = _counter(llm, "vllm:spec_decode_num_drafts") - before[0]
    accepted = _counter(llm, "vllm:spec_decode_num_accepted_tokens") - before[1]
    return {"drafts": drafts, "accepted": accepted,
            "tokens_per_step": 1 + accepted / drafts if drafts else 0.0}


def spec_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Greedy output of the copy model with one speculative method (or none): a copy
    task (long periodic prompts, tokens per step from the spec-decode counters), then
    64 prompts half periodic, half random tokens (the copy of a random prompt repeats
    it, so lookups start failing and then catch on)."""
    from kiln.testing import tinymodel

    model = spec["model"]
    period = tinymodel.read_spec(Path(model)).copy_period
    rng = random.Random(5)
    vocab = _vocab(model)
    llm = _llm(spec, **_speculative(spec))
    copy_ids = [tinymodel.copy_prompt(model, n, seed=n) for n in (600, 1000, 1400, 2000)]
    copy_n = spec.get("copy_tokens", 256)
    copy_out: list[list[int]] = []
    metrics = _tokens_per_step(llm, lambda: copy_out.extend(
        _generate(llm, copy_ids, _greedy(copy_n, ignore_eos=True))))
    lengths = [period + 1 + rng.randrange(1200) for _ in range(64)]
    ids = [tinymodel.copy_prompt(model, n, seed=1000 + i) if i % 2 == 0
           else _random_ids(rng, n, vocab) for i, n in enumerate(lengths)]
    n = spec.get("max_tokens", 48)
    tokens = _generate(llm, ids, _greedy(n, ignore_eos=True))
    return {"copy": metrics, "copy_broken": sum(
                o != tinymodel.copy_continuation(p, copy_n, period)
                for p, o in zip(copy_ids, copy_out)),
            "tokens": tokens, "expected": [tinymodel.copy_continuation(p, n, period)
                                           for p in ids],
            "prompt_lengths": lengths, "verify_attention": _verify_attention(), **_pool(llm)}


def _timed(llm, ids: list[list[int]], n: int) -> tuple[float, list[Any]]:
    started = time.perf_counter()
    outs = llm.generate(_prompts(ids), _greedy(n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - started, outs


def conversation(spec: dict[str, Any]) -> dict[str, Any]:
    """Prefix reuse on the hybrid copying model as a chat client asks: each turn's prompt
    is the last turn's prompt, its answer and spec["turns"][i] new tokens, for
    spec["conversations"] conversations at once (in a small pool: preemption and
    eviction). The answers are the copy, known in advance, so a wrong Gated DeltaNet
    state or KVarN record restored from the cache shows. Per turn: the tokens served from
    the prefix cache (RequestOutput.num_cached_tokens) and the time to a first token;
    with spec["cold"], beside it the same prompts' time with their first token changed,
    so that nothing matches (side by side, on one engine)."""
    from kiln.testing import tinymodel

    model = spec["model"]
    period = tinymodel.read_spec(Path(model)).copy_period
    rng = random.Random(13)
    vocab = _vocab(model)
    talks = spec.get("conversations", 1)
    n = spec.get("answer_tokens", 64)
    llm = _llm(spec, max_num_seqs=max(talks, 2))
    preempted = _counter(llm, "vllm:num_preemptions")
    prompts = [tinymodel.copy_prompt(model, spec["turns"][0], seed=c + 1) for c in range(talks)]
    answers: list[list[int]] = []
    turns = []
    for i, added in enumerate(spec["turns"]):
        if i:
            prompts = [p + a + _random_ids(rng, added, vocab) for p, a in zip(prompts, answers)]
        expected = [tinymodel.copy_continuation(p, n, period) for p in prompts]
        row: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts]}
        if spec.get("cold"):
            changed = [[SPECIAL_IDS + (p[0] - SPECIAL_IDS + 1) % (vocab - SPECIAL_IDS), *p[1:]]
                       for p in prompts]
            row["cold_first_token_s"], _ = _timed(llm, changed, 1)
        row["first_token_s"], firsts = _timed(llm, prompts, 1)
        row["cached_tokens"] = [o.num_cached_tokens for o in firsts]
        row["first_right"] = sum(o.outputs[0].token_ids[0] == e[0]
                                 for o, e in zip(firsts, expected))
        _, outs = _timed(llm, prompts, n)
        answers = [list(o.outputs[0].token_ids) for o in outs]
        row["answers_right"] = sum(a == e for a, e in zip(answers, expected))
        turns.append(row)
    cache = llm.llm_engine.vllm_config.cache_config
    return {"turns": turns, "conversations": talks, "answer_tokens": n,
            "preemptions": _counter(llm, "vllm:num_preemptions") - preempted,
            "mamba_cache_mode": cache.mamba_cache_mode, **_pool(llm)}


def _log_lines() -> list[str]:
    """This scenario's log so far (stdout and stderr, which the session sends to
    $KILN_SCENARIO_LOG): read back rather than hooked, since vLLM reconfigures its
    logger while the engine starts and drops handlers added before."""
    sys.stdout.flush()
    sys.stderr.flush()
    return Path(os.environ["KILN_SCENARIO_LOG"]).read_text(errors="replace").splitlines()


def _verify_attention() -> str | None:
    """Whose kernel served verify batches over a TRITON_ATTN cache, as vllm.fork.spec_attn
    logged it ("fork" or "upstream"); None when no verify batch reached that backend."""
    for line in _log_lines():
        if "Speculative verify attention for --kv-cache-dtype" in line:
            return "fork" if "the fork's split-KV kernel" in line else "upstream"
    return None


def _block_size_queries(num_query_per_req: int, budget: int) -> dict[int, int]:
    """Upstream's BLOCK_SIZE rule, min(256, next_pow2(q + 1 + k)), over every query
    length one request can bring: the shortest query selecting each size."""
    out: dict[int, int] = {}
    for q in range(1, budget + 1):
        size = min(256, 1 << (q + num_query_per_req - 1).bit_length())
        out.setdefault(size, q)
    return out


def dflash2_jit(spec: dict[str, Any]) -> dict[str, Any]:
    """DFlash2 with the random drafter under CUDA graphs and upstream's JIT monitor:
    one request per BLOCK_SIZE variant of the DFlash input kernel, each prefilling
    exactly the query length that selects it over a 512-token prefix-cache hit; every
    JIT compile the monitor reports after boot is recorded (or, in mode error,
    fails the run)."""
    from kiln.testing import tinymodel

    model = spec["model"]
    period = tinymodel.read_spec(Path(model)).copy_period
    llm = _llm(spec, jit_monitor_mode=spec["jit_monitor_mode"], jit_monitor_verbose=True,
               **_speculative(spec))
    k = llm.llm_engine.vllm_config.speculative_config.kiln_dflash2["draft_tokens"]
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    queries = _block_size_queries(1 + k, min(budget, 512))
    base = tinymodel.copy_prompt(model, 512 + max(queries.values()), seed=7)
    outputs, expected = [], []
    n = spec.get("max_tokens", 24)
    for prompt in [base[:512]] + [base[:512 + q] for q in queries.values()]:
        outputs += _generate(llm, [prompt], _greedy(n, ignore_eos=True))
        expected.append(tinymodel.copy_continuation(prompt, n, period))
    lines = _log_lines()
    armed = [i for i, line in enumerate(lines) if "Kernel JIT monitor activated" in line]
    assert armed, "the JIT monitor never reported activation"
    return {"draft_tokens": k, "block_size_queries": queries, "tokens": outputs,
            "expected": expected, "verify_attention": _verify_attention(),
            "jit_after_boot": [line for line in lines[armed[0] + 1:]
                               if "during inference" in line],
            "prewarm": [line for line in lines[:armed[0]]
                        if "compiled the DFlash input kernel" in line]}


SCENARIOS = {f.__name__: f for f in (parity, kvarn_copy, agreement, noise_reference,
                                      hybrid, serve, profile, speed, spec_decode,
                                      dflash2_jit, conversation, card_budget)}


def main() -> int:
    name, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    started = time.monotonic()
    result = SCENARIOS[name](spec)
    result["seconds"] = round(time.monotonic() - started, 1)
    Path(out_path).write_text(json.dumps(result))
    # Engine processes may linger past the interpreter's shutdown; the result is out.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
