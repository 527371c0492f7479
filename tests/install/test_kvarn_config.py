"""KVarN cache dtypes in the installed fork (VLLM_TARGET_DEVICE=cpu, HF offline).

The engine config is built by upstream's own EngineArgs.create_engine_config for a
tiny local Qwen3 config; the page size by the real Attention layer (the CPU platform
hands kvarn dtypes to the KVARN backend) and upstream's customize_attention_spec.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import tarfile
from pathlib import Path
from typing import get_args

import pytest
import torch
from vllm.config.cache import CacheDType
from vllm.engine.arg_utils import EngineArgs
from vllm.kvarn import Preset
from vllm.model_executor.layers.attention.attention import Attention
from vllm.plugins import load_general_plugins
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

from vllm.fork.kvarn_backend import PRESET_BACKENDS, _spec_preset

# As vLLM does in every process before it reads a cache dtype.
load_general_plugins()

VLLM = str(Path(sys.executable).with_name("vllm"))
PRESETS = ("kvarn_k4v2_g128", "kvarn_k4v4_g128", "kvarn_k4v2_g64", "kvarn_k4v4_g64")
NUM_KV_HEADS = 2


def _tiny_qwen3(path: Path, head_dim: int = 128, dtype: str = "bfloat16",
                num_heads: int = 4, num_kv_heads: int = NUM_KV_HEADS) -> str:
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=head_dim,
                max_position_embeddings=1024, torch_dtype=dtype).save_pretrained(path)
    return str(path)


def _engine_config(model: str, kv_cache_dtype: str, **kwargs):
    return EngineArgs(model=model, skip_tokenizer_init=True, kv_cache_dtype=kv_cache_dtype,
                      max_model_len=512, **kwargs).create_engine_config()


@contextlib.contextmanager
def _model_init(config):
    """As the model loader builds layers: current config, model dtype as default."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
        yield


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return _tiny_qwen3(tmp_path_factory.mktemp("qwen3-d128"))


def test_the_presets_are_cache_dtypes_stored_as_bytes():
    assert Preset.names() == PRESETS
    # upstream's registry, no edit of the CacheDType literal
    from vllm.config.cache import KV_CACHE_DTYPES, get_kv_cache_dtype_handler

    assert not [name for name in get_args(CacheDType) if name.startswith("kvarn_")]
    assert [name for name in KV_CACHE_DTYPES if name.startswith("kvarn_")] == list(PRESETS)
    assert all(get_kv_cache_dtype_handler(name).name == name for name in PRESETS)
    assert all(STR_DTYPE_TO_TORCH_DTYPE[name] == torch.uint8 for name in PRESETS)


def test_registered_presets_use_the_custom_quant_mode():
    assert all(get_kv_quant_mode(name) == KVQuantMode.CUSTOM for name in PRESETS)
    assert get_kv_quant_mode("auto") == KVQuantMode.NONE


def _quant_mode_values(source: str) -> dict[str, int]:
    """Members of KVQuantMode as the source assigns them (aliases included)."""
    (cls,) = [n for n in ast.walk(ast.parse(source))
              if isinstance(n, ast.ClassDef) and n.name == "KVQuantMode"]
    values: dict[str, int] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            target, value = stmt.targets[0].id, stmt.value
            if isinstance(value, ast.Constant) and isinstance(value.value, int):
                values[target] = value.value
            elif isinstance(value, ast.Name) and value.id in values:
                values[target] = values[value.id]
    return values


def _pristine_quant_modes(version: str) -> dict[str, int]:
    from kiln.upstream.fetch import fetch

    files = fetch(version, log=lambda _: None)
    with tarfile.open(files.sdist) as tar:
        member = next(m for m in tar.getmembers()
                      if m.name.endswith("/vllm/v1/kv_cache_interface.py"))
        return _quant_mode_values(tar.extractfile(member).read().decode())


def test_the_installed_quant_modes_are_pristine():
    """No KVarN edit of upstream's KVQuantMode: the presets go through the registry."""
    from vllm.fork.identity import fork_identity

    upstream = _pristine_quant_modes(fork_identity().upstream_version)
    assert upstream.get("CUSTOM") == 12, "KVQuantMode is not what the spec says"
    assert {name: m.value for name, m in KVQuantMode.__members__.items()} == upstream


@pytest.mark.parametrize("name", ["kvarn_k4v2_g128", "kvarn_k4v4_g64"])
def test_engine_config_block_size_page_size_and_quant_mode(model, name):
    from vllm.v1.worker.utils import customize_attention_spec

    preset = Preset.parse(name)
    config = _engine_config(model, name)
    assert config.cache_config.cache_dtype == name
    assert config.cache_config.block_size == preset.group
    with _model_init(config):
        layer = Attention(4, 128, 128**-0.5, NUM_KV_HEADS, cache_config=config.cache_config,
                          prefix=f"model.layers.0.self_attn.{name}")
        backend = layer.get_attn_backend()
        spec = customize_attention_spec(backend, layer.get_kv_cache_spec(config))
    assert backend.get_name() == "KVARN" and backend.preset == preset
    assert spec.kv_quant_mode == get_kv_quant_mode(name)
    assert _spec_preset(spec, backend.preset) == preset
    assert spec.dtype == torch.uint8 and spec.block_size == preset.group
    assert spec.page_size_bytes == NUM_KV_HEADS * preset.tile_bytes(128)
    assert backend.get_supported_kernel_block_sizes(spec) == [preset.group]


def test_each_layers_backend_answers_for_its_own_preset_outside_any_config(model):
    # Model Runner V2 customizes a layer's spec outside any current config, after every
    # layer exists; a process-wide "preset of the last layer built" gave each layer the
    # last one's page.
    from vllm.v1.worker.utils import customize_attention_spec

    built = {}
    for name in ("kvarn_k4v2_g128", "kvarn_k4v4_g64"):
        config = _engine_config(model, name)
        with _model_init(config):
            layer = Attention(4, 128, 128**-0.5, NUM_KV_HEADS, cache_config=config.cache_config,
                              prefix=f"model.layers.0.self_attn.own_{name}")
        built[name] = layer.get_attn_backend(), layer.get_kv_cache_spec(config)
    assert {name: cls.preset.name for name, cls in PRESET_BACKENDS.items()} == {
        name: name for name in PRESETS}
    for name, (backend, raw) in built.items():
        preset = Preset.parse(name)
        assert backend is PRESET_BACKENDS[name]
        spec = customize_attention_spec(backend, raw)
        assert spec.page_size_bytes == NUM_KV_HEADS * preset.tile_bytes(128), name
        assert backend.get_supported_kernel_block_sizes(spec) == [preset.group], name


def test_sliding_window_layers_stay_in_model_dtype(model):
    config = _engine_config(model, "kvarn_k4v2_g128")
    with _model_init(config):
        layer = Attention(4, 128, 128**-0.5, NUM_KV_HEADS, cache_config=config.cache_config,
                          per_layer_sliding_window=64, prefix="model.layers.1.self_attn.sw")
    assert layer.kv_cache_dtype == "auto"
    assert layer.kv_cache_torch_dtype == torch.bfloat16
    assert layer.get_attn_backend().get_name() != "KVARN"


def test_an_explicit_block_size_other_than_g_is_refused(model):
    with pytest.raises(ValueError, match=r"--block-size 64 .*kvarn_k4v2_g128.* must be 128"):
        _engine_config(model, "kvarn_k4v2_g128", block_size=64)
    assert _engine_config(model, "kvarn_k4v2_g64", block_size=64).cache_config.block_size == 64


def test_an_unsupported_head_dim_is_refused(tmp_path):
    model = _tiny_qwen3(tmp_path, head_dim=96)
    with pytest.raises(ValueError, match=r"head dim 96 .*allowed head dims: 64, 128, 256, 512"):
        _engine_config(model, "kvarn_k4v2_g128")


def test_an_fp32_model_dtype_is_refused(tmp_path):
    model = _tiny_qwen3(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=r"model dtype torch.float32 .*allowed: float16, bfloat16"):
        _engine_config(model, "kvarn_k4v2_g128", dtype="float32")
