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
    # after both of upstream's passes, before the finally that restores adaptive verification
    assert source.index("greedy=True") < hook < source.index("finally:")
