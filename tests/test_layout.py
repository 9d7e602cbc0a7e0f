"""The package layout holds its promises (docs/design.md, "Packages"): short files and functions, imports
that run downward only (no circles), and every public module path of earlier releases still importable."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp2lite"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_no_file_or_function_too_long() -> None:
    too_long = []
    for path in _sources():
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(PACKAGE)}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}: {node.name}() is {length} lines")
    assert not too_long, "over the limits (files 500, functions 60):\n" + "\n".join(too_long)


def _imports(path: Path) -> set[str]:
    """The fsdp2lite modules ``path`` imports, at the top or inside functions (a lazy import still
    makes a circle), resolved to module names; ``from pkg import name`` counts as importing ``pkg``
    unless ``pkg.name`` is a module of its own."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if _is_module(f"{target}.{alias.name}") else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target == "fsdp2lite" or target.startswith("fsdp2lite.")}


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PACKAGE / relative).with_suffix(".py").is_file() or (PACKAGE / relative / "__init__.py").is_file()


def _graph() -> dict[str, set[str]]:
    graph = {_module_name(path): _imports(path) for path in _sources()}
    # a package's __init__ re-exports its own modules: that edge is the package, not a dependency of it
    return {
        module: {t for t in targets if not (t.startswith(module + ".") and module in _packages())}
        for module, targets in graph.items()
    }


def _packages() -> set[str]:
    return {_module_name(path) for path in _sources() if path.name == "__init__.py"}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    """The check above would see the estimate trio's old circle (estimate -> simulate -> estimate)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_runtime_knows_nothing_above_it() -> None:
    """``_runtime/`` may use policies and mesh only: no config, CLI, estimate or integrations."""
    allowed = ("fsdp2lite._runtime", "fsdp2lite.policies", "fsdp2lite.mesh")
    for path in sorted((PACKAGE / "_runtime").glob("*.py")):
        wrong = {t for t in _imports(path) if not t.startswith(allowed)}
        assert not wrong, f"{path.name} imports {sorted(wrong)}"


def test_host_engine_sits_beside_the_runtime() -> None:
    """``host/`` (the host engine: gradient pool, host steps, NVMe state) uses the runtime and nothing above it,
    and the runtime reaches it only through ``seams.HostSide`` ([Note: the host engine]); ``Comm`` holds none of it."""
    allowed = ("fsdp2lite.host", "fsdp2lite._runtime", "fsdp2lite.policies", "fsdp2lite.mesh")
    for path in sorted((PACKAGE / "host").glob("*.py")):
        wrong = {t for t in _imports(path) if not t.startswith(allowed)}
        assert not wrong, f"host/{path.name} imports {sorted(wrong)}"
    from fsdp2lite._runtime.comm import Comm

    # Comm is streams, events and work handles only: no host engine, no trace recorder or wire counts (Meters)
    assert set(Comm.__annotations__) == {"device", "streams", "wait_instead"}, Comm.__annotations__


PUBLIC_PATHS = [
    ("fsdp2lite", "fully_shard"),
    ("fsdp2lite", "FSDPModule"),
    ("fsdp2lite.api", "fully_shard"),
    ("fsdp2lite.api", "FSDPModule"),
    ("fsdp2lite.api", "UnshardHandle"),
    ("fsdp2lite.api", "register_fsdp_forward_method"),
    ("fsdp2lite.config", "FSDPConfig"),
    ("fsdp2lite.config", "ConfigError"),
    ("fsdp2lite.config", "Problem"),
    ("fsdp2lite.config", "apply_config"),
    ("fsdp2lite.config", "plan_config"),
    ("fsdp2lite.config", "Match"),
    ("fsdp2lite.config", "WrapRule"),
    ("fsdp2lite.config", "ScheduleConfig"),
    ("fsdp2lite.config", "problems_from"),
    ("fsdp2lite.checkpoint", "save_checkpoint"),
    ("fsdp2lite.checkpoint", "load_checkpoint"),
    ("fsdp2lite.checkpoint", "CheckpointError"),
    ("fsdp2lite.checkpoint", "read_metadata"),
    ("fsdp2lite.consolidate", "consolidate"),
    ("fsdp2lite.consolidate", "TensorEntry"),
    ("fsdp2lite.consolidate", "write_output"),
    ("fsdp2lite.migrate", "migrate"),
    ("fsdp2lite.migrate", "MigrationError"),
    ("fsdp2lite.estimate", "estimate_memory"),
    ("fsdp2lite.estimate", "MemoryEstimate"),
    ("fsdp2lite.estimate", "make_optimizer"),
    ("fsdp2lite.estimate", "BREAKDOWN_KEYS"),
    ("fsdp2lite.estimate", "sharded_nbytes"),
]


@pytest.mark.parametrize(("module", "name"), PUBLIC_PATHS)
def test_public_paths_of_earlier_releases(module: str, name: str) -> None:
    import fsdp2lite

    value = getattr(importlib.import_module(module), name)
    if name in fsdp2lite.__all__:
        assert value is getattr(fsdp2lite, name), f"{module}.{name} is not fsdp2lite.{name}"


def test_one_checkpoint_error_and_one_consolidate_module() -> None:
    import fsdp2lite
    import fsdp2lite.checkpoint.consolidate as moved
    import fsdp2lite.consolidate as old

    assert old is moved  # monkeypatching either path patches the one module
    assert moved.CheckpointError is fsdp2lite.CheckpointError
    assert issubclass(fsdp2lite.CheckpointError, ValueError)


def test_every_public_name_is_exported() -> None:
    import fsdp2lite

    missing = [name for name in fsdp2lite.__all__ if not hasattr(fsdp2lite, name)]
    assert not missing


STORAGE_FILES = (
    "host_arena.py",
    "host_masters.py",
    "host_storage.py",
    "replicas.py",
    "shard_home.py",
    "storages.py",
    "zero.py",
)


def _param_writes(path: Path) -> list[str]:
    """Assignments to an attribute reached from a parameter (``param.x = ``, ``param.sharded_param._y = ``)."""
    writes = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            root = target
            while isinstance(root, ast.Attribute | ast.Subscript):
                root = root.value
            if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in ("param", "p"):
                writes.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
    return writes


def test_offload_is_a_storage() -> None:
    """Issue 52 item 4: storages change a parameter only through its named methods, never by writing its fields
    ([Note: shard storage]), and the runtime asks a shard's home where it lives ([Note: shard home]): the offload
    flag is read only where the storages are chosen (``storages.param_storage``) and as ParamPolicy's field."""
    writes = [w for name in STORAGE_FILES for w in _param_writes(PACKAGE / "_runtime" / name)]
    assert not writes, writes
    runtime = sorted((PACKAGE / "_runtime").glob("*.py"))
    readers = {p.name: p.read_text(encoding="utf-8").count("offload_to_cpu") for p in runtime}
    assert {name: n for name, n in readers.items() if n} == {"param_policy.py": 1, "storages.py": 1}, readers
