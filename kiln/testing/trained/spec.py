"""What a trained reference model is: ``TrainSpec`` (every field that decides its
bytes) and the named sizes in ``PRESETS``. Standard library only, so the CLI checks
a spec before anything imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from kiln.errors import KilnError

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainSpec:
    """The model's shape, the corpus it reads and the training run."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int  # tokens per training sequence: positions 0..seq_len-1 are trained
    batch_size: int  # sequences per step
    steps: int
    lr: float
    warmup_steps: int
    corpus_bytes: int  # cap on the training split's bytes, taken in sorted path order
    weight_decay: float = 0.1
    seed: int = 0
    # Where it trains. The CPU gives the same bytes on every run; CUDA's kernels do
    # not promise that (see train.py), so the device is part of the folder's hash.
    device: str = "cuda"
    # Room past seq_len in the config, so a full-length prompt plus generated tokens
    # fits; positions past seq_len are untrained.
    max_position_embeddings: int = 4096

    @property
    def tokens(self) -> int:
        """The token budget: every step reads batch_size x seq_len tokens."""
        return self.steps * self.batch_size * self.seq_len


PRESETS: dict[str, TrainSpec] = {
    # 29M (d128) and 36M (d256) parameters, 4.2M of them the tied embedding; 1200 steps
    # of 16 x 2048 tokens = 39M tokens, about 4 passes over the standard library's ~9M.
    "d128": TrainSpec(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=4,
                      num_kv_heads=2, head_dim=128, vocab_size=8192, seq_len=2048,
                      batch_size=16, steps=1200, lr=1.5e-3, warmup_steps=100,
                      corpus_bytes=64 << 20),
    "d256": TrainSpec(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=4,
                      num_kv_heads=2, head_dim=256, vocab_size=8192, seq_len=2048,
                      batch_size=16, steps=1200, lr=1.5e-3, warmup_steps=100,
                      corpus_bytes=64 << 20),
    # The CPU tests' size: trains a few steps in seconds.
    "tiny": TrainSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=32, vocab_size=512, seq_len=128,
                      batch_size=4, steps=8, lr=3e-3, warmup_steps=2,
                      corpus_bytes=256 << 10, max_position_embeddings=512, device="cpu"),
}


def preset(name: str, **overrides: Any) -> TrainSpec:
    if name not in PRESETS:
        raise KilnError(f"--size {name}: unknown size; allowed: {', '.join(PRESETS)}")
    spec = replace(PRESETS[name], **overrides)
    validate(spec)
    return spec


def validate(spec: TrainSpec) -> None:
    """Refuse a spec that cannot train, naming the CLI flag behind the field."""
    if spec.steps < 1:
        raise KilnError(f"--steps {spec.steps}: must be at least 1")
    if spec.corpus_bytes < 1:
        raise KilnError(f"--corpus-bytes {spec.corpus_bytes}: must be at least 1")
    if spec.device not in DEVICES:
        raise KilnError(f"--device {spec.device}: allowed: {', '.join(DEVICES)}")
    if spec.num_heads % spec.num_kv_heads:
        raise KilnError(f"{spec.num_kv_heads} KV heads must divide {spec.num_heads} heads")
    if spec.seq_len > spec.max_position_embeddings:
        raise KilnError(f"sequence length {spec.seq_len} exceeds the model's "
                        f"{spec.max_position_embeddings} positions")


def spec_dict(spec: TrainSpec) -> dict[str, Any]:
    return asdict(spec)


def spec_from_dict(data: dict[str, Any]) -> TrainSpec:
    return TrainSpec(**data)
