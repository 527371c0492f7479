"""Which CPU runner serves where Triton is unusable (topic cpu-fallback-ops, vLLM >= 0.34.0).

This host is CI's: x86, the CUDA wheel (no compiled CPU extension) and a CUDA build
of Triton with no GPU driver, so vLLM's HAS_TRITON is False. 0.34.0's CpuPlatform
refuses x86 without Triton; the fork takes upstream's standalone CPU runner there,
on the stand-ins, unless a compiled CPU extension is loaded.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.platforms import CpuArchEnum, current_platform

# The class, not the instance: a platform instance answers None for unknown names.
pytestmark = pytest.mark.skipif(
    not hasattr(type(current_platform), "uses_standalone_cpu_model_runner"),
    reason="before 0.34.0 the CPU platform serves through the GPU runner without Triton",
)


def _tiny_qwen3(path: Path) -> str:
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=1024, torch_dtype="float32").save_pretrained(path)
    return str(path)


def _engine_config(model: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=512,
                      enforce_eager=True).create_engine_config()


def test_this_host_is_x86_without_triton_and_without_the_cpu_extension():
    from vllm.triton_utils import HAS_TRITON

    from vllm.fork.cpu_fallback_ops import serves_without_triton

    assert current_platform.is_cpu()
    assert current_platform.get_cpu_architecture() == CpuArchEnum.X86
    assert not HAS_TRITON
    assert serves_without_triton(type(current_platform))


def test_x86_without_triton_takes_the_standalone_runner_and_builds_a_config(tmp_path):
    assert current_platform.uses_standalone_cpu_model_runner()
    # Upstream 0.34.0 raises "vLLM on x86 CPUs requires Triton" here.
    config = _engine_config(_tiny_qwen3(tmp_path / "model"))
    assert config.model_config.max_model_len == 512


def test_a_loaded_cpu_extension_keeps_upstreams_triton_rule(tmp_path):
    """Where the compiled extension defined its ops first, nothing stands in
    and x86 without Triton is refused as upstream refuses it."""
    model = _tiny_qwen3(tmp_path / "model")
    # A fresh process: the ops torch.ops._C holds are process-wide. The op the
    # CPU extension always defines is defined first, as loading it would.
    script = textwrap.dedent(f"""
        import torch
        compiled = torch.library.Library("_C", "FRAGMENT")
        compiled.define("init_cpu_memory_env(SymInt[] node_ids) -> ()")
        compiled.impl("init_cpu_memory_env", lambda node_ids: None, "CompositeExplicitAutograd")

        from vllm.engine.arg_utils import EngineArgs
        from vllm.fork.cpu_fallback_ops import serves_without_triton
        from vllm.platforms import current_platform

        print("serves_without_triton", serves_without_triton(type(current_platform)))
        print("standalone", current_platform.uses_standalone_cpu_model_runner())
        try:
            EngineArgs(model={model!r}, skip_tokenizer_init=True,
                       max_model_len=512).create_engine_config()
        except RuntimeError as e:
            print("refused", e)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "serves_without_triton False" in lines
    assert "standalone False" in lines
    assert "refused vLLM on x86 CPUs requires Triton (triton-cpu)." in lines
