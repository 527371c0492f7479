"""--kiln-profile in the installed fork: the table, precedence and refusals.

Arguments are parsed by upstream's own `vllm serve` parser (make_arg_parser, with the
patch's argument group) and resolved by the patched validate_parsed_serve_args, as a
real launch does; VLLM_TARGET_DEVICE=cpu, HF offline.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

try:  # 0.33.0 moved the serve arguments
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm.fork.profiles import NGRAM, PROFILE_KEYS, apply_profile

VLLM = str(Path(sys.executable).with_name("vllm"))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A local model folder: only its config.json is read (for spec=mtp)."""
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return str(path)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mtp-model")
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_next", "num_nextn_predict_layers": 1}))
    return str(path)


@pytest.fixture(scope="module")
def parser() -> FlexibleArgumentParser:
    top = FlexibleArgumentParser()
    sub = top.add_subparsers(dest="subparser")
    make_arg_parser(sub.add_parser("serve"))
    return top


def resolve(parser, model: str, *argv: str):
    """Parse `vllm serve MODEL ARGV` and apply the profile, as the serve hook does."""
    full = ["serve", model, *argv]
    args = parser.parse_args(full)
    apply_profile(args, full[1:])
    return args


def test_hook_applies_the_profile(parser, model) -> None:
    """The patched validate_parsed_serve_args resolves the profile (argv from sys.argv)."""
    args = parser.parse_args(["serve", model, "--kiln-profile", "ctx=long"])
    validate_parsed_serve_args(args)
    assert args.kv_cache_dtype == "fp8"


@pytest.mark.parametrize(("value", "dtype"), [
    ("fast", "auto"), ("long", "fp8"), ("huge", "kvarn_k4v2_g128")])
def test_ctx_sets_the_kv_cache_dtype(parser, model, value, dtype) -> None:
    assert resolve(parser, model, "--kiln-profile", f"ctx={value}").kv_cache_dtype == dtype


def test_full_profile_resolves_every_key(parser, model, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.fork.profiles"):
        args = resolve(parser, model, "--tool-call-parser", "pythonic", "--kiln-profile",
                       "ctx=huge,spec=ngram,prefix-cache,tool-strict")
    assert args.kv_cache_dtype == "kvarn_k4v2_g128"
    assert args.speculative_config == NGRAM
    assert args.enable_prefix_caching is True
    assert args.enable_auto_tool_choice is True
    assert args.tool_strict_level == "parameter"
    assert "--kv-cache-dtype kvarn_k4v2_g128 (from profile ctx=huge)" in caplog.text
    assert "--enable-prefix-caching (from profile prefix-cache)" in caplog.text


def test_card_24g_fits_the_context_to_the_pool_with_a_few_seats(parser, model) -> None:
    args = resolve(parser, model, "--kiln-profile", "card=24g,ctx=huge")
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (
        -1, 4, 2048)
    assert args.gpu_memory_utilization is None  # upstream's: sized after warm-up


def test_an_explicit_context_length_wins_over_the_card(parser, model) -> None:
    args = resolve(parser, model, "--max-model-len", "32768", "--kiln-profile", "card=24g")
    assert (args.max_model_len, args.max_num_seqs) == (32768, 4)


def test_ngram_keys_are_speculative_config_fields() -> None:
    from dataclasses import fields

    from vllm.config.speculative import SpeculativeConfig

    assert set(NGRAM) <= {f.name for f in fields(SpeculativeConfig)}


def test_no_profile_changes_nothing(parser, model) -> None:
    plain = parser.parse_args(["serve", model])
    assert vars(resolve(parser, model)) == vars(plain)


def test_explicit_flag_wins_with_a_warning(parser, model, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm.fork.profiles"):
        args = resolve(parser, model, "--kv-cache-dtype", "fp8",
                       "--kiln-profile", "ctx=huge")
    assert args.kv_cache_dtype == "fp8"
    assert "ctx=huge sets --kv-cache-dtype kvarn_k4v2_g128" in caplog.text
    assert "explicit value wins" in caplog.text


def test_explicit_default_value_still_wins(parser, model) -> None:
    """`--kv-cache-dtype auto` equals the parser default, yet was asked for."""
    args = resolve(parser, model, "--kiln-profile", "ctx=huge", "--kv_cache_dtype=auto")
    assert args.kv_cache_dtype == "auto"


def test_explicit_no_prefix_caching_wins(parser, model) -> None:
    args = resolve(parser, model, "--no-enable-prefix-caching",
                   "--kiln-profile", "prefix-cache")
    assert args.enable_prefix_caching is False


def test_explicit_speculative_config_keeps_its_keys(parser, model) -> None:
    args = resolve(parser, model, "--kiln-profile", "spec=ngram",
                   "--speculative-config.num_speculative_tokens", "2")
    assert args.speculative_config == {**NGRAM, "num_speculative_tokens": 2}


def test_explicit_other_method_wins(parser, model, caplog) -> None:
    theirs = {"method": "suffix", "num_speculative_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="vllm.fork.profiles"):
        args = resolve(parser, model, "--kiln-profile", "spec=ngram",
                       "-sc", json.dumps(theirs))
    assert args.speculative_config == theirs
    assert "the explicit config wins" in caplog.text


def refused(parser, model: str, capsys, *argv: str) -> str:
    """The error line argparse prints refusing `vllm serve MODEL ARGV` (exit 2)."""
    with pytest.raises(SystemExit) as e:
        resolve(parser, model, *argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_unknown_key_names_the_allowed_keys(parser, model, capsys) -> None:
    line = refused(parser, model, capsys, "--kiln-profile", "ctx=huge,turbo")
    assert "error: argument --kiln-profile: unknown key 'turbo'" in line
    assert ("ctx=fast|long|huge, spec=off|ngram|mtp|dflash2, card=24g, prefix-cache, "
            "tool-strict") in line


def test_unknown_value_names_the_allowed_values(parser, model, capsys) -> None:
    line = refused(parser, model, capsys, "--kiln-profile", "ctx=giant")
    assert line.endswith("error: argument --kiln-profile: ctx='giant' is not a choice; "
                         "allowed: ctx=fast|long|huge")


def test_bare_flag_refuses_a_value(parser, model, capsys) -> None:
    line = refused(parser, model, capsys, "--kiln-profile", "prefix-cache=yes")
    assert ("argument --kiln-profile: prefix-cache='yes' is not a choice; prefix-cache takes "
            "no value") in line


def test_a_profile_the_model_cannot_run_is_one_error_line_from_vllm_serve(model) -> None:
    # Refused in upstream's validation of the parsed arguments, not by argparse.
    result = subprocess.run([VLLM, "serve", model, "--kiln-profile", "spec=mtp"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm serve: error: argument --kiln-profile: spec=mtp: ")
    assert "has no MTP layers" in last


def test_a_bad_profile_is_one_error_line_from_vllm_serve(model) -> None:
    result = subprocess.run([VLLM, "serve", model, "--kiln-profile", "ctx=giant"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "vllm serve: error: argument --kiln-profile: ctx='giant' is not a choice; "
        "allowed: ctx=fast|long|huge")


def test_dflash2_without_drafter_is_refused(parser, model, capsys) -> None:
    line = refused(parser, model, capsys, "--kiln-profile", "spec=dflash2")
    assert line.startswith("vllm serve: error: argument --kiln-profile: spec=dflash2: ")
    assert "spec=dflash2 needs the drafter checkpoint" in line


def test_dflash2_with_drafter_fills_the_method(parser, model) -> None:
    args = resolve(parser, model, "--kiln-profile", "spec=dflash2",
                   "--speculative-config", '{"model": "/drafters/dflash2"}')
    assert args.speculative_config["model"] == "/drafters/dflash2"
    assert args.speculative_config["method"] == "dflash"


def test_mtp_needs_mtp_layers(parser, model, mtp_model, capsys) -> None:
    assert "has no MTP layers" in refused(parser, model, capsys, "--kiln-profile", "spec=mtp")
    args = resolve(parser, mtp_model, "--kiln-profile", "spec=mtp")
    assert args.speculative_config["method"] == "mtp"


def test_tool_strict_needs_a_tool_parser(parser, model, capsys) -> None:
    line = refused(parser, model, capsys, "--kiln-profile", "tool-strict")
    assert "pass --tool-call-parser NAME" in line


def test_help_lists_every_key_value_and_argument() -> None:
    # Wide enough that no flag is wrapped at its hyphen.
    env = {**os.environ, "COLUMNS": "400"}
    out = subprocess.run([VLLM, "serve", "--help=kiln-profile"], capture_output=True,
                         text=True, timeout=300, check=True, env=env).stdout
    assert "kiln-profile" in out
    for key in PROFILE_KEYS.values():
        for value, choice in key.choices.items():
            item = key.name if key.is_flag else f"{key.name}={value}"
            assert f"- {item}:" in out, item
            for s in choice.settings:
                assert s.flag in out
