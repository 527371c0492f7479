"""Prompt progress: outputs that report how far a long prefill has come.

A request opts in with ``return_progress`` in its sampling params' extra_args
(``"vllm_xargs": {"return_progress": true}`` in the OpenAI API). The scheduler
then emits, for each prefill chunk that does not finish the prompt, an output
with no tokens and the request's ``num_computed_tokens``; the output processor
turns it into a RequestOutput carrying that count, without ending the request's
prefill phase; the streaming chat and completion endpoints send it as an event
with ``prompt_progress``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from vllm.v1.engine import EngineCoreOutput

if TYPE_CHECKING:
    from vllm.outputs import PoolingRequestOutput, RequestOutput
    from vllm.v1.engine.output_processor import RequestState
    from vllm.v1.request import Request

OPT_IN = "return_progress"


def wants_progress(request: Request) -> bool:
    params = request.sampling_params
    return bool(params is not None and params.extra_args and params.extra_args.get(OPT_IN))


def progress_output(request: Request) -> EngineCoreOutput | None:
    """The scheduler's output for a prefill chunk that left the prompt unfinished."""
    if not wants_progress(request) or request.num_computed_tokens >= request.num_prompt_tokens:
        return None
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        num_computed_tokens=request.num_computed_tokens,
    )


def is_progress(output: EngineCoreOutput) -> bool:
    return (
        output.num_computed_tokens is not None
        and not output.new_token_ids
        and output.finish_reason is None
    )


def deliver_progress(
    state: RequestState,
    output: EngineCoreOutput,
    request_outputs: list[RequestOutput | PoolingRequestOutput],
) -> None:
    """Hand the count on like any output, leaving the request's prefill phase running."""
    progress = state.make_request_output(
        [], None, None, None, num_computed_tokens=output.num_computed_tokens
    )
    if progress is None:
        return
    if state.queue is not None:
        state.queue.put(progress)
    else:
        request_outputs.append(progress)


def _progress_fields(
    output: RequestOutput, request_id: str, model: str, created: int, object_type: str
) -> dict | None:
    processed = getattr(output, "num_computed_tokens", None)
    if processed is None:
        return None
    return {
        "id": request_id,
        "object": object_type,
        "created": created,
        "model": model,
        "choices": [],
        "prompt_progress": {"total": len(output.prompt_token_ids or ()), "processed": processed},
    }


def progress_event(
    output: RequestOutput, request_id: str, model: str, created: int, object_type: str
) -> str | None:
    """The SSE event a streaming endpoint sends for a progress output, else None.

    Shaped like the endpoint's own chunks with no choices, plus
    ``prompt_progress: {total, processed}`` in prompt tokens.
    """
    fields = _progress_fields(output, request_id, model, created, object_type)
    return None if fields is None else f"data: {json.dumps(fields)}\n\n"


def progress_chunk(
    output: RequestOutput, request_id: str, model: str, created: int, object_type: str
):
    """The same event as a chat stream chunk, for 0.33.0's chat generator, which yields
    chunk objects that its caller serializes (upstream's models keep extra fields)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

    fields = _progress_fields(output, request_id, model, created, object_type)
    return None if fields is None else ChatCompletionStreamResponse(**fields)
