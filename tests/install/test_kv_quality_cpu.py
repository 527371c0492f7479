"""bench/kv_quality.py on the installed fork's CPU path, on the tiny trained model:
vLLM loads the folder's config, and the bench's bf16-row perplexity (here float32:
the CPU tier's dtype) is the one transformers computes on the same held-out windows."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.paths import REPO_ROOT
from kiln.testing.trained import build, held_out_files, preset

WINDOWS, WIDTH, LATE = 3, 192, 96


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build("tiny", preset("tiny"), parent=tmp_path_factory.mktemp("trained"))


def test_vllm_reads_the_folders_config(model):
    from vllm.transformers_utils.config import get_config

    config = get_config(str(model), trust_remote_code=False)
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (32, 1, 512)


def _transformers_perplexity(model: Path, start: int) -> float:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from kiln.testing.trained.data import token_stream
    from kiln.testing.trained.metrics import windows
    from kiln.testing.trained.tokenizer import separator_id

    root, files = held_out_files(model)
    texts = [(root / f.path).read_bytes().decode("utf-8", errors="replace") for f in files]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    wins = windows(token_stream(tokenizer, texts, separator_id(tokenizer)), WIDTH, WINDOWS)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in wins:
            logits = hf(input_ids=torch.tensor([w])).logits[0, :-1].double()
            logprobs = torch.log_softmax(logits, -1)
            picked = logprobs[torch.arange(WIDTH - 1), torch.tensor(w[1:])][start - 1:]
            nll -= picked.sum().item()
            count += picked.numel()
    return math.exp(nll / count)


def test_the_bench_runs_on_the_cpu_and_its_perplexity_is_transformers(model, tmp_path):
    out = tmp_path / "quality.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "kv_quality.py"), str(model),
         "--dtypes", "auto", "--windows", str(WINDOWS), "--window", str(WIDTH),
         "--late-from", str(LATE), "--needles", "2", "--model-dtype", "float32",
         "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert row["dtype"] == "auto" and row["needle_probes"] == 2
    assert (row["ratio"], row["agreement"], row["agreement_late"]) == (1.0, 1.0, 1.0)
    assert row["perplexity"] == pytest.approx(_transformers_perplexity(model, 1), rel=1e-3)
    assert row["perplexity_late"] == pytest.approx(_transformers_perplexity(model, LATE), rel=1e-3)
    assert data["setup"]["needle_context"] == preset("tiny").seq_len
    assert "auto" in result.stdout and "A ~30M-parameter model" in result.stdout


def test_an_unknown_dtype_is_one_error_line(model):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "kv_quality.py"), str(model),
         "--dtypes", "auto,int3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(
        "kv_quality: error: --dtypes int3: not a KV-cache dtype of this vLLM; allowed: auto, ")


def test_the_bench_takes_the_forks_kvarn_presets_and_names_them_when_refusing():
    """The GPU run of 2026-12-07 refused every KVarN preset: the bench checked names
    against upstream's CacheDType literal, which the fork's registered presets are not in."""
    import importlib.util

    from kiln.errors import KilnError

    spec = importlib.util.spec_from_file_location("kv_quality", REPO_ROOT / "bench" /
                                                  "kv_quality.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.dtype_list("kvarn_k4v2_g128,fp8,auto,kvarn_k4v4_g64") == [
        "auto", "kvarn_k4v2_g128", "fp8", "kvarn_k4v4_g64"]
    with pytest.raises(KilnError, match=r"--dtypes int3: .*allowed: .*kvarn_k4v2_g128"):
        bench.dtype_list("int3")
