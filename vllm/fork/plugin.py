"""The fork's ``vllm.general_plugins`` entry point, run by vLLM in every process
(engine, workers, CLI) before it resolves backends: it registers what upstream's
extension points can carry, so no topic has to edit upstream's enums for it."""

from __future__ import annotations

KVARN_BACKEND = ("KVARN", "vllm.fork.kvarn_backend.KVarNAttentionBackend")


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm.fork.kvarn_dtypes import register_kvarn_dtypes

    register_kvarn_dtypes()

    name, path = KVARN_BACKEND
    if name not in AttentionBackendEnum.__members__:  # plugins may load more than once
        register_backend(name, path)
