"""Run by test_kvarn_tp.py, once per rank of a two-process world:

    python kvarn_tp_child.py RANK INIT_FILE OUT_JSON MODEL...

Each rank builds the engine config with upstream's EngineArgs(...).create_engine_config()
at --tensor-parallel-size 2, joins a world of 2 on gloo with vLLM's own parallel state,
and builds each model's two attention layers with vLLM's Qwen3Attention, which splits
the KV heads over the ranks and hands the KVARN impl its per-rank count. It records
what each rank got: heads, its side pool and prefill scratch as the profiling run
reserves them from the workspace manager, its page size, and the KV cache config
upstream's planner makes from both ranks' specs (gathered over gloo, as the engine
core gathers them from its workers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TP = 2
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 512
KV_MEMORY = 64 * 2**20  # bytes each rank offers the KV cache planner
PRESET = "kvarn_k4v2_g128"


def engine_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, kv_cache_dtype=PRESET,
                      max_model_len=512, tensor_parallel_size=TP,
                      max_num_seqs=MAX_NUM_SEQS,
                      max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS).create_engine_config()


def fits(ws, *shapes) -> bool:
    """Whether the locked workspace's scratch holds these fp16 tensors without growing."""
    import torch

    try:
        ws.get_simultaneous(*((shape, torch.float16) for shape in shapes))
    except AssertionError:
        return False
    return True


def rank_layers(config) -> dict:
    import torch
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.qwen3 import Qwen3Attention
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.worker.utils import customize_attention_spec
    from vllm.v1.worker.workspace import (
        current_workspace_manager,
        init_workspace_manager,
        reset_workspace_manager,
    )

    hf = config.model_config.hf_config
    reset_workspace_manager()
    init_workspace_manager(torch.device("cpu"))
    layers, specs = [], {}
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        for i in range(hf.num_hidden_layers):
            module = Qwen3Attention(hf.hidden_size, hf.num_attention_heads,
                                    hf.num_key_value_heads, hf.rope_parameters,
                                    head_dim=hf.head_dim, cache_config=config.cache_config,
                                    prefix=f"model.layers.{i}.self_attn")
            attn = module.attn
            spec = customize_attention_spec(attn.get_attn_backend(),
                                            attn.get_kv_cache_spec(config))
            specs[attn.layer_name] = spec
            impl = attn.impl
            # The profiling run's forward (no metadata): it reserves the layer's side
            # pool and the shared prefill scratch, then attends to nothing.
            n, d = 4, hf.head_dim
            query = torch.zeros(n, module.num_heads * d, dtype=torch.bfloat16)
            kv = torch.zeros(n, module.num_kv_heads * d, dtype=torch.bfloat16)
            kv_cache = torch.zeros(2 * spec.page_size_bytes, dtype=torch.uint8)
            impl.forward(attn, query, kv, kv, kv_cache, None, torch.empty_like(query))
            layers.append((module, attn, impl, kv_cache, spec))
    ws = current_workspace_manager()
    ws.lock()  # from here any reservation the profile missed raises
    out = []
    for module, attn, impl, kv_cache, spec in layers:
        paged, _ = impl._pools(attn, kv_cache)
        g, d, h = spec.block_size, spec.head_size, module.num_kv_heads
        blocks = impl.scratch_blocks
        out.append({
            "name": attn.layer_name, "backend": attn.get_attn_backend().get_name(),
            "module_kv_heads": h, "impl_kv_heads": impl.num_kv_heads,
            "qkv_rows": module.qkv_proj.weight.shape[0],
            "side_shape": list(paged.side.shape), "side_dtype": str(paged.side.dtype),
            "page_size_bytes": spec.page_size_bytes, "block_size": g,
            "scratch_blocks": blocks,
            "scratch_fits": fits(ws, (blocks, g, h, d), (blocks, g, h, d)),
            "scratch_fits_one_more_block": fits(ws, (blocks + 1, g, h, d),
                                                (blocks + 1, g, h, d)),
            "scratch_fits_all_heads": fits(ws, (blocks, g, hf.num_key_value_heads, d),
                                           (blocks, g, hf.num_key_value_heads, d)),
        })
    layouts = [layout.name for layout in attn.get_attn_backend().supported_kv_cache_layouts()]
    everyone: list = [None] * TP
    dist.all_gather_object(everyone, (specs, layouts))
    specs_by_rank = [rank_specs for rank_specs, _ in everyone]
    # As the engine core does before it plans: one layout for the whole model.
    resolve_kv_cache_layout(config, [rank_layouts for _, rank_layouts in everyone],
                            [s for rank_specs in specs_by_rank for s in rank_specs.values()])
    groups = get_global_kv_cache_groups(config, specs_by_rank)
    plans = get_kv_cache_configs(config, specs_by_rank, [KV_MEMORY] * TP, groups)
    return {"layers": out, "pool_blocks": [p.num_blocks for p in plans]}


def main() -> int:
    rank, init_file, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        init_distributed_environment,
        initialize_model_parallel,
    )

    configs = {model: engine_config(model) for model in sys.argv[4:]}
    with set_current_vllm_config(next(iter(configs.values()))):
        init_distributed_environment(world_size=TP, rank=rank, local_rank=rank,
                                     backend="gloo",
                                     distributed_init_method=f"file://{init_file}")
        initialize_model_parallel(TP, 1)
    results = {"tp_rank": get_tensor_model_parallel_rank(),
               "models": {model: rank_layers(config)
                          for model, config in configs.items()}}
    Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
