"""Run by test_dflash2_config.py in a process of its own:

    python dflash2_child.py TARGET DRAFTER OUT_JSON [ranks]

Builds engine configs with upstream's EngineArgs(...).create_engine_config() for each
case (the fork's DFlash2 settings and the KVarN method rule) and records the resolved
settings or the error; then builds vLLM's DFlash2 model class from one of them on the
CPU and loads the drafter's checkpoint through the class's own load_weights.

The process starts with CUDA_VISIBLE_DEVICES="" so upstream's Triton check takes the
lenient path (no device yet) and Model Runner V2, the only runner DFlash2 drafts on,
is chosen on this CPU machine; no kernel runs here.

With ``ranks`` it only drives the speculator's propose() on one and on two ranks
(drive_ranks) for test_dflash2_ranks.py.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def cases(target: str, drafter: str) -> dict[str, dict]:
    def dflash(k: int, **kiln) -> dict:
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": k,
                "attention_backend": "CPU_ATTN"}
        if kiln:
            spec["kiln_dflash2"] = kiln
        return {"speculative_config": spec}

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    return {
        "defaults-k3": dflash(3),
        "defaults-k7": dflash(7),
        "lookup-v15-k7": dflash(15, lookup=True, draft_tokens=7),
        "lookup-v20": dflash(20, lookup=True),
        "verify-shorter-than-drafter": dflash(5, draft_tokens=7),
        "k-above-block": dflash(7, draft_tokens=16),
        "v-above-block-without-lookup": dflash(16),
        "lookup-min-above-max": dflash(7, lookup=True, lookup_min=5, lookup_max=3),
        "unknown-key": dflash(7, verify_block=15),
        "lookup-probabilistic": {"speculative_config": {
            **dflash(7, lookup=True)["speculative_config"],
            "draft_sample_method": "probabilistic"}},
        "kiln-dflash2-on-ngram": {"speculative_config": {**ngram, "kiln_dflash2": {}}},
        "kvarn-dflash": {**dflash(7), "kv_cache_dtype": "kvarn_k4v2_g128"},
        "kvarn-ngram": {"speculative_config": ngram, "kv_cache_dtype": "kvarn_k4v2_g128"},
        "kvarn-ngram_gpu": {"speculative_config": {**ngram, "method": "ngram_gpu"},
                            "kv_cache_dtype": "kvarn_k4v2_g128"},
    }


def main() -> int:
    target, drafter, out_path = sys.argv[1:4]
    if sys.argv[4:] == ["ranks"]:
        Path(out_path).write_text(json.dumps(drive_ranks(target, drafter)))
        return 0
    from vllm.engine.arg_utils import EngineArgs

    from vllm.fork.kvarn_backend import runs_model_runner_v2

    results: dict[str, dict] = {}
    configs = {}
    for name, extra in cases(target, drafter).items():
        args = EngineArgs(model=target, skip_tokenizer_init=True, max_model_len=512,
                          enforce_eager=True, dtype="bfloat16", **extra)
        try:
            config = args.create_engine_config()
        except Exception as e:  # noqa: BLE001 - the message is what the test reads
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        spec = config.speculative_config
        configs[name] = config
        results[name] = {"method": spec.method,
                         "num_speculative_tokens": spec.num_speculative_tokens,
                         "kiln_dflash2": spec.kiln_dflash2,
                         "v2_runner": runs_model_runner_v2(config),
                         "scratch": scratch_plan(config)}
    results["model"] = load_model(configs["lookup-v15-k7"], drafter)
    results["speculator"] = drive_speculator(configs["lookup-v15-k7"])
    results["init_speculator"] = built_speculator(configs["lookup-v15-k7"])
    Path(out_path).write_text(json.dumps(results))
    return 0


def scratch_plan(config) -> dict:
    """The spec-decode scratch pool's plan for the target's layers (bf16 cache)."""
    from vllm.fork import spec_scratch

    spec = config.speculative_config
    plan = spec_scratch.plan(config, config.model_config.get_num_kv_heads(
        config.parallel_config), "auto")
    return {"drafts_in_parallel": spec_scratch.drafts_in_parallel(spec),
            "query_len": plan.query_len}


def built_speculator(config) -> str:
    """The class upstream's init_speculator builds for this config, on the CPU."""
    import torch
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    speculator = init_speculator(config, torch.device("cpu"), cpu_request_states())
    return f"{type(speculator).__module__}.{type(speculator).__qualname__}"


def load_model(config, drafter: str) -> dict:
    """vLLM's model class for the drafter's architecture, built as the speculator
    builds it (the drafter's own token count) and loaded from the checkpoint."""
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm.fork.dflash2_config import settings_of
    from vllm.fork.dflash2_speculator import drafter_view

    settings = settings_of(config.speculative_config)
    view = drafter_view(config, settings.draft_tokens)
    with set_current_vllm_config(view):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tempfile.mkstemp()[1]}")
        initialize_model_parallel(1, 1)
    arch = view.speculative_config.draft_model_config.architectures[0]
    model_cls, _ = ModelRegistry.resolve_model_cls([arch],
                                                   view.speculative_config.draft_model_config)
    with set_current_vllm_config(view), set_default_torch_dtype(config.model_config.dtype):
        model = model_cls(vllm_config=view)
    params = dict(model.named_parameters())
    weights = load_file(str(Path(drafter) / "model.safetensors"))
    model.load_weights(iter(weights.items()))
    dtype = config.model_config.dtype

    def param(name: str) -> torch.Tensor:
        return params[name].detach()

    # Where each checkpoint tensor must land (vLLM stacks q/k/v and gate/up).
    checked, mismatched, covered = [], [], set()
    for name, tensor in weights.items():
        tensor = tensor.to(dtype)
        target_name = "model." + name
        for part, (fused, index) in {".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1),
                                     ".v_proj.": (".qkv_proj.", 2), ".gate_proj.": (
                                         ".gate_up_proj.", 0), ".up_proj.": (
                                         ".gate_up_proj.", 1)}.items():
            if part in target_name:
                fused_name = target_name.replace(part, fused)
                sizes = _split_sizes(fused, weights, name, part)
                start = sum(sizes[:index])
                got = param(fused_name)[start:start + sizes[index]]
                covered.add(fused_name)
                break
        else:
            got = param(target_name)
            covered.add(target_name)
        checked.append(name)
        if got.shape != tensor.shape or not torch.equal(got, tensor):
            mismatched.append(name)
    conv = model.model.layers[0].attention_conv
    return {"class": f"{model_cls.__module__}.{model_cls.__name__}",
            "checked": checked, "mismatched": mismatched,
            "params": sorted(params), "uncovered": sorted(set(params) - covered),
            "conv_block_size": conv.block_size, "conv_groups": conv.num_groups,
            "selector_top_k": model.model.candidate_selector.top_k}


def drive_speculator(config) -> dict:
    """KilnDFlash2Speculator built on the CPU from the engine config, its verify block
    filled from the request history over a few steps (the drafter's forward and the
    runner's kernels need CUDA; the runner's post-step writes are made here)."""
    import dataclasses

    import numpy as np
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm.fork.dflash2_speculator import KilnDFlash2Speculator

    device = torch.device("cpu")
    states = cpu_request_states()
    spec = KilnDFlash2Speculator(config, device, states)
    shape = {"num_speculative_steps": spec.num_speculative_steps,
             "num_query_per_req": spec.num_query_per_req, "verify_len": spec.verify_len,
             "drafter_buffer": list(spec.draft_tokens.shape),
             "verify_buffer": list(spec.verify_drafts.shape)}
    rng = np.random.default_rng(0)
    period = rng.integers(3, 512, size=40).tolist()
    copy = (period * 20)[:300]  # slot 1: a greedy request repeating its prompt
    plain = rng.permutation(np.arange(3, 512))[:120].tolist()  # slot 3: no repeats
    slots = [1, 3]
    hist = {1: copy[:100], 3: plain[:100]}
    temperature = torch.zeros(4)
    temperature[3] = 0.8
    drafter = torch.arange(500, 507).repeat(2, 1)
    out = torch.zeros(2, 15, dtype=torch.int64)
    buffers = InputBuffers(4, 64, device)
    steps = []
    for step, (emitted, count) in enumerate([(1, None), (16, None), (16, 4), (5, 0)]):
        for s in slots:
            src = copy if s == 1 else plain
            if step:
                hist[s] = src[:len(hist[s]) + emitted]
            states.all_token_ids.gpu[s, : len(hist[s])] = torch.tensor(hist[s])
            states.total_len.gpu[s] = len(hist[s])
        batch = dataclasses.replace(
            InputBatch.make_dummy(2, 2, buffers), req_ids=["copy", "plain"],
            idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots),
            is_prefilling_np=np.array([step == 0] * 2), has_prefill=step == 0)
        num_sampled = torch.full((2,), emitted, dtype=torch.int32)
        from vllm.fork.dflash2_config import verify_count

        drafts = spec._fill_from_history(batch, num_sampled, temperature,
                                         verify_count(count, spec.verify_len), drafter, out)
        steps.append({"drafts": drafts.tolist(),
                      "copy_next": copy[len(hist[1]):len(hist[1]) + 15],
                      "plain_last": hist[3][-1],
                      "trust": spec.trust.trust[slots].tolist()})
    return {**shape, "steps": steps}


def cpu_request_states():
    """Upstream's RequestState stages writes through pinned memory, which a machine
    without CUDA lacks; the speculator reads only these two of its tensors."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(
        all_token_ids=SimpleNamespace(gpu=torch.zeros(4, 512, dtype=torch.int32)),
        total_len=SimpleNamespace(gpu=torch.zeros(4, dtype=torch.int32)))


# Per step: the scheduler's count (None: a step that passes none) and, per rank, whether
# its own last step drafted every request from a chain.
RANK_STEPS = [(3, (False, False)), (0, (False, False)), (15, (True, False)),
              (7, (True, True)), (0, (False, True)), (None, (True, False))]


class _Landed:
    """Stands in for the CUDA event the speculator reads its chain flag behind (this
    machine has no CUDA): the copy has always landed."""

    def query(self) -> bool:
        return True

    def record(self) -> None:
        pass


def drive_ranks(target: str, drafter: str) -> dict:
    """KilnDFlash2Speculator.propose() over RANK_STEPS, for one rank and for two ranks
    of --tensor-parallel-size 2 and of --data-parallel-size 2, each rank with its own
    chain state: the steps on which the fork let the drafter's forward run.

    Upstream's propose (Triton input kernels, the drafter's attention metadata) and
    its forward need CUDA: here propose reaches the forward as upstream's does on its
    forward path, and the forward records the step. The fork's code runs as it is."""
    import dataclasses

    import numpy as np
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import DFlash2Speculator

    from vllm.fork.dflash2_speculator import KilnDFlash2Speculator

    def upstream_propose(self, input_batch, *args, **kwargs):
        num_reqs = input_batch.num_reqs
        self._generate_draft(num_reqs, num_reqs * self.num_query_per_req, None, None, None)
        return self.draft_tokens[:num_reqs]

    def forward(self, *args, **kwargs):
        self.forwards.append(self.step)

    DFlash2Speculator.propose = upstream_propose
    DFlash2Speculator._generate_draft = forward
    spec_config = cases(target, drafter)["lookup-v15-k7"]["speculative_config"]
    runs = {"single": dict(), "tp2": dict(tensor_parallel_size=2),
            "dp2": dict(data_parallel_size=2)}
    results = {}
    for name, parallel in runs.items():
        config = EngineArgs(model=target, skip_tokenizer_init=True, max_model_len=512,
                            enforce_eager=True, dtype="bfloat16",
                            speculative_config=spec_config, **parallel).create_engine_config()
        ranks = []
        for rank in range(1 if name == "single" else 2):
            spec = KilnDFlash2Speculator(config, torch.device("cpu"), cpu_request_states())
            spec.forwards = []
            spec._chained_event, spec._chained_host = _Landed(), torch.zeros(1, dtype=torch.bool)
            buffers = InputBuffers(4, 64, torch.device("cpu"))
            slots = [1, 3]
            batch = dataclasses.replace(
                InputBatch.make_dummy(2, 2, buffers), req_ids=["a", "b"],
                idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots),
                is_prefilling_np=np.array([False, False]), has_prefill=False)
            for step, (count, chained) in enumerate(RANK_STEPS):
                spec.step = step
                spec._chained_reqs = frozenset(batch.req_ids)
                spec._chained_host[0] = chained[rank]
                zeros = torch.zeros(4, dtype=torch.int64)
                spec.propose(batch, {}, {}, torch.zeros(2, spec.hidden_size), None,
                             torch.ones(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                             zeros, zeros, torch.zeros(4), zeros,
                             num_speculative_tokens=count)
            ranks.append({"forwards": spec.forwards, "single_rank": spec._single_rank,
                          "verify_len": spec.verify_len})
        results[name] = ranks
    return results


def _split_sizes(fused: str, weights: dict, name: str, part: str) -> list[int]:
    """Row counts of the pieces a fused parameter stacks, from the checkpoint."""
    parts = (".q_proj.", ".k_proj.", ".v_proj.") if fused == ".qkv_proj." else (
        ".gate_proj.", ".up_proj.")
    return [weights[name.replace(part, p)].shape[0] for p in parts]


if __name__ == "__main__":
    sys.exit(main())
