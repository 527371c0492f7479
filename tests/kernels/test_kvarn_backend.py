"""The installed fork's KVARN backend, builder and forward, driven step by step as Model
Runner V2 drives them: the lifecycle hook, CommonAttentionMetadata, a paged cache.

On CPU the Triton kernels run in the interpreter (this tier's process), so the host
planning, the tables, the staging, decode, the prefill packs (upstream's paged Triton
attention over the dequantized scratch), flushes and sink restores are exercised
together. Every query token's output is checked against exact attention over the
unquantized rows it should see.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.fork.kvarn_backend", reason="needs the installed fork wheel")

from kvarn_cases import DEVICE  # noqa: E402

H_Q, H_KV, D = 4, 2, 64
NUM_BLOCKS = 48


@dataclass
class Request:
    rid: str
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int = -1


def _tiny_config_dir(path) -> str:
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=H_Q, num_key_value_heads=H_KV, head_dim=D,
                max_position_embeddings=1024, torch_dtype="bfloat16",
                architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return str(path)


class Driver:
    """One KVARN layer served the way the V2 runner serves it."""

    def __init__(self, model_dir: str, preset: str, max_num_seqs: int = 4,
                 max_batched: int = 160, monkeypatch=None,
                 speculative_config: dict | None = None, tiles_per_block: int = 1) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs
        from vllm.kvarn import Preset
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.utils.torch_utils import set_default_torch_dtype
        from vllm.v1.worker.utils import AttentionGroup, customize_attention_spec
        from vllm.v1.worker.workspace import init_workspace_manager

        self.config = EngineArgs(
            model=model_dir, skip_tokenizer_init=True, kv_cache_dtype=preset,
            max_model_len=512, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched, enable_prefix_caching=True,
            speculative_config=speculative_config,
        ).create_engine_config()
        self.preset = Preset.parse(preset)
        self.g = self.preset.group
        # A hybrid model's scheduler blocks hold several KVarN tiles (upstream's
        # _align_hybrid_block_size raises the block size to fit a Mamba state page); the
        # runner then hands the kernels tile-sized blocks, block * tiles + i.
        self.tiles = tiles_per_block
        self.config.cache_config.block_size = self.g * tiles_per_block
        if monkeypatch is not None and hasattr(type(self.config), "use_v2_model_runner"):
            # This test plays Model Runner V2, which cannot itself run on a CPU host
            # (vLLM finds no Triton GPU driver there), so the config reports it (0.33.0;
            # from 0.34.0 V2 is the only runner).
            monkeypatch.setattr(type(self.config), "use_v2_model_runner",
                                property(lambda self: True))
        self._ctx = contextlib.ExitStack()
        self._ctx.enter_context(set_current_vllm_config(self.config))
        self._ctx.enter_context(set_default_torch_dtype(torch.bfloat16))
        self.layer = Attention(H_Q, D, D**-0.5, H_KV, cache_config=self.config.cache_config,
                               prefix="model.layers.0.self_attn.attn")
        backend = self.layer.get_attn_backend()
        assert backend.get_name() == "KVARN"
        spec = customize_attention_spec(backend, self.layer.get_kv_cache_spec(self.config))
        if DEVICE == "cpu" and monkeypatch is not None:
            # The workspace manager frees the accelerator's cache before it grows;
            # a CPU host has no accelerator to ask.
            monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
        init_workspace_manager(torch.device(DEVICE))
        self.builder = backend.get_builder_cls()(spec, [self.layer.layer_name], self.config,
                                                 torch.device(DEVICE))
        # The runner's attention groups, as the kvarn-lifecycle hook passes them.
        self.attn_groups = [[AttentionGroup(backend, [self.layer.layer_name], spec, 0,
                                            metadata_builders=[self.builder])]]
        rec = self.preset.tile_bytes(D)
        self.kv_cache = torch.zeros(NUM_BLOCKS, H_KV, self.g, rec // self.g,
                                    dtype=torch.uint8, device=DEVICE)
        self.free_blocks = list(range(NUM_BLOCKS // tiles_per_block - 1, 0, -1))
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        gen = torch.Generator().manual_seed(0)
        # K/V of a token depend on it and its position only, as a model's would.
        self.k_table = torch.randn(512, 600, H_KV, D, generator=gen, dtype=torch.float32)
        self.v_table = torch.randn(512, 600, H_KV, D, generator=gen, dtype=torch.float32)
        self.pending_new: list = []
        self.pending_done: set[str] = set()
        self.pending_preempted: set[str] = set()
        # Profiling run: the side pool and scratch come from the workspace.
        self._forward(None, torch.zeros(1, H_Q * D), torch.zeros(1, H_KV * D),
                      torch.zeros(1, H_KV * D))
        self.max_err = 0.0
        self.checked = 0

    def close(self) -> None:
        self._ctx.close()

    # -- the scheduler's side ------------------------------------------------------

    def admit(self, req: Request, hit_blocks: list[int] = ()) -> None:
        from vllm.v1.core.sched.output import NewRequestData

        req.slot = self.free_slots.pop()
        req.blocks = list(hit_blocks)
        req.computed = len(hit_blocks) * self.g * self.tiles
        self.pending_new.append(NewRequestData(
            req_id=req.rid, prompt_token_ids=req.tokens, mm_features=[],
            sampling_params=None, pooling_params=None, block_ids=(req.blocks,),
            num_computed_tokens=req.computed, lora_request=None,
            prefill_token_ids=req.tokens))

    def finish(self, req: Request) -> None:
        self.pending_done.add(req.rid)
        self.free_slots.append(req.slot)

    def preempt(self, req: Request, keep_blocks: int) -> None:
        """As the scheduler preempts: the slot goes, the request's first ``keep_blocks``
        blocks stay cached (a later admission may hit them), the rest are freed."""
        self.pending_preempted.add(req.rid)
        self.free_slots.append(req.slot)
        self.free_blocks.extend(req.blocks[keep_blocks:])
        req.blocks, req.computed = req.blocks[:keep_blocks], 0

    def step(self, batch: list[tuple[Request, int]]) -> torch.Tensor:
        from vllm.v1.attention.backend import CommonAttentionMetadata
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        from vllm.fork import kvarn_lifecycle

        for req, q in batch:
            while len(req.blocks) * self.g * self.tiles < req.computed + q:
                req.blocks.append(self.free_blocks.pop())
        # New requests' block lists are final only now; the runner sees them complete.
        out = SchedulerOutput(
            scheduled_new_reqs=self.pending_new,
            scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={r.rid: q for r, q in batch},
            total_num_scheduled_tokens=sum(q for _, q in batch),
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=self.pending_done, free_encoder_mm_hashes=[],
            preempted_req_ids=self.pending_preempted)
        kvarn_lifecycle.observe_step(out, {r.rid: r.slot for r, _ in batch},
                                     self.attn_groups)
        self.pending_new, self.pending_done, self.pending_preempted = [], set(), set()
        qlens = [q for _, q in batch]
        qsl = torch.tensor([0, *np.cumsum(qlens)], dtype=torch.int32)
        seq = torch.tensor([r.computed + q for r, q in batch], dtype=torch.int32)
        tiles = [[blk * self.tiles + i for blk in r.blocks for i in range(self.tiles)]
                 for r, _ in batch]
        table = torch.zeros(len(batch), max(map(len, tiles)), dtype=torch.int32)
        for b, row in enumerate(tiles):
            table[b, : len(row)] = torch.tensor(row)
        positions = torch.cat([torch.arange(r.computed, r.computed + q) for r, q in batch])
        cam = CommonAttentionMetadata(
            query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl,
            seq_lens=seq.to(DEVICE), num_reqs=len(batch), num_actual_tokens=int(qsl[-1]),
            max_query_len=max(qlens), max_seq_len=int(seq.max()),
            block_table_tensor=table.to(DEVICE), slot_mapping=torch.zeros(1),
            positions=positions.to(DEVICE), seq_lens_cpu_upper_bound=seq,
            req_idx=np.array([r.slot for r, _ in batch]))
        md = self.builder.build(0, cam)
        toks = [(r.tokens[p], p) for r, q in batch for p in range(r.computed, r.computed + q)]
        ids = torch.tensor([t for t, _ in toks])
        pos = torch.tensor([p for _, p in toks])
        gen = torch.Generator().manual_seed(int(qsl[-1]) * 7919 + len(batch))
        query = torch.randn(len(toks), H_Q, D, generator=gen)
        k = self.k_table[ids, pos]
        v = self.v_table[ids, pos]
        got = self._forward(md, query.reshape(len(toks), -1), k.reshape(len(toks), -1),
                            v.reshape(len(toks), -1))
        self._check(batch, query, got)
        for req, q in batch:
            req.computed += q
        return md

    def _forward(self, md, query, key, value) -> torch.Tensor:
        out = torch.zeros(query.shape[0], H_Q * D, dtype=torch.bfloat16, device=DEVICE)
        self.layer.impl.forward(self.layer, query.to(DEVICE, torch.bfloat16),
                                key.to(DEVICE, torch.bfloat16),
                                value.to(DEVICE, torch.bfloat16), self.kv_cache, md, out)
        return out.view(-1, H_Q, D).float().cpu()

    def _check(self, batch, query, got) -> None:
        t = 0
        for req, q in batch:
            ids = torch.tensor(req.tokens[: req.computed + q])
            pos = torch.arange(req.computed + q)
            k = self.k_table[ids, pos].bfloat16().float().repeat_interleave(H_Q // H_KV, 1)
            v = self.v_table[ids, pos].bfloat16().float().repeat_interleave(H_Q // H_KV, 1)
            for i in range(q):
                p = req.computed + i
                qi = query[t].bfloat16().float()
                s = torch.einsum("hd,lhd->hl", qi, k[: p + 1]) * D**-0.5
                want = torch.einsum("hl,lhd->hd", s.softmax(-1), v[: p + 1])
                err = float((got[t] - want).norm() / want.norm())
                # KVarN's own error: 4-bit keys and 2-bit values beyond the sink block.
                bound = 0.02 if p < self.g else 0.6
                assert err < bound, (f"{req.rid} position {p}: relative error {err:.3f} "
                                     f"(bound {bound})")
                self.max_err = max(self.max_err, err)
                self.checked += 1
                t += 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return _tiny_config_dir(tmp_path_factory.mktemp("qwen3-kvarn-backend"))


@pytest.fixture
def driver(model_dir, monkeypatch):
    d = Driver(model_dir, "kvarn_k4v2_g64", monkeypatch=monkeypatch)
    yield d
    d.close()


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_dummy_run_before_any_announced_step_is_inert(driver):
    """0.34.0's dummy runs (profiling, warm-up, capture) carry request slots as real
    steps do; before the runner has announced a step, none may be planned as one (the
    0.34.0 GPU run failed there: 'slot 0 was scheduled but never admitted')."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, 4], dtype=torch.int32)
    seq = torch.tensor([4], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl.to(DEVICE), query_start_loc_cpu=qsl, seq_lens=seq.to(DEVICE),
        num_reqs=1, num_actual_tokens=4, max_query_len=4, max_seq_len=4,
        block_table_tensor=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.zeros(1), positions=torch.arange(4, device=DEVICE),
        seq_lens_cpu_upper_bound=seq, req_idx=np.array([0]))
    driver.builder.build(0, cam)  # slot 0 was never admitted
    a = Request("a", _prompt(1, 40))
    driver.admit(a)
    driver.step([(a, 40)])  # the first announced step is planned as usual
    assert driver.checked == 40


def test_prefill_chunks_decode_and_prefix_hits(driver):
    g = driver.g
    a = Request("a", _prompt(1, 170) + _prompt(2, 60))
    driver.admit(a)
    driver.step([(a, 100)])  # first chunk: raw rows, block 0 recorded
    driver.step([(a, 70)])  # continues over the sink and a partial block
    for _ in range(6):
        driver.step([(a, 1)])
    # b shares a's first two blocks: a prefix hit adopting a's live sink.
    b = Request("b", a.tokens[: 2 * g] + _prompt(3, 60))  # 40 prompt, 20 generated
    driver.admit(b, hit_blocks=a.blocks[:2])
    driver.step([(a, 1), (b, 40)])
    for _ in range(4):
        driver.step([(a, 1), (b, 1)])
    assert driver.checked == 225
    assert driver.max_err > 0.05, "no quantized record was read"


def test_finished_requests_give_their_side_blocks_back(driver):
    pool = driver.builder.pool
    free0 = pool.num_free
    for n in range(8):  # twice as many requests as seats, one after another
        r = Request(f"f{n}", _prompt(10 + n, 141))
        driver.admit(r)
        driver.step([(r, 140)])
        driver.step([(r, 1)])
        driver.finish(r)
        driver.free_blocks.extend(r.blocks)
    x = Request("x", _prompt(99, 10))
    driver.admit(x)
    driver.step([(x, 10)])
    assert pool.num_free + pool.num_idle_sinks >= free0 - 1


def test_tables_are_persistent_between_steps(driver):
    r = Request("p", _prompt(5, 81))
    driver.admit(r)
    md1 = driver.step([(r, 80)])
    md2 = driver.step([(r, 1)])
    for name in ("side_table", "num_flushed", "stage_slots", "restore_dst", "flush_dst",
                 "flush_src", "scratch_offset"):
        assert getattr(md1, name).data_ptr() == getattr(md2, name).data_ptr(), name


def test_scheduler_blocks_of_several_tiles_as_a_hybrid_model_has(model_dir, monkeypatch):
    """On the 27B-shaped hybrid a scheduler block is many KVarN tiles (upstream raises the
    attention block size until its page holds a DeltaNet state) and the kernels get a
    table of tiles: prefill chunks across tiles, decodes and a prefix hit of one whole
    block read what exact attention over the rows would."""
    d = Driver(model_dir, "kvarn_k4v2_g64", monkeypatch=monkeypatch, tiles_per_block=3)
    try:
        block = 3 * d.g
        assert d.builder.lifecycle.manager_block_size == block
        a = Request("ta", _prompt(60, block + 70) + _prompt(61, 20))
        d.admit(a)
        d.step([(a, 160)])
        d.step([(a, block + 70 - 160)])
        for _ in range(4):
            d.step([(a, 1)])
        b = Request("tb", a.tokens[:block] + _prompt(62, 30))
        d.admit(b, hit_blocks=a.blocks[:1])
        d.step([(a, 1), (b, 25)])
        for _ in range(3):
            d.step([(a, 1), (b, 1)])
        assert d.checked == block + 70 + 4 + 4 + 25 + 3
        assert d.max_err > 0.05, "no quantized record was read"
    finally:
        d.close()


@pytest.mark.parametrize("tiles", [1, 3], ids=["dense", "hybrid"])
def test_a_preempted_request_resumes_from_its_cached_blocks(model_dir, monkeypatch, tiles):
    """Preempted mid-decode while another request takes its only seat, then admitted
    again with a prefix hit on its first block: the next occupant reads none of its side
    rows, and the resumed request reads its records and its recomputed rows right."""
    d = Driver(model_dir, "kvarn_k4v2_g64", max_num_seqs=1, monkeypatch=monkeypatch,
               tiles_per_block=tiles)
    try:
        block = d.g * tiles
        a = Request("pa", _prompt(70, block + 40) + _prompt(71, 10))
        d.admit(a)
        for q in (min(block, 160), block + 40 - min(block, 160), 1, 1):
            if q:
                d.step([(a, q)])
        d.preempt(a, keep_blocks=1)
        b = Request("pb", _prompt(72, 95))
        d.admit(b)
        d.step([(b, 90)])
        d.step([(b, 1)])
        d.finish(b)
        d.admit(a, hit_blocks=a.blocks)
        d.step([(a, 42)])  # the rest of what it had, recomputed
        for _ in range(3):
            d.step([(a, 1)])
        assert a.computed == block + 45 and d.checked == (block + 42) + 91 + 45
    finally:
        d.close()


@pytest.mark.parametrize("tiles, hit_blocks", [(1, 2), (3, 1)], ids=["dense", "hybrid"])
def test_a_hit_on_an_evicted_sink_is_restored_from_its_record(model_dir, monkeypatch, tiles,
                                                               hit_blocks):
    """An idle sink evicted by later requests comes back from its record on a prefix hit,
    also where a scheduler block holds several tiles (as on a hybrid model)."""
    d = Driver(model_dir, "kvarn_k4v4_g64", max_num_seqs=2, max_batched=64,
               monkeypatch=monkeypatch, tiles_per_block=tiles)
    try:
        g = d.g
        hit = hit_blocks * tiles * g
        a = Request("ea", _prompt(20, hit + 5))
        d.admit(a)
        for _ in range(hit // g):
            d.step([(a, g)])
        d.step([(a, 5)])
        d.finish(a)
        # Distinct prompts fill the pool until a's idle sink is evicted.
        for n in range(12):
            r = Request(f"e{n}", _prompt(30 + n, g + 3))
            d.admit(r)
            d.step([(r, g)])
            d.step([(r, 3)])
            d.finish(r)
        assert d.builder.pool.num_idle_sinks < 12
        b = Request("eb", a.tokens[:hit] + _prompt(50, 9))
        d.admit(b, hit_blocks=a.blocks[:hit_blocks])
        md = d.step([(b, 8)])
        assert int(md.restore_dst[0]) >= 0, "the sink came back from its record"
        d.step([(b, 1)])
    finally:
        d.close()


def test_v1_runner_is_refused(model_dir):
    from vllm.config import VllmConfig

    if not hasattr(VllmConfig, "use_v2_model_runner"):
        pytest.skip("0.34.0 removed Model Runner V1: V2 is the only runner")
    with pytest.raises(ValueError, match="Model Runner V2"):
        Driver(model_dir, "kvarn_k4v2_g64")


def test_speculative_verify_rows_attend_through_the_fused_kernel(model_dir, monkeypatch):
    """With speculation, rows of 1 + k query tokens are decode rows: the builder sends them
    to kvarn.decode.attend together (one uniform verify launch), each token causal over
    records, side rows and the tokens before it."""
    k = 3
    d = Driver(model_dir, "kvarn_k4v2_g64", monkeypatch=monkeypatch, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    try:
        g = d.g
        a = Request("va", _prompt(60, 3 * g + 40))
        b = Request("vb", _prompt(61, 2 * g + 30))
        d.admit(a)
        d.step([(a, 2 * g + 10)])  # prefills: records past the sink
        d.admit(b)
        d.step([(b, 2 * g)])
        checked = d.checked
        for _ in range(6):  # verify steps, crossing block boundaries
            md = d.step([(a, 1 + k), (b, 1 + k)])
            assert (md.num_decodes, md.decode_query_len) == (2, 1 + k)
        assert d.checked - checked == 6 * 2 * (1 + k)
        assert d.max_err > 0.05, "no quantized record was read"
    finally:
        d.close()


def test_rejected_draft_tokens_never_reach_a_record_or_the_side_pool(model_dir, monkeypatch):
    """Verify steps whose drafts are partly rejected, across tile boundaries: the
    rejected drafts are a poison token whose values are 1000x a real token's, so any
    attention that still read one after its rejection would be far off. Each step is
    checked against the reference over the tokens the request holds then: the drafts
    while they are verified, the accepted tokens only once they are rejected."""
    k, poison = 3, 511
    d = Driver(model_dir, "kvarn_k4v2_g64", monkeypatch=monkeypatch, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1})
    d.v_table[poison] *= 1000.0
    gen = torch.Generator().manual_seed(62)

    def fresh(n: int) -> list[int]:
        return torch.randint(0, poison, (n,), generator=gen).tolist()

    try:
        g = d.g
        a = Request("ra", fresh(2 * g + 10) + fresh(200))
        b = Request("rb", fresh(g + 50) + fresh(200))
        d.admit(a)
        d.step([(a, 2 * g + 10)])
        d.admit(b)
        d.step([(b, g + 50)])
        crossed = {r.rid: r.computed // g for r in (a, b)}
        for step in range(24):
            accepted = {a.rid: step % (k + 1), b.rid: (step * 2 + 1) % (k + 1)}
            for r in (a, b):  # the drafts after the accepted ones are rejected
                start = r.computed + 1 + accepted[r.rid]
                r.tokens[start: r.computed + 1 + k] = [poison] * (k - accepted[r.rid])
            d.step([(a, 1 + k), (b, 1 + k)])
            for r in (a, b):  # the bonus token and what follows replace the rejected
                r.computed -= k - accepted[r.rid]
                r.tokens[r.computed:] = fresh(len(r.tokens) - r.computed)
        assert all(r.computed // g > crossed[r.rid] for r in (a, b)), "no tile boundary crossed"
        d.step([(a, 1), (b, 1)])  # a last decode over the accepted tokens only
    finally:
        d.close()
