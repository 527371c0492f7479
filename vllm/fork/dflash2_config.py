"""The fork's DFlash2 settings: ``--speculative-config '{..., "kiln_dflash2": {...}}'``.

Reached from SpeculativeConfig's validation (topic dflash2-lookup-drafting), so every
refusal happens at start-up and names the input and what is allowed. The resolved
settings (defaults filled in) are written back into ``kiln_dflash2``, which makes a
second validation of the same config a no-op and puts them in the config hash.

``num_speculative_tokens`` keeps upstream's meaning: the drafts verified per step (the
verify block, V). The DFlash2 drafter proposes ``draft_tokens`` of them (k, at most its
trained ``block_size - 1``); with ``lookup`` the rest of the block comes from the
request's own history, so V may exceed the drafter's block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config.speculative import SpeculativeConfig

FIELD = "kiln_dflash2"
DRAFTER_ARCH = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2Settings:
    """What KilnDFlash2Speculator runs with."""

    # Drafts verified per step (num_speculative_tokens).
    verify_tokens: int
    # Drafts the DFlash2 drafter proposes per step (its query is 1 + draft_tokens).
    draft_tokens: int
    # Fill the verify block from the request's own history (prompt and output).
    lookup: bool = False
    # n-gram sizes the lookup matches, longest first.
    lookup_min: int = 2
    lookup_max: int = 5
    # How many recent tokens the lookup searches.
    lookup_window: int = 1024
    # Greedy requests copying their context draft from a chain of the lookup and,
    # when every request does, the drafter's forward is skipped.
    ngram_chains: bool = True

    @property
    def uses_history(self) -> bool:
        return self.lookup or self.ngram_chains


# What each key accepts, for messages.
_KEYS = {
    "draft_tokens": "an integer 1..block_size - 1 of the drafter, at most "
                    "num_speculative_tokens",
    "lookup": "true or false",
    "lookup_min": "an integer >= 1",
    "lookup_max": "an integer >= lookup_min",
    "lookup_window": "an integer > lookup_max",
    "ngram_chains": "true or false",
}


def _where(key: str) -> str:
    return f"speculative_config.{FIELD}.{key}"


def _int(options: dict[str, Any], key: str, default: int) -> int:
    value = options.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{_where(key)}={value!r}: must be {_KEYS[key]}")
    return value


def _bool(options: dict[str, Any], key: str, default: bool) -> bool:
    value = options.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{_where(key)}={value!r}: must be {_KEYS[key]}")
    return value


def is_dflash2(spec: SpeculativeConfig) -> bool:
    draft = spec.draft_model_config
    return (spec.method == "dflash" and draft is not None
            and DRAFTER_ARCH in (draft.architectures or []))


SPECULATOR_CLASS = "vllm.fork.dflash2_speculator.KilnDFlash2Speculator"


def speculator_class(spec: SpeculativeConfig) -> str | None:
    """The speculator init_speculator builds where the fork runs its own: DFlash2
    drafters get KilnDFlash2Speculator, others upstream's (None). From 0.34.0, where
    init_speculator takes a class name from the speculator config."""
    return SPECULATOR_CLASS if is_dflash2(spec) else None


def drafter_block_size(spec: SpeculativeConfig) -> int | None:
    dflash = getattr(spec.draft_model_config.hf_config, "dflash_config", None) or {}
    block = dflash.get("block_size")
    return block if isinstance(block, int) and not isinstance(block, bool) else None


def resolve(spec: SpeculativeConfig) -> DFlash2Settings | None:
    """Check the fork's DFlash2 settings against the drafter; write back the resolved
    ones. None where the run is not DFlash2. Raises ValueError naming what is wrong."""
    options = getattr(spec, FIELD)
    if not is_dflash2(spec):
        if options is not None:
            raise ValueError(
                f"speculative_config.{FIELD} applies to DFlash2 drafters only (method "
                f"'dflash' with a {DRAFTER_ARCH} checkpoint); this run's method is "
                f"{spec.method!r}: drop {FIELD}")
        return None
    options = dict(options or {})
    unknown = sorted(set(options) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config.{FIELD}: unknown key(s) {', '.join(unknown)};"
                         f" allowed: {', '.join(_KEYS)}")
    verify = spec.num_speculative_tokens
    block = drafter_block_size(spec)
    widest = block - 1 if block is not None else verify
    lookup = _bool(options, "lookup", False)
    if "draft_tokens" in options:
        draft = _int(options, "draft_tokens", verify)
        if not 1 <= draft <= widest:
            raise ValueError(
                f"{_where('draft_tokens')}={draft}: above the drafter's block "
                f"(block_size {block} drafts at most {widest}); allowed: 1..{widest}")
        if draft > verify:
            raise ValueError(
                f"num_speculative_tokens={verify} is a verify block shorter than the "
                f"drafter block ({_where('draft_tokens')}={draft}); allowed: "
                f"num_speculative_tokens >= {draft}, or draft_tokens <= {verify}")
    else:
        draft = min(verify, widest)
    if verify > widest and not lookup:
        raise ValueError(
            f"num_speculative_tokens={verify} is above the drafter's block (block_size "
            f"{block} drafts at most {widest}); allowed: 1..{widest}, or set "
            f"{_where('lookup')}=true to fill the rest of a longer verify block from "
            "the request's history")
    settings = DFlash2Settings(
        verify_tokens=verify, draft_tokens=draft, lookup=lookup,
        lookup_min=_int(options, "lookup_min", DFlash2Settings.lookup_min),
        lookup_max=_int(options, "lookup_max", DFlash2Settings.lookup_max),
        lookup_window=_int(options, "lookup_window", DFlash2Settings.lookup_window),
        ngram_chains=_bool(options, "ngram_chains", DFlash2Settings.ngram_chains),
    )
    if settings.lookup_min < 1:
        raise ValueError(f"{_where('lookup_min')}={settings.lookup_min}: must be >= 1")
    if settings.lookup_min > settings.lookup_max:
        raise ValueError(
            f"{_where('lookup_min')}={settings.lookup_min} is above "
            f"{_where('lookup_max')}={settings.lookup_max}; allowed: lookup_min <= "
            "lookup_max")
    if settings.lookup_window <= settings.lookup_max:
        raise ValueError(f"{_where('lookup_window')}={settings.lookup_window}: must be "
                         f"above lookup_max ({settings.lookup_max})")
    if settings.lookup and spec.draft_sample_method != "greedy":
        raise ValueError(
            f"{_where('lookup')}=true with draft_sample_method="
            f"{spec.draft_sample_method!r}: history drafts have no draft distribution "
            "for probabilistic verification; allowed: draft_sample_method 'greedy'")
    if settings.verify_tokens > settings.draft_tokens and spec.enable_adaptive_verification:
        raise ValueError(
            f"enable_adaptive_verification with a verify block ({verify}) longer than "
            f"the drafter block ({draft}): upstream's verification budget reads the "
            f"drafter's per-slot confidences; allowed: num_speculative_tokens == "
            f"{_where('draft_tokens')}, or enable_adaptive_verification false")
    resolved = asdict(settings)
    del resolved["verify_tokens"]  # num_speculative_tokens itself
    setattr(spec, FIELD, dict(sorted(resolved.items())))
    return settings


def settings_of(spec: SpeculativeConfig) -> DFlash2Settings:
    """The resolved settings of a validated DFlash2 config."""
    return DFlash2Settings(verify_tokens=spec.num_speculative_tokens, **getattr(spec, FIELD))


def verify_count(scheduled: int | None, verify_tokens: int) -> int:
    """The drafts to fill this step: the scheduler's per-step count, or the
    configured verify block where the caller passes none (dummy runs)."""
    if scheduled is None:
        return verify_tokens
    return max(0, min(scheduled, verify_tokens))
