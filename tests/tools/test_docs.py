"""What the docs name exists: in `docs/*.md`, `README.md` and the package folders' guides
(`README.md` under `torch_kvcanary/`), read as Markdown, every inline code span is checked
by these rules, and the first failing rule says what to change.

* A repository path: a word of a code span made of path characters with a ``/`` in it or a
  file name with an extension of `SOURCE_SUFFIXES`, ``{a,b}`` expanded; in a fenced block (a
  command), a word with a ``/`` and a file's suffix. It names a file or
  folder of the tree written from any folder above it (``worker/test_vllm_engine.py`` is
  ``tests/vllm_plugin/worker/test_vllm_engine.py``). Not checked: a path into vLLM's own
  or torch's tree (`FOREIGN_TREES`), an absolute path (a URL's, ``/metrics``), a glob or a
  placeholder (``*``, ``<``, a part in capitals or a number: ``FILE.png``), and what
  `.gitignore` ignores (build outputs, venvs).
* A code name: a dotted name (``module.name``, ``Class.method``, ``a.b.c(...)``) whose first
  part is a module, package or class of the tree's Python (`PYTHON_ROOTS`). Each next part
  must be a submodule, or a name the module defines or imports, or an attribute of the class
  (its body, ``self.x =`` in its methods, its bases of the tree), read from the source
  without importing it (the vLLM plugin's modules import vLLM, which these tests lack). A
  file name (``worker.py``) is a path, and a name of vLLM's (``vllm.…``) is not checked.
  A class with a base from outside the tree may inherit the attribute: `FOREIGN_ATTRIBUTES`
  names the few the docs use. A name whose first part is nothing of the tree (``torch``,
  ``llm_engine``, a config key) is not checked.
* An option: every ``KVCANARY_*`` environment variable the docs write is read by the code
  (`OPTION_READERS`), and every code span that is one ``kv_canary_*`` identifier is a string
  the package reads.
* A link: every relative Markdown link reaches a file, and a heading of it where it names one.
* The counters: the table of `docs/vllm_connector.md` "Counters in /metrics" names exactly
  the series `connector/stats.py` declares (its `COUNTERS`, and the gauge), each with its
  label and the label's values, and exactly those a real server exports
  (`deploy/prometheus/tests/vllm_metrics.txt`), each with the labels and values captured.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.dev_tool

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "torch_kvcanary"
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"] + sorted(PACKAGE.rglob("README.md"))
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".cpp", ".h", ".cu", ".cuh", ".json", ".yml", ".yaml", ".toml", ".txt", ".png", ".in", ".cfg"}
# The folders whose Python defines the code names the docs may write.
PYTHON_ROOTS = ("torch_kvcanary", "tools", "benchmarks", "build_tools", "tests")
# What reads the KVCANARY_* variables: the package, its build, CI, the tools and the shared
# test modules (not the tests themselves, which may set a variable no code reads).
OPTION_READERS = ("torch_kvcanary", "csrc", "build_tools", "tools", "benchmarks", ".ci", "Makefile", "setup.py")
# Attributes the docs name that a class of the tree inherits from a base outside it.
FOREIGN_ATTRIBUTES: set[str] = set()

# Paths into other projects' trees (vLLM's, torch's), an absolute path (a URL's) and an option.
FOREIGN_TREES = ("vllm/", "torch/", "/", "-")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
PATH_WORD = re.compile(r"^[\w.\-/{},]+$")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(.*\))?$")
OPTION = re.compile(r"\bKVCANARY_[A-Z0-9_]*[A-Z0-9]\b(?![*_])")
KEY = re.compile(r"^kv_canary_[a-z_]+$")


def _ignored_patterns() -> list[str]:
    lines = (REPO / ".gitignore").read_text().splitlines()
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


@cache
def _tree() -> frozenset[str]:
    """Every file and folder of the checkout (relative, '/'-separated), but what .gitignore ignores."""
    ignored = _ignored_patterns() + [".git"]
    found = set()
    for folder, folders, files in os.walk(REPO):
        folders[:] = [name for name in folders if not any(fnmatch.fnmatch(name, pattern) for pattern in ignored)]
        relative = Path(folder).relative_to(REPO)
        found |= {(relative / name).as_posix() for name in folders + files}
    return frozenset(found)


def _lines(doc: Path):
    """``doc``'s lines but its fences, each with its line number and whether it lies in a
    fenced code block."""
    fenced = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        else:
            yield number, line, fenced


def _spans(doc: Path) -> list[tuple[int, str]]:
    """The inline code spans of ``doc`` outside fenced blocks, with their line numbers."""
    return [(number, match[2].strip()) for number, line, fenced in _lines(doc) if not fenced for match in CODE_SPAN.finditer(line)]


def _fenced_lines(doc: Path) -> list[tuple[int, str]]:
    """The lines of ``doc``'s fenced code blocks (commands), with their line numbers."""
    return [(number, line) for number, line, fenced in _lines(doc) if fenced]


def _expand(word: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", word)
    if not match:
        return [word]
    return [expanded for part in match[1].split(",") for expanded in _expand(word[: match.start()] + part + word[match.end() :])]


def _path_words(span: str) -> list[str]:
    """The words of a code span that are repository paths under the rules above."""
    words = []
    for word in span.split():
        word = word.strip("\"'(),;:")
        if not PATH_WORD.match(word) or word.startswith(FOREIGN_TREES) or ".." in word or _placeholder(word):
            continue
        if "/" in word or Path(word).suffix in SOURCE_SUFFIXES:
            words += _expand(word)
    return words


def _placeholder(word: str) -> bool:
    """A path of capitals or numbers (``FILE.png``, ``1/N``) stands for one the reader picks."""
    return any(part.split(".")[0].isupper() or part.isdigit() for part in word.split("/"))


def _path_exists(word: str) -> bool:
    if any(fnmatch.fnmatch(word.split("/")[0], pattern) for pattern in _ignored_patterns()):
        return True
    word = word.rstrip("/")
    return any(path == word or path.endswith("/" + word) for path in _tree())


class _Module:
    """A module of the tree as its source says: its submodules (a package's), the names it
    defines or imports, and its classes."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        self.classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        self.imports: dict[str, tuple[str, str | None]] = {}
        self.names: set[str] = set()
        for node in _top_level(tree):
            self._declare(node)

    def _declare(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            self.names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(self, node.module, node.level)
            for alias in node.names:
                self.imports[alias.asname or alias.name] = (base, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                self.imports[alias.asname or alias.name.split(".")[0]] = (alias.name if alias.asname else alias.name.split(".")[0], None)


def _top_level(tree: ast.Module):
    """The module's top-level statements, those under its top-level if/try blocks included."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            pending += node.body
        else:
            yield node


def _absolute(module: _Module, target: str | None, level: int) -> str:
    if not level:
        return target or ""
    parts = module.name.split(".")
    base = parts if module.is_package else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


@cache
def _modules() -> dict[str, _Module]:
    """Every module of `PYTHON_ROOTS` by its dotted name from the checkout's root."""
    found = {}
    for root in PYTHON_ROOTS:
        for path in (REPO / root).rglob("*.py"):
            relative = path.relative_to(REPO)
            if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
                continue
            parts = relative.with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = _Module(name, path)
    return found


def _class_attributes(node: ast.ClassDef) -> set[str]:
    """The names a class's body defines, and those its methods set on ``self``."""
    names = set()
    for statement in node.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self":
            if isinstance(inner.ctx, ast.Store):
                names.add(inner.attr)
    return names


def _resolve_class(module: _Module, node: ast.ClassDef, parts: list[str]) -> bool:
    if not parts:
        return True
    if parts[0] in _class_attributes(node):
        return True  # an attribute's own attributes are its value's: not followed
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        found = _lookup(module, name) if name else None
        if isinstance(found, tuple) and _resolve_class(*found, parts):
            return True
        if found is None and parts[0] in FOREIGN_ATTRIBUTES:
            return True
    return False


def _lookup(module: _Module, name: str):
    """What ``name`` is in ``module``: a `_Module`, a (module, class) pair, True for another
    name it defines, or None."""
    modules = _modules()
    if f"{module.name}.{name}" in modules:
        return modules[f"{module.name}.{name}"]
    if name in module.classes:
        return module, module.classes[name]
    if name in module.imports:
        source, imported = module.imports[name]
        if imported is None:
            return modules.get(source)
        if f"{source}.{imported}" in modules:
            return modules[f"{source}.{imported}"]
        return _lookup(modules[source], imported) if source in modules else None
    return True if name in module.names else None


def _resolve(found, parts: list[str]) -> bool:
    for index, part in enumerate(parts):
        if isinstance(found, tuple):
            return _resolve_class(*found, parts[index:])
        if not isinstance(found, _Module):
            return True  # a function's or a value's attributes are not followed
        found = _lookup(found, part)
        if found is None:
            return False
    return True


def _starts(first: str) -> list:
    """What a code name's first part may be in the tree: modules so named, and classes."""
    modules = _modules()
    found = [module for name, module in modules.items() if name.split(".")[-1] == first]
    found += [(module, module.classes[first]) for module in modules.values() if first in module.classes]
    return found


def _code_name_resolves(span: str) -> bool | None:
    """Whether a code span's dotted name resolves; None where it is no code name of the tree."""
    match = DOTTED.match(span)
    if not match or span.startswith("vllm.") or Path(span).suffix in SOURCE_SUFFIXES:
        return None
    first, *rest = match[1].split(".")
    starts = _starts(first)
    if not starts:
        return None
    return any(_resolve(start, rest) for start in starts)


def _where(doc: Path, number: int) -> str:
    return f"{doc.relative_to(REPO)}:{number}"


def _missing_paths(docs: list[Path]) -> list[str]:
    missing = []
    for doc in docs:
        words = [(number, word) for number, span in _spans(doc) for word in _path_words(span)]
        # In a command, only a path with a "/" and a file's suffix: the rest are its arguments.
        words += [(n, word) for n, line in _fenced_lines(doc) for word in _path_words(line) if "/" in word and Path(word).suffix]
        missing += [f"{_where(doc, number)}: `{word}`" for number, word in words if not _path_exists(word)]
    return missing


def _unresolved_names(docs: list[Path]) -> list[str]:
    return [f"{_where(doc, number)}: `{span}`" for doc in docs for number, span in _spans(doc) if _code_name_resolves(span) is False]


def test_every_repository_path_the_docs_write_exists():
    missing = _missing_paths(DOCS)
    assert not missing, "kv-canary: these paths are not in the tree; write the file's current path:\n" + "\n".join(missing)


def test_every_code_name_the_docs_write_resolves():
    unresolved = _unresolved_names(DOCS)
    assert not unresolved, "kv-canary: these names are not defined where they say; write the current name:\n" + "\n".join(unresolved)


def _reader_files() -> list[Path]:
    files = []
    for name in OPTION_READERS:
        path = REPO / name
        files += [file for file in path.rglob("*") if file.is_file() and file.suffix != ".so"] if path.is_dir() else [path]
    shared = [file for file in (REPO / "tests").rglob("*.py") if not file.name.startswith("test_")]
    return files + shared


@cache
def _code_text() -> str:
    return "\n".join(file.read_text(errors="replace") for file in _reader_files() if "__pycache__" not in file.parts)


def test_every_option_the_docs_name_is_read_by_the_code():
    code = _code_text()
    declared_options = set(OPTION.findall(code))
    stale = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            stale += [f"{_where(doc, number)}: {name}" for name in OPTION.findall(line) if name not in declared_options]
        for number, span in _spans(doc):
            if KEY.match(span) and f'"{span}"' not in code:
                stale.append(f"{_where(doc, number)}: `{span}`")
    assert not stale, "kv-canary: no code reads these options any more; document the current ones:\n" + "\n".join(stale)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def _anchors(doc: Path) -> frozenset[str]:
    headings, fenced = [], False
    for line in doc.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            headings.append(_anchor(line.lstrip("#")))
    return frozenset(headings)


def test_every_link_between_the_docs_reaches_a_file_and_heading():
    broken = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target):
                    continue  # a URL
                path, _, anchor = target.partition("#")
                linked = (doc.parent / path).resolve() if path else doc
                if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                    broken.append(f"{_where(doc, number)}: {target}")
    assert not broken, "kv-canary: these links reach no file or heading; link the current one:\n" + "\n".join(broken)


CAPTURED = REPO / "deploy/prometheus/tests/vllm_metrics.txt"
# The labels vLLM gives every connector series (its engine labels), not the canary's.
ENGINE_LABELS = {"engine", "model_name"}
SERIES = re.compile(r"`(vllm:kv_canary_\w+)(?:\{([^}]*)\})?`")


def _documented_counters() -> dict[str, tuple[set[str], str]]:
    """The counter table of vllm_connector.md: each series, its labels and its row's text."""
    text = (REPO / "docs/vllm_connector.md").read_text()
    section = text.split("## Counters in /metrics", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = SERIES.match(line.removeprefix("| "))
        if match:
            labels = {label.split("=")[0].strip() for label in (match[2] or "").split(",") if label.strip()}
            rows[match[1]] = (labels, line)
    return rows


def _captured_series() -> dict[str, dict[str, set[str]]]:
    """Each kv_canary series of the captured /metrics, with the values of each of its own labels."""
    found: dict[str, dict[str, set[str]]] = {}
    for line in CAPTURED.read_text().splitlines():
        match = re.match(r"^(vllm:kv_canary_\w+?)(?<!_created)\{(.*)\}", line)
        if match:
            labels = found.setdefault(match[1], {})
            for key, value in re.findall(r'(\w+)="([^"]*)"', match[2]):
                if key not in ENGINE_LABELS:
                    labels.setdefault(key, set()).add(value)
    return found


def _assert_the_counters_named(documented: dict, found: dict, where: str, found_only: str) -> None:
    """The counter table's names (``documented``) are the names of ``found``, read from
    ``where`` (whose names alone it calls ``found_only``)."""
    assert set(documented) == set(found), (
        f"kv-canary: docs/vllm_connector.md's counter table and {where} differ: "
        f"documented only {sorted(set(documented) - set(found))}, {found_only} only {sorted(set(found) - set(documented))}"
    )


def test_the_counter_table_is_what_a_server_exports():
    documented, captured = _documented_counters(), _captured_series()
    _assert_the_counters_named(documented, captured, "the captured /metrics", "exported")
    for name, (labels, row) in documented.items():
        assert labels == set(captured[name]), (
            f"kv-canary: {name} is exported with the labels {sorted(captured[name])}, documented {sorted(labels)}"
        )
        for label, values in captured[name].items():
            unnamed = {value for value in values if f"`{value}`" not in row}
            assert "..." in row or not unnamed, f"kv-canary: the row of {name} does not name its {label} values {sorted(unnamed)}"


STATS = PACKAGE / "integrations/vllm/connector/stats.py"


def _constants(tree: ast.Module) -> dict[str, object]:
    """The module-level names of ``tree`` bound to a literal (a string, a tuple of strings)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return found


def _declared_counters() -> dict[str, tuple[set[str], tuple[str, ...] | None]]:
    """What `connector/stats.py` declares, read from its source: each entry of `COUNTERS`
    (``vllm:kv_canary_<name>_total``, its label, and the label's values where they are a
    literal), and each other ``vllm:kv_canary_*`` series it names whole (the gauge)."""
    tree = ast.parse(STATS.read_text())
    constants = _constants(tree)

    def value(node: ast.AST | None):
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return ast.literal_eval(node) if node is not None else None

    table = next(node.value for node in tree.body if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COUNTERS")
    declared = {}
    for entry in table.elts:
        keywords = {keyword.arg: keyword.value for keyword in entry.keywords}
        label = value(keywords.get("label"))
        declared[f"vllm:kv_canary_{value(entry.args[0])}_total"] = ({label} if label else set(), value(keywords.get("values")))
    for name in re.findall(r'name="(vllm:kv_canary_\w+)"', STATS.read_text()):
        declared.setdefault(name, (set(), None))
    return declared


def test_the_counter_table_is_what_the_connector_declares():
    documented, declared = _documented_counters(), _declared_counters()
    _assert_the_counters_named(documented, declared, "connector/stats.py's COUNTERS", "declared")
    for name, (labels, values) in declared.items():
        documented_labels, row = documented[name]
        assert labels <= documented_labels, f"kv-canary: {name} is declared with the label {labels}, documented {documented_labels}"
        unnamed = {value for value in values or () if f"`{value}`" not in row}
        assert not unnamed, f"kv-canary: the row of {name} does not name its label values {sorted(unnamed)}"


def test_each_guide_names_every_module_of_its_folder():
    """A package folder's guide (its README.md) lists its key files: every module and
    subfolder of the folder, written in backticks (``worker.py``, ``nixl/``)."""
    unnamed = []
    for guide in sorted(PACKAGE.rglob("README.md")):
        named = {span for _, span in _spans(guide)}
        for entry in sorted(guide.parent.iterdir()):
            name = f"{entry.name}/" if entry.is_dir() else entry.name
            if entry.name != "__pycache__" and (entry.suffix == ".py" or (entry.is_dir() and any(entry.rglob("*.py")))):
                if name not in named:
                    unnamed.append(f"{guide.relative_to(REPO)}: `{name}`")
    assert not unnamed, "kv-canary: these guides do not name a module of their folder; add it to Key source files:\n" + "\n".join(unnamed)
