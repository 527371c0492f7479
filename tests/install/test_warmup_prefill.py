"""Topic warmup-one-request-prefill on the installed wheel (CPU: the warm-up step itself
runs only on a GPU, through tests/gpu's DFlash2 JIT scenarios)."""
import inspect

import pytest

warmup = pytest.importorskip("vllm.fork.warmup")


def test_the_warmup_prompt_takes_upstreams_2d_path_and_fits_one_step():
    from vllm.v1.attention.ops.triton_unified_attention import MAX_3D_QUERY_LEN

    for k in (0, 3, 7, 15):
        n = warmup.prompt_tokens(1 + k, 8192, 4096)
        # longer than a verify query and than the split (3D) path takes: a 2D prefill
        assert n > max(1 + k, MAX_3D_QUERY_LEN)
    assert warmup.prompt_tokens(8, 12, 4096) == 12  # the step's token budget bounds it
    assert warmup.prompt_tokens(8, 8192, 20) == 12  # and the room left for the verify


def test_upstreams_warmup_calls_it_inside_its_window():
    from vllm.v1.worker.gpu import warmup as upstream

    source = inspect.getsource(upstream.warmup_kernels)
    hook = source.index("warm_one_request_prefill(model_runner")
    # after both of upstream's passes, while adaptive verification is still off: before
    # the finally that restores it (0.33.0), inside the block that does (0.34.0)
    assert source.index("greedy=True") < hook
    if "with _fixed_draft_counts(" in source:
        lines = source.splitlines()
        opens = next(i for i, line in enumerate(lines) if "with _fixed_draft_counts(" in line)
        ends = next(i for i, line in enumerate(lines) if i > opens and line.strip()
                    and len(line) - len(line.lstrip()) <= lines[opens].index("with"))
        assert any("warm_one_request_prefill(" in line for line in lines[opens:ends])
    else:
        assert hook < source.index("finally:")


class _ExtensibleCache:
    """Stands in for 0.34.0's ExtensibleKVCache, which maps CUDA virtual memory and
    cannot be built on the CPU: warm-up may address its first 8 blocks, and commit()
    records what the caller asked to back."""

    warmup_committable_blocks = 8

    def __init__(self):
        self.committed: list[int] = []

    def commit(self, num_blocks: int) -> None:
        self.committed.append(num_blocks)


class _Runner:
    class kv_cache_config:  # noqa: N801 - upstream's attribute name
        num_blocks = 1000

    def __init__(self, extensible: bool):
        if extensible:
            self.extensible_kv_cache = _ExtensibleCache()


def test_an_extensible_cache_bounds_the_warmup_to_its_backed_blocks():
    pytest.importorskip("vllm.v1.worker.extensible_kv_cache")  # 0.34.0 on
    # The 0.33.0-era code compared against kv_cache_config.num_blocks (the final pool),
    # which under 0.34.0's extensible cache is not backed during warm-up.
    runner = _Runner(extensible=True)
    assert warmup.warmup_blocks(runner) == 8
    warmup.commit_blocks(runner, 5)
    assert runner.extensible_kv_cache.committed == [5]
    assert warmup.warmup_blocks(_Runner(extensible=False)) == 1000
