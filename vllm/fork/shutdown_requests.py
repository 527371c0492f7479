"""End the requests a stopping `vllm serve` leaves open, with an error.

On SIGTERM upstream stops the engine client (at once with the default
--shutdown-timeout 0; after draining up to that many seconds otherwise) and
then waits for every HTTP connection to close. What the requests still
waiting on the engine get is a race: the engine's abort outputs, its death as
a 500, or most often nothing, their streams left open with no error and no
[DONE] until each client gives up. The API server's shutdown hands each of
them ServerShuttingDownError instead: a stream ends with an error event and
`data: [DONE]`, a non-streaming request gets 503, and the server exits. With
no drain this happens before the engine stops, so the race is never run;
after a drain, to what the drain left.
"""

from __future__ import annotations

from vllm.engine.protocol import EngineClient
from vllm.exceptions import RetryableRequestError
from vllm.logger import init_logger

logger = init_logger(__name__)


class ServerShuttingDownError(RetryableRequestError):
    """503: the server stopped before the request finished; another may serve it."""

    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down; the request did not finish. Retry it."
        )


def before_engine_shutdown(engine_client: EngineClient, timeout: int) -> None:
    """With no drain (--shutdown-timeout 0), end every open request now."""
    if timeout == 0:
        _end_unfinished_requests(engine_client)


def after_engine_shutdown(engine_client: EngineClient) -> None:
    """End what a drain left unfinished, and any request added meanwhile."""
    _end_unfinished_requests(engine_client)


def _end_unfinished_requests(engine_client: EngineClient) -> None:
    # Runs on the API server's event loop, as the requests' queues need.
    # Imported here: AsyncLLM's module pulls in the whole engine client.
    from vllm.v1.engine.async_llm import AsyncLLM

    if not isinstance(engine_client, AsyncLLM):
        return
    processor = engine_client.output_processor
    count = processor.get_num_unfinished_requests()
    if count == 0:
        return
    logger.info(
        "[shutdown] API server: ending %d unfinished sequence(s) with an error", count
    )
    processor.propagate_error(ServerShuttingDownError())
