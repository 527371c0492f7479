"""prompt-progress through upstream's real OutputProcessor in the installed fork."""

import pytest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor

from vllm import SamplingParams


def _request(request_id: str, prompt_len: int, opt_in: bool = True) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA,
                            extra_args={"return_progress": True} if opt_in else None)
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(range(prompt_len)), mm_features=None,
        sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None,
        cache_salt=None, data_parallel_rank=None, external_req_id=request_id,
    )


@pytest.fixture
def processor() -> OutputProcessor:
    proc = OutputProcessor(tokenizer=None, log_stats=True)
    proc.add_request(_request("r1", 1000), prompt=None)
    return proc


def test_progress_reaches_the_request_output_as_num_computed_tokens(processor):
    outputs = []
    for computed in (256, 512, 768):
        result = processor.process_outputs(
            [EngineCoreOutput(request_id="r1", new_token_ids=[], num_computed_tokens=computed)])
        outputs += result.request_outputs
    assert [o.num_computed_tokens for o in outputs] == [256, 512, 768]
    for output in outputs:
        assert isinstance(output, RequestOutput)
        assert not output.finished
        assert output.outputs[0].token_ids == []
        # 0.32 put an `error` parameter where the count is added: it must stay unset.
        assert getattr(output, "error", None) is None


def test_progress_leaves_the_prefill_phase_running(processor):
    processor.process_outputs(
        [EngineCoreOutput(request_id="r1", new_token_ids=[], num_computed_tokens=256)])
    assert processor.request_states["r1"].is_prefilling
    result = processor.process_outputs(
        [EngineCoreOutput(request_id="r1", new_token_ids=[11, 12])])
    assert not processor.request_states["r1"].is_prefilling
    (output,) = result.request_outputs
    assert output.outputs[0].token_ids == [11, 12]
    assert output.num_computed_tokens is None


def test_the_finished_request_is_unaffected(processor):
    result = processor.process_outputs(
        [EngineCoreOutput(request_id="r1", new_token_ids=[5], finish_reason=FinishReason.LENGTH)])
    (output,) = result.request_outputs
    assert output.finished and output.outputs[0].finish_reason == "length"
    assert "r1" not in processor.request_states


def test_the_chat_chunk_serializes_as_the_sse_event(processor):
    """0.33.0's chat stream yields chunk objects and dumps them itself (exclude_unset,
    and exclude_none for a chunk without choices): the text must be the event's."""
    import json

    from vllm.fork.prompt_progress import progress_chunk, progress_event

    (output,) = processor.process_outputs(
        [EngineCoreOutput(request_id="r1", new_token_ids=[], num_computed_tokens=512)]
    ).request_outputs
    args = (output, "chatcmpl-1", "tiny", 1700000000, "chat.completion.chunk")
    chunk = progress_chunk(*args)
    dumped = json.loads(chunk.model_dump_json(exclude_unset=True, exclude_none=not chunk.choices))
    event = progress_event(*args)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert dumped == json.loads(event[len("data: "):])
    assert dumped["prompt_progress"] == {"total": 1000, "processed": 512}
    assert dumped["choices"] == [] and dumped["object"] == "chat.completion.chunk"
