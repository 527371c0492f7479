"""Port checks: what a clean rebase onto a new upstream can still break.

The series' own code is read where it runs: the lines each topic adds (on the
old pristine tree with the series applied up to that topic) and every overlay
module (``vllm/``, ``kvarn/``, ``specattn/``). Every upstream name, call, base
class, attribute and enum it reaches is compared between the old and the new
pristine trees, whose API model griffe builds statically (nothing is imported).
Findings:

- ``removed-name``: a name the code uses that the new upstream no longer defines;
- ``silent-default``: such a name read through ``getattr(x, name, default)`` or
  ``hasattr``, which then give the default (or False) without an error;
- ``deprecated``: a name the new upstream deprecates (docstring, comment,
  ``@deprecated`` or a warning naming it) and the old one did not;
- ``name-match``: an attribute read on a value whose type cannot be told, whose
  name the old upstream defines (on a class or module) and the new one nowhere;
- ``moved``: a removed name that the new upstream defines in another module;
- ``changed-signature``: a call whose arguments bind differently (or not at all);
- ``override``: a fork method that no longer takes what its upstream base declares;
- ``enum-collision``: a fork enum member whose value meets a new upstream member;
- ``mirror-drift``: an upstream definition a ``# mirrors:`` marker names changed;
- ``body-drift``: an upstream function a topic patches whose body changed;
- ``unparsed``: a file (fork or upstream) that does not parse here, so nothing in it
  was checked: reported, never skipped.

One concern per module: ``findings`` (what is reported), ``apimodel`` (a tree's API
through griffe), ``treeindex`` (where a tree defines each name), ``deprecation``
(what says a definition is deprecated), ``mirrors`` (the markers), ``signatures``
(binding calls), ``units`` (the series' own code), ``uses`` (the upstream names it
reaches), ``checks`` (the checks), ``accept`` (the reviewed list); ``port_check``
here runs them.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from kiln.portcheck.apimodel import ApiModel
from kiln.portcheck.checks import PortCheck
from kiln.portcheck.findings import KINDS, UPSTREAM_TOPIC, Finding
from kiln.portcheck.units import overlay_units, series_units
from kiln.portcheck.uses import Use, uses
from kiln.series.series import Series

__all__ = ["Finding", "port_check"]


def port_check(old_root: Path, old_version: str, new_root: Path, new_version: str,
               series: Series, overlays: list[tuple[Path, str]],
               index_cache: Path | None = None) -> list[Finding]:
    """All findings for moving ``series`` (+ overlays) from the old tree to the new one.
    ``index_cache``: where the pristine trees' name indexes are kept (None: not kept)."""
    with tempfile.TemporaryDirectory(prefix="kiln-port-check-") as tmp:
        unparsed: list[Finding] = []
        old = ApiModel(old_root, old_version, index_cache)
        units = series_units(old_root, series, Path(tmp), unparsed)
        # Without topics the patched tree is the old one: no copy to make or read.
        patched = ApiModel(Path(tmp) / "tree", f"{old_version}+series") if series.topics else old
        overlay = overlay_units(overlays, series, unparsed)
        check = PortCheck(old, ApiModel(new_root, new_version, index_cache), patched,
                          {u.module for u in overlay})
        findings: set[Finding] = set(unparsed)
        for unit in [*units, *overlay]:
            for use in uses(unit, old):
                findings.update(check.check_use(use) if isinstance(use, Use) else check.check_read(use))
            findings.update(check.check_overrides(unit))
            findings.update(check.check_enums(unit))
            findings.update(check.check_mirrors(unit))
            findings.update(check.check_drift(unit))
        for model in {id(m): m for m in (check.old, check.new, patched)}.values():
            findings.update(e.finding(UPSTREAM_TOPIC) for e in model.unparsed)
    first: dict[tuple[str, str, str], Finding] = {}
    for finding in sorted(findings, key=lambda f: (KINDS.index(f.kind), f.topic, f.where, _site_line(f))):
        first.setdefault(finding.key(), finding)  # one finding per name and place: its first use
    return list(first.values())


def _site_line(finding: Finding) -> int:
    m = re.match(r"[^:]+:(\d+)", finding.detail)
    return int(m.group(1)) if m else 0
