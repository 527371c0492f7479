"""The fork's xgrammar as the bundle installs it, run with the GPU machine's own torch.

The bundle carries the fork's cp312 build (tagged manylinux_2_X by auditwheel on the
build machine); this is where it meets that machine's glibc and libstdc++. A bounded
string decides the mask: after the string's last allowed character only the closing
quote may follow, and an escape counts as one character (stock 0.2.8 refuses it).
"""

from __future__ import annotations

import importlib.metadata
import re

VOCAB = ['{', '}', '"', 's', ':', ' ', 'a', '\\', 'x', '</s>']


def _allowed_after(xgr, torch, prefix: str) -> list[str]:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 1}},
              "required": ["s"]}
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        schema, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(prefix), prefix
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))
    matcher.fill_next_token_bitmask(bitmask)
    logits = torch.zeros(1, len(VOCAB), device="cuda")
    xgr.apply_token_bitmask_inplace(logits, bitmask.to("cuda"))
    return [VOCAB[i] for i in torch.nonzero(logits[0] == 0).flatten().tolist()]


def test_the_bundles_xgrammar_is_the_fork_build_and_masks_on_cuda():
    import torch
    import xgrammar as xgr

    assert re.fullmatch(r"0\.2\.8\+kiln\.\d+", importlib.metadata.version("xgrammar"))
    assert _allowed_after(xgr, torch, '{"s": "a') == ['"']
    assert _allowed_after(xgr, torch, '{"s": "\\\\') == ['"']  # an escaped backslash
