"""A tiny random DFlash2 drafter (vLLM's ``DFlash2DraftModel``, speculative method
"dflash") for a target model folder: its spec, its config and tensor shapes taken from
the target's config, and its build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.paths import cache_dir
from kiln.testing.tinymodel.folder import library_versions, write_json
from kiln.testing.tinymodel.spec import DTYPES
from kiln.testing.tinymodel.stampedfolder import StampedFolder
from kiln.testing.tinymodel.tensors import Entry, tensor_seed, write_safetensors

DRAFTER_STAMP = "kiln-dflash2-drafter.json"
# Every file a drafter build writes.
DRAFTER_FILES = frozenset({"config.json", "model.safetensors", DRAFTER_STAMP})
DRAFTER_GENERATOR_VERSION = 1


@dataclass(frozen=True)
class DrafterSpec:
    """A random DFlash2 drafter (vLLM's ``DFlash2DraftModel``, method ``dflash``).

    Its embedding and lm_head are the target's (vLLM shares them at load), so the
    drafter's hidden size, heads and vocabulary are the target's; only these vary.
    """

    # Query tokens the drafter was trained on per request: the anchor + block_size - 1
    # mask tokens, so at most block_size - 1 speculative tokens.
    block_size: int = 16
    conv_group_size: int = 16
    conv_kernel_size: int = 3
    selector_rank: int = 8
    selector_top_k: int = 4
    num_layers: int = 1
    # Target layers whose outputs feed the drafter; None: all of them.
    target_layer_ids: tuple[int, ...] | None = None
    # None: the target's pad token.
    mask_token_id: int | None = None
    initializer_range: float = 0.02
    seed: int = 0


DRAFTER_FLAGS = {
    "block_size": "--block-size",
    "conv_group_size": "--conv-group-size",
    "conv_kernel_size": "--conv-kernel-size",
    "selector_rank": "--selector-rank",
    "selector_top_k": "--selector-top-k",
    "num_layers": "--layers",
    "target_layer_ids": "--target-layer-ids",
    "mask_token_id": "--mask-token-id",
}


def _target_config(target: Path) -> dict[str, Any]:
    path = Path(target) / "config.json"
    if not path.is_file():
        raise KilnError(f"--target {target}: no config.json there (pass a model folder)")
    config = json.loads(path.read_text())
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise KilnError(f"--target {target}: config.json has no integer {key}")
    return config


def validate_drafter(spec: DrafterSpec, target: dict[str, Any]) -> None:
    """Raise KilnError naming the flag, the value and what is allowed."""
    for name in ("block_size", "conv_group_size", "conv_kernel_size", "selector_rank",
                 "selector_top_k", "num_layers"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise KilnError(f"{DRAFTER_FLAGS[name]} {value}: must be a positive whole number")
    hidden = target["hidden_size"]
    if hidden % spec.conv_group_size:
        raise KilnError(
            f"--conv-group-size {spec.conv_group_size}: must divide the hidden size "
            f"{hidden} (the drafter's hidden size is the target's); divisors up to 64: "
            f"{', '.join(str(g) for g in range(1, 65) if hidden % g == 0)}")
    if spec.block_size < 2:
        raise KilnError(f"--block-size {spec.block_size}: must be >= 2 (the anchor and "
                        "at least one mask token)")
    if spec.conv_kernel_size > spec.block_size:
        raise KilnError(f"--conv-kernel-size {spec.conv_kernel_size}: must be at most "
                        f"--block-size ({spec.block_size}); the convolution runs within a block")
    vocab = target["vocab_size"]
    if spec.selector_top_k > vocab:
        raise KilnError(f"--selector-top-k {spec.selector_top_k}: must be at most the "
                        f"target's vocabulary ({vocab})")
    layers = target["num_hidden_layers"]
    ids = spec.target_layer_ids
    if ids is not None and (not ids or list(ids) != sorted(set(ids)) or ids[0] < 0
                            or ids[-1] >= layers):
        raise KilnError(
            f"--target-layer-ids {','.join(map(str, ids))}: must be distinct, "
            f"increasing target layer indices in 0..{layers - 1}")
    mask = spec.mask_token_id
    if mask is not None and not 0 <= mask < vocab:
        raise KilnError(f"--mask-token-id {mask}: must be a token id in 0..{vocab - 1}")


def _drafter_layout(spec: DrafterSpec, target: dict[str, Any]) -> dict[str, Any]:
    heads = target["num_attention_heads"]
    hidden = target["hidden_size"]
    ids = list(spec.target_layer_ids or range(target["num_hidden_layers"]))
    mask = spec.mask_token_id
    if mask is None:
        mask = target.get("pad_token_id") or 0
    return dict(
        hidden=hidden, heads=heads, kv_heads=target.get("num_key_value_heads") or heads,
        head_dim=target.get("head_dim") or hidden // heads,
        intermediate=target.get("intermediate_size") or 2 * hidden,
        vocab=target["vocab_size"], target_layer_ids=ids, mask_token_id=mask,
        groups=hidden // spec.conv_group_size,
    )


def drafter_config(spec: DrafterSpec, target: dict[str, Any]) -> dict[str, Any]:
    """The drafter's config.json: a Qwen3 config with vLLM's DFlash2 keys."""
    lay = _drafter_layout(spec, target)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "hidden_size": lay["hidden"],
        "intermediate_size": lay["intermediate"],
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": lay["heads"],
        "num_key_value_heads": lay["kv_heads"],
        "head_dim": lay["head_dim"],
        "vocab_size": lay["vocab"],
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": target.get("dtype") or target.get("torch_dtype") or "bfloat16",
        "dflash_config": {
            "block_size": spec.block_size,
            "conv_group_size": spec.conv_group_size,
            "conv_kernel_size": spec.conv_kernel_size,
            "mask_token_id": lay["mask_token_id"],
            "target_layer_ids": lay["target_layer_ids"],
            "selector_rank": spec.selector_rank,
            "selector_top_k": spec.selector_top_k,
        },
    }
    if "rope_parameters" in target:
        config["rope_parameters"] = target["rope_parameters"]
    return config


def drafter_shapes(spec: DrafterSpec, target: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the drafter's checkpoint, named as DFlash checkpoints name them
    (no ``model.`` prefix; vLLM's loader adds it), with no embedding or lm_head."""
    lay = _drafter_layout(spec, target)
    d, D, taps = lay["hidden"], lay["head_dim"], spec.conv_kernel_size
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (lay["heads"] * D, d)),
            (p + "self_attn.k_proj.weight", (lay["kv_heads"] * D, d)),
            (p + "self_attn.v_proj.weight", (lay["kv_heads"] * D, d)),
            (p + "self_attn.o_proj.weight", (d, lay["heads"] * D)),
            (p + "self_attn.q_norm.weight", (D,)),
            (p + "self_attn.k_norm.weight", (D,)),
            (p + "post_attention_layernorm.weight", (d,)),
            (p + "mlp.gate_proj.weight", (lay["intermediate"], d)),
            (p + "mlp.up_proj.weight", (lay["intermediate"], d)),
            (p + "mlp.down_proj.weight", (d, lay["intermediate"])),
        ]
        for conv in ("attention_conv", "mlp_conv"):
            shapes += [
                (p + f"{conv}.base_kernel", (2, taps, d)),
                (p + f"{conv}.kernel_projection.weight", (2 * taps * lay["groups"], d)),
            ]
    shapes += [
        ("fc.weight", (d, d * len(lay["target_layer_ids"]))),
        ("hidden_norm.weight", (d,)),
        ("norm.weight", (d,)),
        ("candidate_selector.predecessor_codebook", (lay["vocab"], spec.selector_rank)),
        ("candidate_selector.successor_codebook", (lay["vocab"], spec.selector_rank)),
        ("candidate_selector.hidden_projection.weight", (spec.selector_rank, d)),
    ]
    return shapes


def _drafter_entries(spec: DrafterSpec, target: dict[str, Any]) -> list[Entry]:
    """Norm weights one; the first tap of each convolution's base kernel one (so a
    block position starts from its own input); the rest normal(0, range), seeded
    per tensor."""
    import torch

    def make(name: str, shape: tuple[int, ...]) -> Callable[[], Any]:
        if name.endswith("norm.weight"):
            return lambda: torch.ones(shape)

        def draw() -> Any:
            gen = torch.Generator().manual_seed(tensor_seed(spec.seed, "dflash2:" + name))
            out = torch.empty(shape).normal_(0.0, spec.initializer_range, generator=gen)
            if name.endswith("base_kernel"):
                out[:, 0] += 1.0
            return out

        return draw

    return [(n, s, make(n, s)) for n, s in drafter_shapes(spec, target)]


def drafter_folder(out: Path) -> StampedFolder:
    return StampedFolder(out, DRAFTER_STAMP, DRAFTER_FILES, "DFlash2 drafter")


def drafter_fingerprint(spec: DrafterSpec, target_config_bytes: bytes) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(target_config_bytes)
    h.update(json.dumps(library_versions(), sort_keys=True).encode())
    h.update(f"drafter-{DRAFTER_GENERATOR_VERSION}".encode())
    return h.hexdigest()[:16]


def build_dflash2_drafter(target: Path, out: Path | None = None,
                          spec: DrafterSpec | None = None) -> Path:
    """Write a random DFlash2 drafter for the model in ``target`` into ``out``
    (default: under kiln's cache); return it. Reused when already built."""
    spec = spec or DrafterSpec()
    target = Path(target)
    config_path = target / "config.json"
    target_config = _target_config(target)
    validate_drafter(spec, target_config)
    print_ = drafter_fingerprint(spec, config_path.read_bytes())
    out = (out or cache_dir() / "tiny-model" / f"dflash2-{print_}").resolve()
    folder = drafter_folder(out)
    if folder.holds(print_):
        return out
    folder.check_replaceable()
    if importlib.util.find_spec("torch") is None:
        raise KilnError(f"the drafter needs torch in this Python ({sys.executable})")
    dtype = str(target_config.get("dtype") or target_config.get("torch_dtype") or "bfloat16")
    if dtype not in DTYPES:
        raise KilnError(f"--target {target}: dtype {dtype} is not one of {', '.join(DTYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".drafter-", dir=out.parent))
    try:
        write_json(tmp / "config.json", drafter_config(spec, target_config))
        write_safetensors(tmp / "model.safetensors", _drafter_entries(spec, target_config),
                           dtype)
        write_json(tmp / DRAFTER_STAMP, {"fingerprint": print_, "spec": asdict(spec),
                                          "target": str(target.resolve())})
        folder.replace_with(tmp)
    finally:
        # Never masks the error that ended the build.
        shutil.rmtree(tmp, ignore_errors=True)
    return out
