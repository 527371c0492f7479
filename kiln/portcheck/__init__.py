"""Port checks: what a clean rebase onto a new upstream can still break.

The series' own code is read where it runs: the lines each topic adds (on the
old pristine tree with the series applied up to that topic) and the overlay
modules under ``vllm/`` and ``kvarn/``. Every upstream name, call, base class
and enum it reaches is compared between the old and the new pristine trees,
whose API model griffe builds statically (nothing is imported). Findings:

- ``removed-name``: a name the code uses that the new upstream no longer defines;
- ``moved``: such a name that the new upstream defines in another module;
- ``changed-signature``: a call whose arguments bind differently (or not at all);
- ``override``: a fork method that no longer takes what its upstream base declares;
- ``enum-collision``: a fork enum member whose value meets a new upstream member;
- ``body-drift``: an upstream function a topic patches whose body changed;
- ``unparsed``: a file (fork or upstream) that does not parse here, so nothing in it
  was checked: reported, never skipped.

One concern per module: ``findings`` (what is reported), ``apimodel`` (a tree's API
through griffe), ``signatures`` (binding calls), ``units`` (the series' own code),
``uses`` (the upstream names it reaches), ``checks`` (the checks), ``accept`` (the
reviewed list); ``port_check`` here runs them.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from kiln.portcheck.apimodel import ApiModel
from kiln.portcheck.checks import PortCheck
from kiln.portcheck.findings import KINDS, UPSTREAM_TOPIC, Finding
from kiln.portcheck.units import overlay_units, series_units
from kiln.portcheck.uses import uses
from kiln.series import Series

__all__ = ["Finding", "port_check"]


def port_check(old_root: Path, old_version: str, new_root: Path, new_version: str,
               series: Series, overlays: list[tuple[Path, str]]) -> list[Finding]:
    """All findings for moving ``series`` (+ overlays) from the old tree to the new one."""
    with tempfile.TemporaryDirectory(prefix="kiln-port-check-") as tmp:
        unparsed: list[Finding] = []
        units = series_units(old_root, series, Path(tmp), unparsed)
        patched = ApiModel(Path(tmp) / "tree", f"{old_version}+series")
        overlay = overlay_units(overlays, series, unparsed)
        check = PortCheck(ApiModel(old_root, old_version), ApiModel(new_root, new_version), patched,
                          {u.module for u in overlay})
        findings: set[Finding] = set(unparsed)
        for unit in [*units, *overlay]:
            for use in uses(unit):
                findings.update(check.check_use(use))
            findings.update(check.check_overrides(unit))
            findings.update(check.check_enums(unit))
            findings.update(check.check_drift(unit))
        for model in (check.old, check.new, patched):
            findings.update(e.finding(UPSTREAM_TOPIC) for e in model.unparsed)
    first: dict[tuple[str, str, str], Finding] = {}
    for finding in sorted(findings, key=lambda f: (KINDS.index(f.kind), f.topic, f.where, _site_line(f))):
        first.setdefault(finding.key(), finding)  # one finding per name and place: its first use
    return list(first.values())


def _site_line(finding: Finding) -> int:
    m = re.match(r"[^:]+:(\d+)", finding.detail)
    return int(m.group(1)) if m else 0
