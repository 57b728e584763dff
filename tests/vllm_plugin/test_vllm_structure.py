"""The package's structure, read from its source files (no vLLM needed): no module imports
itself through others, and only the vLLM adapter subpackage
(`torch_kvcanary/integrations/vllm/adapter/`) reads vLLM's internals."""

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "torch_kvcanary"
ADAPTER = PACKAGE / "integrations" / "vllm" / "adapter"
INTEGRATIONS = PACKAGE / "integrations"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules an import statement of ``module`` runs: for ``from X import
    name``, X.name where that is a module, else X."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in known:
            found.add(f"{source}.{alias.name}")
        elif source in known:
            found.add(source)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package and those of the package it imports, at module level or
    inside a function alike."""
    modules = _modules()
    known = set(modules)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        graph[module] = set().union(*(_imported(node, module, is_package, known) for node in ast.walk(tree))) - {module}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph[module]):
            found = visit(imported)
            if found is not None:
                return found
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        found = visit(module)
        if found is not None:
            return found
    return None


def test_the_import_graph_is_read():
    graph = _import_graph()
    vllm = "torch_kvcanary.integrations.vllm"
    assert f"{vllm}.worker" in graph[f"{vllm}.plugin"]
    assert f"{vllm}.connector" in graph[f"{vllm}.worker"]  # inside a function
    assert "torch_kvcanary.violations" in graph[f"{vllm}.connector.facade"]


def test_no_import_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    cycle = _cycle(_import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _vllm_private_imports(tree: ast.AST) -> list[str]:
    """vLLM's private modules and private names that ``tree`` imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules, names = [node.module], [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "vllm" and (any(_private(part) for part in parts) or any(_private(name) for name in names)):
                found.append(f"line {node.lineno}: {module} {names}")
    return found


def _own_names(tree: ast.Module) -> dict[str, set[str]]:
    """Per class of the module: the names it defines itself (methods, class attributes,
    ``self.X = ...`` in its methods), with those of the module's classes it derives from."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def defined(cls: ast.ClassDef) -> set[str]:
        names = set()
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
                if node.value.id in ("self", "cls"):
                    names.add(node.attr)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id != cls.name:
                names |= defined(classes[base.id])
        return names

    return {name: defined(cls) for name, cls in classes.items()}


def _foreign_private_reads(tree: ast.Module) -> list[str]:
    """Private attributes that ``tree`` reaches on objects other than its own classes'
    instances: ``x._name`` for any ``x`` but ``self`` or ``cls``, ``self._name`` where the
    enclosing class does not define ``_name`` (a base class's, such as vLLM's), and
    getattr/setattr/hasattr/delattr of a private name."""
    own = _own_names(tree)
    found = []

    def check(node: ast.AST, cls: str | None) -> None:
        if isinstance(node, ast.ClassDef):
            cls = node.name
        if isinstance(node, ast.Attribute) and _private(node.attr):
            mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not mine or cls not in own or node.attr not in own[cls]:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            check(child, cls)

    check(tree, None)
    return found


def test_the_private_reads_are_found():
    source = """
class Ours(Base):
    def __init__(self):
        self._mine = 1

    def _helper(self):
        return self._mine, self._theirs, other._private, getattr(other, "_hidden"), super()._base()
"""
    found = _foreign_private_reads(ast.parse(source))
    assert [line.split(": ", 1)[1] for line in found] == ["self._theirs", "other._private", "getattr(other, '_hidden')", "super()._base"]
    tree = ast.parse("import vllm._custom_ops\nfrom vllm.v1 import _private\nfrom vllm.config import VllmConfig\nimport vllm\n")
    assert len(_vllm_private_imports(tree)) == 2


def test_only_the_adapter_reads_vllm_internals():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if ADAPTER in path.parents:
            continue
        tree = ast.parse(path.read_text())
        reads = _vllm_private_imports(tree)
        if INTEGRATIONS in path.parents:  # the modules that hold vLLM's objects
            reads += _foreign_private_reads(tree)
        if reads:
            found[path.relative_to(PACKAGE).as_posix()] = reads
    assert found == {}


def _members(path: Path, class_name: str) -> dict[str, list[str]]:
    """The public methods and properties of class ``class_name`` in ``path``, with their parameters' names."""
    tree = ast.parse(path.read_text())
    (found,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return {
        node.name: [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        for node in found.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def test_the_worker_implements_the_connectors_ports():
    """The connector's two ports, one per caller (the facade and drills, the verifiers),
    share no member, and the worker's port implements both."""
    vllm = INTEGRATIONS / "vllm"
    canary = _members(vllm / "connector" / "port.py", "CanaryPort")
    records = _members(vllm / "connector" / "port.py", "RecordPort")
    assert {"break_from_flagged_blocks", "drill_target"} <= set(canary) and {"records_of", "record_landed"} <= set(records)
    assert not set(canary) & set(records)
    assert _members(vllm / "worker_port.py", "WorkerPort") == {**canary, **records}


CONNECTOR = INTEGRATIONS / "vllm" / "connector"
HALVES = {"worker": "WorkerVerifier", "scheduler": "SchedulerVerifier"}
"""The fields of a `Transport`, in order, and the base class each one's class derives from."""


def _transports() -> dict[str, dict[str, tuple[str, str]]]:
    """`TRANSPORTS` as connector/transports.py writes it: each inner connector's name, with
    the (transport module, class name) of each half its entry names, by field."""
    tree = ast.parse((CONNECTOR / "transports.py").read_text())
    (table,) = [node.value for node in tree.body if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "TRANSPORTS"]
    entries = {}
    for key, call in zip(table.keys, table.values):
        fields = {**dict(zip(HALVES, call.args)), **{keyword.arg: keyword.value for keyword in call.keywords}}
        entries[key.value] = {field: (value.value.id, value.attr) for field, value in fields.items()}
    return entries


def _transport_class(module: str, name: str) -> ast.ClassDef:
    """The class ``name`` defined in the transport ``module`` (a module or a package of connector/)."""
    folder = CONNECTOR / module
    paths = sorted(folder.glob("*.py")) if folder.is_dir() else [CONNECTOR / f"{module}.py"]
    (found,) = [node for path in paths for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef) and node.name == name]
    return found


def _abstract_methods(class_name: str) -> set[str]:
    """The methods of connector/verifier.py's ``class_name`` marked abstract."""
    tree = ast.parse((CONNECTOR / "verifier.py").read_text())
    (found,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return {
        node.name for node in found.body if isinstance(node, ast.FunctionDef) and "abstractmethod" in map(ast.unparse, node.decorator_list)
    }


def test_every_transport_subclasses_the_verifier_bases_and_writes_their_abstract_methods():
    transports = _transports()
    assert {"ExampleConnector", "NixlConnector"} <= set(transports)
    assert _abstract_methods("WorkerVerifier") >= {"build", "after_save"}
    for inner, halves in transports.items():
        assert "worker" in halves, inner
        for field, (module, name) in halves.items():
            found = _transport_class(module, name)
            assert [ast.unparse(base) for base in found.bases] == [HALVES[field]], f"{inner}: {name}"
            written = {node.name for node in found.body if isinstance(node, ast.FunctionDef)}
            assert _abstract_methods(HALVES[field]) <= written, f"{inner}: {name}"


def test_transports_import_neither_each_other_nor_the_facade():
    graph = _import_graph()
    connector = "torch_kvcanary.integrations.vllm.connector"
    transports = {module for halves in _transports().values() for module, _ in halves.values()}
    assert transports >= {"disk", "nixl"}

    def modules_of(transport: str) -> set[str]:
        return {module for module in graph if module == f"{connector}.{transport}" or module.startswith(f"{connector}.{transport}.")}

    for transport in transports:
        others = set().union(*(modules_of(other) for other in transports - {transport}))
        reached = set().union(*(graph[module] for module in modules_of(transport)))
        assert not reached & (others | {f"{connector}.facade", f"{connector}.transports"}), transport


def test_the_connector_reaches_the_worker_only_through_its_port():
    graph = _import_graph()
    vllm = "torch_kvcanary.integrations.vllm"
    connector = {module for module in graph if module.startswith(f"{vllm}.connector")}
    assert f"{vllm}.connector.port" in connector
    reached = {imported for module in connector for imported in graph[module]}
    assert not reached & {f"{vllm}.worker", f"{vllm}.worker_port", f"{vllm}.plugin"}
