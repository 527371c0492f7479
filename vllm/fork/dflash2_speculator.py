"""KilnDFlash2Speculator: upstream's DFlash2 speculator with the fork's verify block.

Model Runner V2 builds it for every DFlash2 drafter (topic dflash2-lookup-drafting's
hook in ``spec_decode/__init__.py``). Upstream's DFlash2Speculator runs unchanged
underneath at the drafter's own width (``draft_tokens``, k); this class fills the
verify block of ``num_speculative_tokens`` (V >= k) the runner verifies:

* lookup drafting (``lookup``): slots the adaptive length trusts come from the
  request's own history (``spec_lookup.match_history``), so V may exceed the
  drafter's block;
* n-gram chains (``ngram_chains``, greedy requests): a request copying its context
  drafts its whole block from a chain of the lookup, and when every request of the
  step did so one step earlier, the drafter's forward is skipped (its context K/V is
  still stored, so later drafts see every position);
* the adaptive length (``spec_lookup.TrustState``) grades the lookup by the tokens each
  step emitted;
* the per-step ``num_speculative_tokens`` the scheduler picks is honoured: 0 skips the
  drafter's forward on single-rank runs, None (dummy runs) means the configured V.

Lossless by construction: drafts are only proposals, greedy draft sampling makes
every draft a one-hot proposal, and the target's rejection sampler decides.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import DFlash2Speculator

from vllm.fork import spec_lookup
from vllm.fork.dflash2_config import settings_of, verify_count

if TYPE_CHECKING:
    from vllm.v1.worker.gpu.dp_utils import DPSyncState
    from vllm.v1.worker.gpu.input_batch import InputBatch
    from vllm.v1.worker.gpu.states import RequestState

logger = init_logger(__name__)


def drafter_view(vllm_config: VllmConfig, draft_tokens: int) -> VllmConfig:
    """The config the drafter is built and run with: the engine's, with the drafter's
    own token count (its query width and DFlash2's convolution block follow it)."""
    spec = vllm_config.speculative_config
    assert spec is not None
    if spec.num_speculative_tokens == draft_tokens:
        return vllm_config
    view = copy.copy(vllm_config)
    view.speculative_config = copy.copy(spec)
    view.speculative_config.num_speculative_tokens = draft_tokens
    return view


class KilnDFlash2Speculator(DFlash2Speculator):
    _speculator_name = "KilnDFlash2"

    def __init__(self, vllm_config: VllmConfig, device: torch.device,
                 req_states: RequestState):
        assert vllm_config.speculative_config is not None
        self.settings = settings_of(vllm_config.speculative_config)
        super().__init__(drafter_view(vllm_config, self.settings.draft_tokens), device)
        self.req_states = req_states
        self.verify_len = self.settings.verify_tokens
        self.verify_drafts = torch.zeros(self.max_num_reqs, self.verify_len,
                                         dtype=torch.int64, device=device)
        self.trust: spec_lookup.TrustState | None = None
        if self.settings.uses_history:
            self.trust = spec_lookup.TrustState(self.max_num_reqs, self.verify_len, device)
        # Set for one propose() whose drafter forward is skipped.
        self._skip_query = False
        self._num_target_tokens = 0
        # Whether every request of the last step drafted from a chain, read one step
        # later without waiting: the copy lands in pinned memory behind an event.
        self._chained_reqs: frozenset[str] = frozenset()
        self._chained_host: torch.Tensor | None = None
        self._chained_event: torch.cuda.Event | None = None
        # Ranks could decide apart (each reads its own event and, under data
        # parallelism, its own scheduler's count), and a drafter forward skipped on one
        # rank only would hang its collectives: single-rank runs only.
        parallel = vllm_config.parallel_config
        self._single_rank = (parallel.tensor_parallel_size == 1
                             and parallel.data_parallel_size == 1)
        if self.settings.ngram_chains and device.type == "cuda" and self._single_rank:
            self._chained_host = torch.zeros(1, dtype=torch.bool, pin_memory=True)
            self._chained_event = torch.cuda.Event()
        logger.info(
            "KilnDFlash2: verify block %d, drafter block %d, lookup %s (n-grams %d..%d "
            "over the last %d tokens), n-gram chains %s", self.verify_len,
            self.settings.draft_tokens, "on" if self.settings.lookup else "off",
            self.settings.lookup_min, self.settings.lookup_max,
            self.settings.lookup_window, "on" if self.settings.ngram_chains else "off")

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        super().init_cudagraph_manager(cudagraph_mode)
        manager = self.query_cudagraph_manager
        assert manager is not None
        replay = manager.run_fullgraph

        def run_fullgraph(batch_desc: Any) -> Any:
            if not self._skip_query:
                return replay(batch_desc)
            # The graph would have stored the first rows' context K/V itself.
            assert batch_desc.num_reqs is not None
            rows = min(self._num_target_tokens,
                       self._num_graph_context_tokens(batch_desc.num_reqs))
            self._precompute_context_kv(0, rows)
            return None

        manager.run_fullgraph = run_fullgraph

    def _generate_draft(self, *args: Any, **kwargs: Any) -> None:
        if self._skip_query:
            return
        super()._generate_draft(*args, **kwargs)

    def _chained_last_step(self, input_batch: InputBatch) -> bool:
        if self._chained_event is None or not self._chained_reqs:
            return False
        if input_batch.has_prefill or not set(input_batch.req_ids) <= self._chained_reqs:
            return False
        # Not landed yet: run the drafter rather than wait.
        if not self._chained_event.query():
            return False
        assert self._chained_host is not None
        return bool(self._chained_host[0])

    def _publish_chained(self, covers: torch.Tensor, input_batch: InputBatch) -> None:
        if self._chained_event is None:
            return
        assert self._chained_host is not None
        self._chained_host.copy_(covers.all().reshape(1), non_blocking=True)
        self._chained_event.record()
        self._chained_reqs = frozenset(input_batch.req_ids)

    @torch.inference_mode()
    def propose(
        self,
        input_batch: InputBatch,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        last_hidden_states: torch.Tensor,
        aux_hidden_states: list[torch.Tensor] | None,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        dp_sync_state: DPSyncState | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        count = verify_count(num_speculative_tokens, self.verify_len)
        num_reqs = input_batch.num_reqs
        history = self.trust is not None and not dummy_run
        skip = not dummy_run and self._single_rank and (
            count == 0 or self._chained_last_step(input_batch))
        self._skip_query = skip
        self._num_target_tokens = input_batch.num_tokens
        try:
            drafter = super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
                dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run,
                mm_inputs=mm_inputs, is_profile=is_profile,
                num_speculative_tokens=num_speculative_tokens)
        finally:
            self._skip_query = False
        out = self.verify_drafts[:num_reqs]
        if not history:
            if self.verify_len == self.num_speculative_steps:
                return drafter
            # A dummy run of a verify block longer than the drafter's.
            out[:, : self.num_speculative_steps] = drafter
            out[:, self.num_speculative_steps:] = last_sampled[input_batch.idx_mapping]
            return out
        return self._fill_from_history(input_batch, num_sampled, temperature, count,
                                       None if skip else drafter, out)

    def _fill_from_history(self, input_batch: InputBatch, num_sampled: torch.Tensor,
                           temperature: torch.Tensor, count: int,
                           drafter: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        trust_state = self.trust
        assert trust_state is not None
        settings = self.settings
        num_reqs = input_batch.num_reqs
        rows = input_batch.idx_mapping[:num_reqs]
        tokens = self.req_states.all_token_ids.gpu
        lengths = self.req_states.total_len.gpu[rows]
        # New and resumed (after preemption) requests prefill: they start afresh.
        fresh = input_batch.idx_mapping_np[:num_reqs][input_batch.is_prefilling_np[:num_reqs]]
        if fresh.size:
            trust_state.reset(async_tensor_h2d(fresh.astype(np.int64), device=rows.device))
        trust_state.observe(tokens, rows, lengths, num_sampled[:num_reqs])
        match = spec_lookup.match_history(tokens, rows, lengths, settings.lookup_min,
                                          settings.lookup_max, settings.lookup_window)
        greedy = spec_lookup.is_greedy(temperature[rows])
        chain = greedy if settings.ngram_chains else torch.zeros_like(greedy)
        lookup, available = spec_lookup.continuation(tokens, rows, match, self.verify_len,
                                                     chain)
        trust = trust_state.trust[rows]
        covers = spec_lookup.chain_covers(match, chain, trust, count)
        # Without lookup drafting the history fills a block only as a whole chain.
        usable = available if settings.lookup else available & covers[:, None]
        pad = tokens[rows, (lengths.to(torch.int64) - 1).clamp(min=0)].to(torch.int64)
        out.copy_(spec_lookup.assemble(lookup, usable, trust, drafter, pad))
        proposed = torch.full_like(lengths, count)
        trust_state.record(rows, lengths, lookup, available, proposed)
        self._publish_chained(covers, input_batch)
        return out
