"""Launch profiles: `vllm serve MODEL --kiln-profile ctx=huge,spec=ngram,prefix-cache`.

A profile is a comma-separated list of `key=value` items and bare flags; each item
stands for a few engine arguments (the table below). An argument the user set
explicitly (on the command line or in a --config file) always wins over the
profile; where the two disagree the start-up log warns and keeps the explicit one.
Reached from two hooks (patch kiln-profile): make_arg_parser adds the
`kiln-profile` argument group, validate_parsed_serve_args calls apply_profile.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from vllm.logger import init_logger

logger = init_logger(__name__)

GROUP_TITLE = "kiln-profile"


class ProfileError(ValueError):
    """A --kiln-profile item is unknown or cannot apply to this launch."""


@dataclass(frozen=True)
class Setting:
    """One engine argument a profile item sets: its argparse dest and its value."""

    dest: str
    value: Any

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def shown(self) -> str:
        if self.value is True:
            return self.flag
        if self.value is None:
            return f"no {self.flag}"
        if isinstance(self.value, dict):
            return f"{self.flag} '{json.dumps(self.value)}'"
        return f"{self.flag} {self.value}"


# A check gets the parsed args and the set of explicit dests; it returns why the
# item cannot apply, or None.
Check = Callable[[argparse.Namespace, frozenset[str]], "str | None"]


@dataclass(frozen=True)
class Choice:
    settings: tuple[Setting, ...]
    note: str = ""
    check: Check | None = None


@dataclass(frozen=True)
class ProfileKey:
    name: str
    help: str
    # A bare flag has one choice, under the empty value.
    choices: dict[str, Choice] = field(default_factory=dict)

    @property
    def is_flag(self) -> bool:
        return list(self.choices) == [""]


def _model_config_json(args: argparse.Namespace) -> dict[str, Any]:
    """The served model's config.json, from its folder or the local HF cache."""
    model = getattr(args, "model_tag", None) or args.model
    local = os.path.join(model, "config.json")
    if os.path.isfile(local):
        path = local
    else:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(model, "config.json", revision=args.revision)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# The config.json keys upstream's MTP drafters read the number of MTP layers from.
_MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_modules")


def _needs_mtp_layers(args: argparse.Namespace, explicit: frozenset[str]) -> str | None:
    config = _model_config_json(args)
    for scope in (config, config.get("text_config") or {}):
        if any((scope.get(key) or 0) > 0 for key in _MTP_LAYER_KEYS):
            return None
    return (
        f"the model's config.json has no MTP layers ({', '.join(_MTP_LAYER_KEYS)} "
        "all absent or 0), so it has no drafter for spec=mtp; use spec=ngram or spec=off"
    )


def _needs_drafter_model(args: argparse.Namespace, explicit: frozenset[str]) -> str | None:
    if "speculative_config" in explicit and (args.speculative_config or {}).get("model"):
        return None
    return (
        "spec=dflash2 needs the drafter checkpoint: pass "
        "--speculative-config '{\"model\": \"DRAFTER\"}' (the fork ships no default "
        "DFlash2 drafter); or use spec=ngram or spec=off"
    )


def _needs_tool_parser(args: argparse.Namespace, explicit: frozenset[str]) -> str | None:
    if args.tool_call_parser:
        return None
    return (
        "tool-strict needs the model's tool-call format: pass --tool-call-parser NAME "
        "(e.g. hermes for Qwen, pythonic for plain-text models)"
    )


NGRAM = {"method": "ngram", "num_speculative_tokens": 4,
         "prompt_lookup_min": 2, "prompt_lookup_max": 5}

PROFILE_KEYS: dict[str, ProfileKey] = {k.name: k for k in (
    ProfileKey("ctx", "KV-cache size per token: how much context fits", {
        "fast": Choice((Setting("kv_cache_dtype", "auto"),), "model dtype, fastest"),
        "long": Choice((Setting("kv_cache_dtype", "fp8"),), "half a 16-bit cache"),
        "huge": Choice((Setting("kv_cache_dtype", "kvarn_k4v2_g128"),),
                       "KVarN 4-bit keys, 2-bit values"),
    }),
    ProfileKey("spec", "speculative decoding", {
        "off": Choice((Setting("speculative_config", None),), "no speculation"),
        "ngram": Choice((Setting("speculative_config", NGRAM),),
                        "prompt lookup, no drafter needed"),
        # No token count: upstream then takes the drafter's own (its n_predict).
        "mtp": Choice((Setting("speculative_config", {"method": "mtp"}),),
                      "the model's own MTP layers", _needs_mtp_layers),
        "dflash2": Choice((Setting("speculative_config", {"method": "dflash"}),),
                          "needs --speculative-config with the drafter model",
                          _needs_drafter_model),
    }),
    # A 24 GB RTX 3090/4090 serving one user. The context is what the KV pool holds
    # (upstream's auto-fit), and a few seats and 2K-token prefill chunks keep the
    # activations, the graphs and KVarN's per-seat side pool from taking the pool's
    # memory. The memory share stays upstream's: measured after warm-up.
    ProfileKey("card", "fit the engine to the GPU's memory", {
        "24g": Choice((Setting("max_model_len", -1), Setting("max_num_seqs", 4),
                       Setting("max_num_batched_tokens", 2048)),
                      "a 24 GB card serving one user; -1: the longest context the "
                      "KV pool holds"),
    }),
    ProfileKey("prefix-cache", "reuse the KV cache of shared prompt prefixes", {
        "": Choice((Setting("enable_prefix_caching", True),)),
    }),
    # Named and required tool_choice are then decoded under the tool's JSON schema
    # (upstream's tool parser adjust_request); `parameter` extends that to auto calls
    # through the parser's structural tag, as if every tool were strict: true.
    ProfileKey("tool-strict", "tool-call arguments follow the tool's JSON schema", {
        "": Choice((Setting("enable_auto_tool_choice", True),
                    Setting("tool_strict_level", "parameter")),
                   "needs --tool-call-parser", _needs_tool_parser),
    }),
)}


def _allowed_items() -> str:
    return ", ".join(
        k.name if k.is_flag else f"{k.name}={'|'.join(k.choices)}"
        for k in PROFILE_KEYS.values()
    )


def parse_profile(text: str) -> list[tuple[ProfileKey, str]]:
    """(key, value) per item, in order; a bare flag's value is ''."""
    items: list[tuple[ProfileKey, str]] = []
    seen: set[str] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        key = PROFILE_KEYS.get(name.strip())
        if key is None:
            raise ProfileError(f"unknown key {name.strip()!r}; allowed: {_allowed_items()}")
        value = value.strip()
        if value not in key.choices:
            allowed = (f"{key.name} takes no value" if key.is_flag
                       else f"allowed: {key.name}={'|'.join(key.choices)}")
            raise ProfileError(f"{key.name}={value!r} is not a choice; {allowed}")
        if key.name in seen:
            raise ProfileError(f"{key.name} is given twice")
        seen.add(key.name)
        items.append((key, value))
    return items


def profile_text(text: str) -> str:
    """The argparse type of --kiln-profile: the text, its items checked. argparse turns an
    ArgumentTypeError into one `vllm serve: error: argument --kiln-profile: ...` line
    (exit 2); a ProfileError raised later, from the serve arguments' validation, would
    reach the user as a traceback."""
    try:
        parse_profile(text)
    except ProfileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def profile_help() -> str:
    lines = [("Comma-separated items, each setting engine arguments unless those "
             "are given explicitly (an explicit argument always wins):"), ""]
    for key in PROFILE_KEYS.values():
        lines.append(f"* {key.name}: {key.help}")
        for value, choice in key.choices.items():
            item = key.name if key.is_flag else f"{key.name}={value}"
            sets = " ".join(s.shown() for s in choice.settings)
            note = f" ({choice.note})" if choice.note else ""
            lines.append(f"- {item}: {sets}{note}")
    return "\n".join(lines)


def add_profile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `kiln-profile` group, so `vllm serve --help=kiln-profile` lists the table."""
    group = parser.add_argument_group(
        GROUP_TITLE, "Fork launch profiles: one flag for a tested set of engine arguments."
    )
    group.add_argument("--kiln-profile", type=profile_text, default=None, help=profile_help())
    return parser


def _option_names(argv: Sequence[str]) -> set[str]:
    """Option names written in argv, as dests (`--kv_cache_dtype.x=1` -> kv_cache_dtype)."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            name = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("-", "_")
            names.add(name.removeprefix("no_"))
        elif arg == "-sc":
            names.add("speculative_config")
    return names


def explicit_dests(args: argparse.Namespace, argv: Sequence[str]) -> frozenset[str]:
    """Profile-controlled dests the user set: named in argv, or away from the default.

    The second test catches a --config file and abbreviated options; the first an
    explicit value that equals the default."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:  # 0.33.0 moved the serve arguments from launchers/ to common/
        from vllm.entrypoints.common.cli_args import FrontendArgs
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import FrontendArgs

    named = _option_names(argv)
    found = set()
    for key in PROFILE_KEYS.values():
        for choice in key.choices.values():
            for s in choice.settings:
                owner = FrontendArgs if hasattr(FrontendArgs, s.dest) else AsyncEngineArgs
                if s.dest in named or getattr(args, s.dest) != getattr(owner, s.dest):
                    found.add(s.dest)
    return frozenset(found)


def refuse(message: str) -> NoReturn:
    """End `vllm serve` as argparse ends a bad argument: one error line, exit 2. A profile
    item the other arguments rule out is found only here, in upstream's validation of
    the parsed arguments, which lets any exception out as a traceback."""
    print(f"vllm serve: error: argument --kiln-profile: {message}", file=sys.stderr)
    raise SystemExit(2)


def apply_profile(args: argparse.Namespace, argv: Sequence[str] | None = None) -> None:
    """Set the profile's arguments on `args` where the user did not set them."""
    text = getattr(args, "kiln_profile", None)
    if not text:
        return
    items = parse_profile(text)
    explicit = explicit_dests(args, sys.argv[1:] if argv is None else argv)
    resolved: list[str] = []
    for key, value in items:
        choice = key.choices[value]
        item = key.name if key.is_flag else f"{key.name}={value}"
        if choice.check is not None and (why := choice.check(args, explicit)):
            refuse(f"{item}: {why}")
        for s in choice.settings:
            resolved.append(_apply_setting(args, s, item, explicit))
    logger.info("--kiln-profile %s resolved: %s", text, "; ".join(resolved))


def _apply_setting(
    args: argparse.Namespace, s: Setting, item: str, explicit: frozenset[str]
) -> str:
    current = getattr(args, s.dest)
    if s.dest not in explicit:
        setattr(args, s.dest, s.value)
        return f"{s.shown()} (from profile {item})"
    if s.dest == "speculative_config" and isinstance(s.value, dict) and current:
        return _merge_speculative(args, s, item, current)
    if current != s.value:
        logger.warning(
            "--kiln-profile %s sets %s, but %s %s was given explicitly: the explicit "
            "value wins", item, s.shown(), s.flag, current)
    return f"{s.flag} {current} (explicit)"


def _merge_speculative(
    args: argparse.Namespace, s: Setting, item: str, current: dict[str, Any]
) -> str:
    """An explicit --speculative-config keeps its keys; the profile fills the rest."""
    method = current.get("method")
    if method is not None and method != s.value["method"]:
        logger.warning(
            "--kiln-profile %s sets method %s, but --speculative-config names method %s: "
            "the explicit config wins", item, s.value["method"], method)
        return f"{s.flag} '{json.dumps(current)}' (explicit)"
    filled = sorted(set(s.value) - set(current))
    args.speculative_config = {**s.value, **current}
    return (f"{s.flag} '{json.dumps(args.speculative_config)}' "
            f"(explicit, {', '.join(filled) or 'nothing'} from profile {item})")
