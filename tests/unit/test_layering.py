"""The package's layering, read from the source's imports (lazy ones inside functions included).

The folders are the layers (docs/architecture.md); dependencies point down this list only:

    apps          cli/, bench/, demo/, testing/, integrations/, the package face (__init__.py)
    checkpoint    checkpointer, saving, collective, tiers, drain, catalog, commit, restore, export, handle, policy,
                  dist/, dcp/
    planner       planner/ (no torch, no I/O): only the leaves below
    engine        engine/: moves tensor bytes between a state tree and the Storage protocol
    storage       storage/: backends, knowing nothing of checkpoints
    state         state, rng, partial: state trees <-> items
    format        format/: pure data, imports only errors and the version
    leaf          errors, _version, units, knobs, events, _crash, _futures, _lifecycle

Also: no import cycle of any length, no source file over 600 lines and no class over 400.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "tiersave"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "leaf",
        (
            "tiersave._version",
            "tiersave.errors",
            "tiersave.units",
            "tiersave.knobs",
            "tiersave.events",
            "tiersave._crash",
            "tiersave._futures",
            "tiersave._lifecycle",
        ),
    ),
    ("format", ("tiersave.format",)),
    ("state", ("tiersave.state", "tiersave.reflatten", "tiersave.rng", "tiersave.partial", "tiersave.destinations")),
    ("storage", ("tiersave.storage",)),
    ("engine", ("tiersave.engine",)),
    ("planner", ("tiersave.planner",)),
    (
        "checkpoint",
        (
            "tiersave.checkpointer",
            "tiersave.saving",
            "tiersave.savelayout",
            "tiersave.collective",
            "tiersave.replicated",
            "tiersave.tiers",
            "tiersave.tierspec",
            "tiersave.reclaim",
            "tiersave.drain",
            "tiersave.drain_refs",
            "tiersave.autocompress",
            "tiersave.catalog",
            "tiersave.commit",
            "tiersave.restore",
            "tiersave.splitverify",
            "tiersave.restore_agree",
            "tiersave.replication",
            "tiersave.partdrain",
            "tiersave.replica_read",
            "tiersave.replica",
            "tiersave.export",
            "tiersave.handle",
            "tiersave.lazy",
            "tiersave.policy",
            "tiersave.references",
            "tiersave.watch",
            "tiersave.tags",
            "tiersave.leases",
            "tiersave.dist",
            "tiersave.dcp",
        ),
    ),
    (
        "apps",
        ("tiersave.cli", "tiersave.bench", "tiersave.demo", "tiersave.testing", "tiersave.integrations", "tiersave"),
    ),
]

# Narrower rules than "its layer or below".
ONLY = {
    "format": ("tiersave.errors", "tiersave._version", "tiersave.format"),
    "planner": ("tiersave.errors", "tiersave.units", "tiersave.planner"),
}
NO_THIRD_PARTY = {"planner": ("torch", "numpy")}
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(importer: str, path: Path, node: ast.ImportFrom) -> list[str]:
    if node.level:
        base = importer.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join([*base, node.module] if node.module else base)
    else:
        target = node.module or ""
    # `from . import knobs` imports the module tiersave.knobs, not the package face
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
    return subs or [target]


def _imports(name: str, path: Path) -> tuple[set[str], set[str]]:
    """(tiersave modules imported, third-party top-level packages imported), anywhere in the file."""
    ours: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            for target in _resolve(name, path, node):
                (ours if target.split(".")[0] == "tiersave" else others).add(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                (ours if alias.name.split(".")[0] == "tiersave" else others).add(alias.name)
    return ours, {o.split(".")[0] for o in others if o}


def _layer(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def _owner(module: str) -> str:
    """The module's own file (``tiersave.format.layout`` -> itself; ``tiersave.storage`` -> the package)."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_dependencies_point_down():
    violations = []
    for module, path in MODULES.items():
        own = _layer(module)
        own_name = LAYERS[own][0]
        ours, third_party = _imports(module, path)
        for target in ours:
            target_layer = _layer(_owner(target))
            if target_layer > own:
                violations.append(f"{module} ({own_name}) imports {target} ({LAYERS[target_layer][0]})")
            allowed = ONLY.get(own_name)
            if allowed and not any(target == a or target.startswith(a + ".") for a in allowed):
                violations.append(f"{module} ({own_name}) may import only {allowed}, imports {target}")
        banned = [b for b in NO_THIRD_PARTY.get(own_name, ()) if b in third_party]
        violations.extend(f"{module} ({own_name}) imports {b}" for b in banned)
    assert violations == []


def test_the_library_never_imports_its_applications():
    apps = ("tiersave.cli", "tiersave.bench", "tiersave.demo", "tiersave.testing", "tiersave.integrations")
    violations = []
    for module, path in MODULES.items():
        if module == "tiersave" or any(module == a or module.startswith(a + ".") for a in apps):
            continue
        targets = _imports(module, path)[0]
        violations.extend(
            f"{module} imports {t}" for t in targets if any(t == a or t.startswith(a + ".") for a in apps)
        )
    assert violations == []


def test_no_import_cycles():
    graph = {m: {_owner(t) for t in _imports(m, p)[0]} - {m} for m, p in MODULES.items()}
    # the package face re-exports lazily (importlib), so it is not part of any cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    assert cycles == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_sizes(module):
    path = MODULES[module]
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path} has {len(text.splitlines())} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_CLASS_LINES, f"{path}: class {node.name} has {length} lines"


def test_the_checker_sees_a_violation(tmp_path):
    """The rules can fail: a storage module importing the engine, even lazily, is found."""
    fake = SRC / "tiersave" / "storage" / "base.py"
    tree = ast.parse("def f():\n    from ..engine import pipeline\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    targets = _resolve("tiersave.storage.base", fake, node)
    assert targets == ["tiersave.engine.pipeline"]
    assert _layer(_owner(targets[0])) > _layer("tiersave.storage.base")
