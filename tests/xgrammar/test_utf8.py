"""Overlong UTF-8 in bounded strings (patch utf8-shortest-form).

A bounded JSON string and a bounded qwen_xml value count one character per UTF-8 lead
byte. 0.2.8's regex FSMs take the overlong 3- and 4-byte forms (E0 80 80-E0 9F BF,
F0 80 80 80-F0 8F BF BF) in a character class that runs from 2-byte into longer
characters, as in the fork's bounded bodies: one character counted, three once decoded
(Python reads E0 80 80 as three U+FFFD). With the patch the fork refuses them everywhere,
as stock's grammar character classes (its JSON strings) do; shortest forms and surrogate
code points (ED A0 80, which JSON's \\ud800 escapes also allow) stay accepted.
"""

from __future__ import annotations

import json
import subprocess

from tests.xgrammar.conftest import HERE

SEQUENCES = {
    "C2 80": ("c280", True), "E0 A0 80": ("e0a080", True), "F0 90 80 80": ("f0908080", True),
    "F4 8F BF BF": ("f48fbfbf", True), "ED A0 80": ("eda080", True),
    "C0 80": ("c080", False), "C1 BF": ("c1bf", False), "E0 80 80": ("e08080", False),
    "E0 9F BF": ("e09fbf", False), "F0 80 80 80": ("f0808080", False),
    "F0 8F BF BF": ("f08fbfbf", False), "F4 90 80 80": ("f4908080", False),
    "F5 80 80 80": ("f5808080", False), "80": ("80", False), "FF": ("ff", False),
}
# Each case: a schema, the style, the bytes before the sequence and after it.
CASES = {
    "json unbounded": ({"type": "string"}, "json", b'{"s": "', b'"}'),
    "json maxLength 5": ({"type": "string", "maxLength": 5}, "json", b'{"s": "', b'"}'),
    # A pattern goes through the regex FSM in both builds.
    "json pattern": ({"type": "string", "pattern": "^[^a]*$"}, "json", b'{"s": "', b'"}'),
    "qwen_xml maxLength 5": ({"type": "string", "maxLength": 5}, "qwen_xml",
                             b"<tool_call>\n<function=f>\n<parameter=s>\n",
                             b"\n</parameter>\n</function>\n</tool_call>"),
}
WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import xgrammar as xgr
from decide_worker import compile_case
request = json.load(sys.stdin)
out = {}
for name, (prop, style, before, after) in request["cases"].items():
    schema = {"type": "object", "properties": {"s": prop}, "required": ["s"]}
    row = {}
    for seq, hexed in request["sequences"].items():
        vocab = [b"", bytes.fromhex(before), bytes.fromhex(hexed), bytes.fromhex(after)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=4, stop_token_ids=[0])
        compiled = compile_case(xgr.GrammarCompiler(info, cache_enabled=False), schema, style)
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        row[seq] = all(matcher.accept_token(t) for t in (1, 2, 3)) and matcher.is_terminated()
    out[name] = row
json.dump(out, sys.stdout)
"""


def accepted(envs, which: str) -> dict:
    request = {"sequences": {k: h for k, (h, _) in SEQUENCES.items()},
               "cases": {k: (p, s, b.hex(), a.hex()) for k, (p, s, b, a) in CASES.items()}}
    result = subprocess.run([str(envs.python), "-c", WORKER, str(HERE)],
                            input=json.dumps(request), capture_output=True, text=True,
                            env=envs.environ(which), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


def test_fork_takes_only_shortest_form_utf8_everywhere(envs):
    want = {k: valid for k, (_, valid) in SEQUENCES.items()}
    assert accepted(envs, "fork") == {case: want for case in CASES}


def test_stock_grammar_classes_agree_and_its_regex_did_not(envs):
    stock = accepted(envs, "stock")
    want = {k: valid for k, (_, valid) in SEQUENCES.items()}
    # Stock's strings are grammar character classes, exact; a pattern is a regex FSM.
    assert all(stock[case] == want for case in CASES if case != "json pattern")
    assert {k for k, ok in stock["json pattern"].items() if ok != want[k]} == {
        "E0 80 80", "E0 9F BF", "F0 80 80 80", "F0 8F BF BF"}
