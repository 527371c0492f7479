"""The compiled attention ops of a pinned upstream wheel, and the Python calls into them.

``extract`` reads the op schemas out of the wheel's compiled extensions (their .rodata
strings), ``Snapshot`` is the committed copy in ``fa2/schemas/<version>.txt``, and
``check_calls`` binds every ``torch.ops.<namespace>.<op>(...)`` call in a source tree to
its schema with Python's ast, so a changed kernel signature fails at build time, not on
a GPU.
"""

from __future__ import annotations

import ast
import re
import tarfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.abi import elf, opschema
from kiln.abi.opschema import Schema
from kiln.errors import KilnError
from kiln.paths import REPO_ROOT
from kiln.upstream.fetch import PristineFiles
from kiln.upstream.lock import version_key

FA2_DIR = REPO_ROOT / "fa2"
PIN_PATH = FA2_DIR / "PIN"
FA_EXTENSIONS = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
                 "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
STABLE_EXTENSION = re.compile(r"^vllm/_C_stable_libtorch[^/]*\.so$")
# The shared extension registers hundreds of non-attention ops, and a schema string does
# not name its namespace, so the attention ones are named here.
STABLE_ATTENTION_OPS = {
    "_C": ("merge_attn_states",),
    "_C_cache_ops": ("reshape_and_cache", "reshape_and_cache_flash", "concat_and_cache_mla"),
}
# Where upstream calls the attention ops (all of its package: calls move between files,
# as 0.34.0's vllm/_cpu_ops.py showed), and where the fork's own code may.
UPSTREAM_SCAN = ("vllm",)
FORK_SCAN = ("vllm/fork", "kvarn", "specattn")
# The fork's packages where an installed tree holds them: the upstream scan leaves them
# out, since the fork's code is read from the checkout.
INSTALLED_FORK = ("vllm/fork", "vllm/kvarn", "vllm/specattn")
# A file that calls an op names torch.ops, or imports ``ops`` from torch; only those parse.
_MAY_CALL_OPS = re.compile(r"torch\.ops|from\s+torch\s+import\s*\(?[\w\s,]*\bops\b")
FA_CMAKE = "cmake/external_projects/vllm_flash_attn.cmake"
_GIT = re.compile(r"GIT_REPOSITORY\s+(\S+)\s+GIT_TAG\s+([0-9a-f]{7,40})\b")
# A NUL-terminated string that looks like 'name(...) -> ...'; the parser decides.
_CANDIDATE = re.compile(rb"(?<![^\0])[A-Za-z_][A-Za-z0-9_.]*\([^\0]*\)\s*->[^\0]+")
_HEADER = re.compile(r"^\[(?P<ns>\w+)\] (?P<binary>\S+) (?P<scope>every-op|listed-ops)$")


@dataclass
class Namespace:
    name: str
    binary: str
    every_op: bool  # every op of the namespace is here, so a call to another is an error
    schemas: dict[str, Schema] = field(default_factory=dict)  # by qualified name


@dataclass
class Snapshot:
    version: str
    wheel: str
    namespaces: dict[str, Namespace]

    @property
    def count(self) -> int:
        return sum(len(ns.schemas) for ns in self.namespaces.values())

    def render(self) -> str:
        lines = [f"# Attention op schemas of vLLM {self.version}, extracted from {self.wheel}",
                 f"# by `python -m kiln fa2-snapshot --version {self.version}`; do not edit.",
                 ("# [namespace] binary every-op|listed-ops (every-op: a call to any other op "
                 "of the namespace is an error)")]
        for ns in self.namespaces.values():
            scope = "every-op" if ns.every_op else "listed-ops"
            lines += ["", f"[{ns.name}] {ns.binary} {scope}", *(str(s) for s in ns.schemas.values())]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, version: str, source: str) -> Snapshot:
        wheel, namespaces, current = "", {}, None
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if line.startswith("# Attention op schemas"):
                wheel = line.rsplit(" ", 1)[-1]
            if not line or line.startswith("#"):
                continue
            if m := _HEADER.match(line):
                current = Namespace(m["ns"], m["binary"], m["scope"] == "every-op")
                namespaces[current.name] = current
            elif current is None:
                raise KilnError(f"{source} line {number}: a schema before any "
                                "'[namespace] binary every-op|listed-ops' header")
            else:
                schema = opschema.parse(line, f"{source} line {number}")
                current.schemas[schema.qualified] = schema
        if not namespaces:
            raise KilnError(f"{source}: no namespaces; regenerate it with "
                            f"`python -m kiln fa2-snapshot --version {version}`")
        return cls(version, wheel, namespaces)

    @classmethod
    def load(cls, version: str, directory: Path = FA2_DIR) -> Snapshot:
        path = snapshot_path(version, directory)
        if not path.exists():
            raise KilnError(f"{path} is missing; write it with "
                            f"`python -m kiln fa2-snapshot --version {version}`")
        return cls.parse(path.read_text(), version, str(path))


def snapshot_path(version: str, directory: Path = FA2_DIR) -> Path:
    return directory / "schemas" / f"{version}.txt"


def schemas_in(data: bytes, source: str) -> list[Schema]:
    """Every op schema string in the binary's .rodata, in file order, once each."""
    rodata = [s for s in elf.sections(data, source) if s.name == ".rodata"]
    if not rodata:
        raise KilnError(f"{source}: no .rodata section, so no op schema can be read; "
                        "expected a compiled torch extension")
    found: dict[str, Schema] = {}
    for section in rodata:
        for m in _CANDIDATE.finditer(data, section.offset, section.end):
            try:
                schema = opschema.parse(m.group().decode("ascii"), source)
            except (KilnError, UnicodeDecodeError):
                continue  # a message that merely looks like a schema
            found.setdefault(str(schema), schema)
    if not found:
        raise KilnError(f"{source}: no op schema string ('name(args) -> returns') in its "
                        ".rodata; expected a torch extension that registers ops")
    return list(found.values())


def extract(files: PristineFiles) -> Snapshot:
    """The attention op schemas of the pinned wheel's compiled extensions."""
    namespaces: dict[str, Namespace] = {}
    with zipfile.ZipFile(files.wheel) as wheel:
        names = wheel.namelist()
        stable = sorted(n for n in names if STABLE_EXTENSION.match(n))
        missing = [n for n in FA_EXTENSIONS if n not in names]
        if missing or len(stable) != 1:
            raise KilnError(f"{files.wheel.name}: expected {', '.join(FA_EXTENSIONS)} and one "
                            f"vllm/_C_stable_libtorch*.so; missing {', '.join(missing) or 'none'}, "
                            f"stable extensions found: {', '.join(stable) or 'none'}")
        for member in FA_EXTENSIONS:
            name = Path(member).name.split(".")[0]  # torch names the namespace after the extension
            ns = namespaces[name] = Namespace(name, member, every_op=True)
            for schema in schemas_in(wheel.read(member), f"{files.wheel.name}:{member}"):
                _add(ns, schema, member)
        source = f"{files.wheel.name}:{stable[0]}"
        by_name: dict[str, list[Schema]] = {}
        for schema in schemas_in(wheel.read(stable[0]), source):
            by_name.setdefault(schema.qualified, []).append(schema)
        for name, ops in STABLE_ATTENTION_OPS.items():
            ns = namespaces[name] = Namespace(name, stable[0], every_op=False)
            for op in ops:
                if len(by_name.get(op, [])) != 1:
                    raise KilnError(f"{source}: expected exactly one schema for {name}.{op}, "
                                    f"found {len(by_name.get(op, []))}")
                _add(ns, by_name[op][0], stable[0])
    return Snapshot(files.release.version, files.wheel.name, namespaces)


def _add(ns: Namespace, schema: Schema, binary: str) -> None:
    if schema.qualified in ns.schemas:
        raise KilnError(f"{binary}: two different schemas for {ns.name}.{schema.qualified}: "
                        f"{ns.schemas[schema.qualified]} and {schema}")
    ns.schemas[schema.qualified] = schema


@dataclass(frozen=True)
class FaPin:
    version: str
    commit: str
    repository: str
    how: str

    def __str__(self) -> str:
        return f"{self.version} {self.commit} {self.repository} {self.how}"


def flash_attention_pin(files: PristineFiles) -> FaPin:
    """The FlashAttention commit the sdist's CMake builds ``vllm_flash_attn`` from.

    The binaries are searched for that commit too, so the file says whether they embed it.
    """
    member = f"vllm-{files.release.version}/{FA_CMAKE}"
    with tarfile.open(files.sdist) as tar:
        try:
            text = tar.extractfile(member).read().decode()
        except KeyError:
            raise KilnError(f"{files.sdist.name} has no {member}; cannot tell the "
                            "FlashAttention commit") from None
    m = _GIT.search(text)
    if not m:
        raise KilnError(f"{files.sdist.name}:{FA_CMAKE} has no GIT_REPOSITORY ... GIT_TAG <commit>")
    repository, commit = m.groups()
    with zipfile.ZipFile(files.wheel) as wheel:
        embedded = [n for n in FA_EXTENSIONS if commit[:7].encode() in wheel.read(n)]
    found = (f"also embedded in {', '.join(Path(n).name for n in embedded)}" if embedded
             else "the .so files do not embed it")
    return FaPin(files.release.version, commit, repository,
                 f"GIT_TAG in the sdist's {FA_CMAKE}; {found}")


def write_pin(pin: FaPin, path: Path = PIN_PATH) -> None:
    """Replace ``pin.version``'s line of fa2/PIN, keeping the other versions' lines."""
    header = ["# The FlashAttention commit each carried upstream pin's compiled ops were built from.",
              "# Written by `python -m kiln fa2-snapshot --version V`; do not edit.",
              "# version commit repository how-established"]
    lines = path.read_text().splitlines() if path.exists() else []
    kept = [line for line in lines if line and not line.startswith("#") and line.split()[0] != pin.version]
    entries = sorted([*kept, str(pin)], key=lambda line: version_key(line.split()[0]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header + entries) + "\n")


@dataclass(frozen=True)
class OpCall:
    path: str
    line: int
    namespace: str
    op: str  # qualified: name or name.overload
    positional: tuple[ast.expr, ...]
    keywords: tuple[ast.keyword, ...]

    def where(self) -> str:
        return f"{self.path}:{self.line}: torch.ops.{self.namespace}.{self.op}"


def _chain(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _aliases(tree: ast.AST) -> dict[str, list[str]]:
    """Names bound to ``torch.ops`` or below it anywhere in the file (``ops = torch.ops._C``)."""
    aliases: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for a in node.names:
                if a.name == "ops":
                    aliases[a.asname or a.name] = ["torch", "ops"]
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            chain = _chain(node.value)
            if chain and chain[:2] == ["torch", "ops"] and len(chain) >= 3:
                aliases[node.targets[0].id] = chain
    return aliases


def calls_in(text: str, path: str) -> list[OpCall]:
    """Every call of a ``torch.ops`` op in the source, directly or through an alias."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise KilnError(f"{path}:{e.lineno}: not valid Python ({e.msg}); cannot check its op calls") from None
    aliases = _aliases(tree)
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        chain = _chain(node.func)
        if chain and chain[0] in aliases:
            chain = aliases[chain[0]] + chain[1:]
        if not chain or chain[:2] != ["torch", "ops"] or len(chain) not in (4, 5):
            continue
        namespace, op, *overload = chain[2:]
        qualified = op if overload in ([], ["default"]) else f"{op}.{overload[0]}"
        calls.append(OpCall(path, node.lineno, namespace, qualified,
                            tuple(node.args), tuple(node.keywords)))
    return calls


def _is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def bind(call: OpCall, schema: Schema) -> list[str]:
    """What keeps the call from binding to the schema; empty when it binds."""
    if any(isinstance(a, ast.Starred) for a in call.positional) or any(
            k.arg is None for k in call.keywords):
        return [("passes *args or **kwargs, so its binding cannot be checked; "
                "pass each argument by position or by name")]
    problems, bound = [], {}
    positional = schema.positional
    if len(call.positional) > len(positional):
        problems.append(f"{len(call.positional)} positional arguments, the schema takes at "
                        f"most {len(positional)}")
    for arg, value in zip(positional, call.positional):
        bound[arg.name] = value
    names = ", ".join(a.name for a in schema.arguments)
    for keyword in call.keywords:
        if schema.argument(keyword.arg) is None:
            problems.append(f"keyword {keyword.arg!r} is not an argument; allowed: {names}")
        elif keyword.arg in bound:
            problems.append(f"argument {keyword.arg!r} given by position and by keyword")
        else:
            bound[keyword.arg] = keyword.value
    missing = [a.name for a in schema.arguments if a.required and a.name not in bound]
    if missing:
        problems.append(f"missing required argument(s) {', '.join(missing)} (an argument "
                        "without a default must be passed, even when it may be None)")
    for arg in schema.arguments:
        if arg.name in bound and _is_none(bound[arg.name]) and not arg.optional:
            problems.append(f"passes None to {arg.name}, whose type {arg.type} is not optional")
    return problems


@dataclass
class CheckReport:
    checked: list[OpCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    files: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def python_files(root: Path, scan: Iterable[str]) -> list[Path]:
    """The Python files under each scanned path; a path that holds one of the fork's
    installed packages (INSTALLED_FORK) without naming it leaves that package out."""
    files = []
    for entry in scan:
        path = root / entry
        if path.is_file():
            files.append(path)
            continue
        skip = [root / p for p in INSTALLED_FORK if p.startswith(entry.rstrip("/") + "/")]
        files += [f for f in sorted(path.rglob("*.py")) if not any(s in f.parents for s in skip)]
    return files


def check_calls(roots: Iterable[tuple[Path, Iterable[str]]], snapshot: Snapshot) -> CheckReport:
    """Bind every call into the snapshot's namespaces under each (root, paths) pair."""
    report, looked = CheckReport(), []
    for root, scan in roots:
        looked += [str(root / entry) for entry in scan]
        for path in python_files(root, scan):
            report.files += 1
            shown = path.relative_to(root).as_posix()
            text = path.read_text(errors="replace")
            if not _MAY_CALL_OPS.search(text):
                continue
            for call in calls_in(text, shown):
                ns = snapshot.namespaces.get(call.namespace)
                if ns is None:
                    continue
                schema = ns.schemas.get(call.op)
                if schema is None:
                    if ns.every_op:
                        report.errors.append(
                            f"{call.where()}: op not in the {snapshot.version} snapshot of "
                            f"{ns.binary}; it has {', '.join(ns.schemas)}")
                    continue  # an op of the shared namespace that is not an attention op
                report.checked.append(call)
                report.errors += [f"{call.where()}: {p}; schema: {schema}"
                                  for p in bind(call, schema)]
    if not report.files:  # a wrong --tree would otherwise pass with nothing checked
        raise KilnError(f"no Python files to check; looked in {', '.join(looked)}")
    return report
