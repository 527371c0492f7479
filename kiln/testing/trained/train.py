"""Training a Qwen3-architecture model from scratch with plain torch: AdamW, linear
warmup then cosine decay to a tenth of the peak rate, gradient clipping at 1, a fixed
seed and a fixed token budget (steps x batch x sequence length).

Determinism: on the CPU the run is float32 with torch's deterministic algorithms on,
so the same spec, corpus and library versions give the same weights, byte for byte.
On CUDA it runs under bf16 autocast; the seed, data order and schedule are the same,
but cuBLAS and attention kernels pick algorithms by GPU and may accumulate in another
order, so the weights may differ between GPUs and between runs (slightly: the
evaluation compares cache dtypes on one set of weights, never across trainings).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.testing.tinymodel.dense import qwen3_fields
from kiln.testing.trained.data import batch, batch_starts
from kiln.testing.trained.spec import TrainSpec

# Progress lines per run (plus the first and last step).
_REPORTS = 40


@dataclass(frozen=True)
class TrainLog:
    steps: tuple[int, ...]  # the steps reported
    losses: tuple[float, ...]  # the training loss at each of them


def model_config(spec: TrainSpec, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**qwen3_fields(spec, tokenizer))


def learning_rate(spec: TrainSpec, step: int) -> float:
    """The rate at ``step`` (0-based): linear warmup, then cosine to lr / 10."""
    warmup = min(spec.warmup_steps, spec.steps - 1)
    if step < warmup:
        return spec.lr * (step + 1) / warmup
    span = max(1, spec.steps - 1 - warmup)
    progress = (step - warmup) / span
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _optimizer(model: Any, spec: TrainSpec) -> Any:
    import torch

    # No weight decay on norms (vectors): decaying them only fights the scale they learn.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def train(spec: TrainSpec, tokenizer: Any, stream_ids: list[int]) -> tuple[Any, TrainLog]:
    """The trained model (float32, on the CPU) and its loss record."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise KilnError("--device cuda: this torch sees no CUDA GPU; pass --device cpu")
    device = torch.device(spec.device)
    stream = torch.tensor(stream_ids, dtype=torch.long)
    starts = batch_starts(len(stream_ids), spec.seq_len, spec.batch_size, spec.steps, spec.seed)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(model_config(spec, tokenizer), dtype=torch.float32)
    model.to(device).train()
    optimizer = _optimizer(model, spec)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())
    every = max(1, spec.steps // _REPORTS)
    reported: list[tuple[int, float]] = []
    tokens_per_step = spec.batch_size * spec.seq_len
    print(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on "
          f"{spec.device}: {spec.steps} steps x {tokens_per_step} tokens "
          f"({len(stream_ids)} in the training split)", flush=True)
    began = last = time.perf_counter()
    with _deterministic(device.type == "cpu"):
        for step in range(spec.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(spec, step)
            inputs, targets = batch(stream, starts[step], spec.seq_len)
            with autocast:
                logits = model(input_ids=inputs.to(device)).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if step % every == 0 or step == spec.steps - 1:
                value = loss.item()
                now = time.perf_counter()
                done = step + 1 - (reported[-1][0] + 1 if reported else 0)
                print(f"step {step + 1}/{spec.steps}  loss {value:.4f}  "
                      f"{done * tokens_per_step / max(now - last, 1e-9):,.0f} tokens/s", flush=True)
                reported.append((step, value))
                last = now
    print(f"trained in {time.perf_counter() - began:.1f}s", flush=True)
    model.to("cpu")
    return model, TrainLog(tuple(s + 1 for s, _ in reported), tuple(v for _, v in reported))
