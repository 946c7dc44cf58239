"""The package's import layers and the absence of import cycles (docs/architecture.md, "Layers").

Every module of `zaya_jax/` is parsed with `ast`; every import statement counts, top-level or
deferred inside a function, since a deferred import only hides a dependency until the function
runs. An import of `zaya_jax.a.b` from outside package `zaya_jax.a` also runs `zaya_jax/a/__init__`
first, so the graph gets that edge too (importing the model must not pull in the optimizer through
a package `__init__`). The test fails on
  (a) any cycle in the module graph, reported as its path;
  (b) any import from a layer to a higher one (LAYERS, lowest first; a module may import its own
      layer and every layer below);
  (c) a module that is in no layer (a new module is placed in the table when it is added);
  (d) a KNOWN_VIOLATIONS entry that no longer occurs, so the set shrinks as the fixes land.
The folders are the layers: a LAYERS entry names a folder or a top-level module, and a top-level
module is a command (`python -m zaya_jax.X`) or one of the two schemas, at most MAX_TOP_LEVEL.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import NamedTuple

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT_PACKAGE = "zaya_jax"

# Lowest first. An entry names a folder and everything in it, or a top-level module; the root
# package names only its own __init__. docs/architecture.md holds the same table
# (test_architecture_doc_has_the_layer_table keeps the two equal).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("zaya_jax", "zaya_jax.params", "zaya_jax.runtime",)),
    ("kernels", ("zaya_jax.kernels",)),
    ("parallel", ("zaya_jax.parallel",)),
    ("model", ("zaya_jax.model",)),
    ("optim", ("zaya_jax.optim",)),
    ("data", ("zaya_jax.data",)),
    ("training", ("zaya_jax.config", "zaya_jax.training",)),
    ("analysis", ("zaya_jax.sizing", "zaya_jax.analysis",)),
    (
        "programs",
        (
            "zaya_jax.hf",
            "zaya_jax.evaluate",
            "zaya_jax.lm_eval",
            "zaya_jax.generate",
            "zaya_jax.export",
            "zaya_jax.import_hf",
            "zaya_jax.reshard",
            "zaya_jax.plot",
        ),
    ),
    ("trainer", ("zaya_jax.trainer", "zaya_jax.train",)),
)

SCHEMAS = ("zaya_jax.config", "zaya_jax.params")  # the top-level modules that are not commands
MAX_TOP_LEVEL = 12  # top-level files of zaya_jax/, __init__.py included

# (importer, imported, why it is allowed for now). Each is an upward import or an edge of a cycle
# that is known and being removed; the test fails when an entry no longer occurs, so the set only
# shrinks. Empty: every layer points down.
KNOWN_VIOLATIONS: set[tuple[str, str, str]] = set()


class Import(NamedTuple):
    importer: str
    target: str  # the module the statement names (a package means its __init__)
    line: int
    deferred: bool  # inside a function: runs when the function is called


def find_modules(package_dir: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """Module name -> (file, is_package) for every .py file under package_dir."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _resolve(name: str, modules: dict) -> str | None:
    """The longest prefix of a dotted name that is a module (a name imported from it may be a
    function or class), or None outside the package."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _statement_targets(node: ast.AST, module: str, is_package: bool, modules: dict) -> list[str]:
    if isinstance(node, ast.Import):
        return [t for a in node.names if (t := _resolve(a.name, modules))]
    if node.level:  # relative: from the current package, one level up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return sorted({t for a in node.names if (t := _resolve(f"{source}.{a.name}", modules))})


def find_imports(modules: dict[str, tuple[pathlib.Path, bool]]) -> list[Import]:
    """Every import of a package module by a package module, top-level and deferred."""
    found = []
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, deferred: bool, module=module, is_package=is_package) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _statement_targets(node, module, is_package, modules):
                    found.append(Import(module, target, node.lineno, deferred))
            inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(tree, False)
    return found


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts))]


def reached(imp: Import) -> list[str]:
    """What an import statement runs: its target, plus the __init__ of each package above the target
    that the importer is not already inside."""
    inside = set(_ancestors(imp.importer)) | {imp.importer}
    return [imp.target] + [p for p in _ancestors(imp.target) if p not in inside]


def build_graph(imports: list[Import], skip: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    """Module -> modules its import statements run, without the statements (importer, target) in skip."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if (imp.importer, imp.target) in skip:
            continue
        graph.setdefault(imp.importer, set()).update(m for m in reached(imp) if m != imp.importer)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path [a, b, ..., a] per strongly connected component with more than one module."""
    return [_cycle_in(component, graph) for component in strongly_connected(graph)]


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: the modules on cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return components


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph.get(v, ()) & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w not in parent:
                    parent[w] = v
                    next_frontier.append(w)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def layer_of(module: str, layers, root: str) -> int | None:
    """Index in `layers` of the longest entry covering the module (the root names only itself)."""
    best, best_len = None, -1
    for i, (_, entries) in enumerate(layers):
        for entry in entries:
            covers = module == entry or (entry != root and module.startswith(entry + "."))
            if covers and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def _describe(imp: Import) -> str:
    return f"{imp.importer} imports {imp.target} (line {imp.line}{', deferred' if imp.deferred else ''})"


def _upward(imports: list[Import], layers, root: str) -> list[tuple[Import, str, int, int]]:
    """(import, the module it runs in the highest layer, importer's layer, that layer) for every
    import statement that runs a module of a higher layer than its importer's."""
    out = []
    for imp in imports:
        src = layer_of(imp.importer, layers, root)
        rank = {m: layer_of(m, layers, root) for m in reached(imp)}
        target = max(rank, key=lambda m: -1 if rank[m] is None else rank[m])  # the target on a tie
        if src is not None and rank[target] is not None and rank[target] > src:
            out.append((imp, target, src, rank[target]))
    return out


def _stale(imports: list[Import], upward: set[tuple[str, str]], known) -> list[str]:
    """KNOWN_VIOLATIONS entries whose import is gone, or is neither upward nor on a cycle."""
    components = strongly_connected(build_graph(imports))
    on_cycle = {
        (imp.importer, imp.target)
        for imp in imports
        for c in components
        if imp.importer in c and any(m in c for m in reached(imp))
    }
    present = {(imp.importer, imp.target) for imp in imports}
    problems = []
    for a, b, why in sorted(known):
        if (a, b) not in present:
            problems.append(f"KNOWN_VIOLATIONS entry {a} -> {b} no longer occurs ({why}): delete it")
        elif (a, b) not in upward and (a, b) not in on_cycle:
            problems.append(f"KNOWN_VIOLATIONS entry {a} -> {b} is no longer upward or on a cycle: delete it")
    return problems


def check_imports(package_dir: pathlib.Path, layers, known: set[tuple[str, str, str]]) -> list[str]:
    """Every problem (a)-(d) of the module docstring, as one line each; [] when the package is clean."""
    root = package_dir.name
    modules = find_modules(package_dir)
    imports = find_imports(modules)
    known_edges = {(a, b) for a, b, _ in known}
    problems = [
        f"{m} is in no layer: add it to LAYERS in tests/test_imports.py and docs/architecture.md"
        for m in modules
        if layer_of(m, layers, root) is None
    ]
    upward = _upward(imports, layers, root)
    for imp, target, src, dst in upward:
        if (imp.importer, imp.target) not in known_edges:
            via = "" if target == imp.target else f", via {target}/__init__"
            problems.append(
                f"upward import: {_describe(imp)}{via}: layer '{layers[src][0]}' is below '{layers[dst][0]}'"
            )
    problems += [f"import cycle: {' -> '.join(c)}" for c in find_cycles(build_graph(imports, known_edges))]
    return problems + _stale(imports, {(imp.importer, imp.target) for imp, *_ in upward}, known)


def test_zaya_jax_layers_point_down_and_have_no_cycle():
    problems = check_imports(REPO / ROOT_PACKAGE, LAYERS, KNOWN_VIOLATIONS)
    assert not problems, "\n".join(problems)


def test_top_level_modules_are_commands_or_schemas():
    package = REPO / ROOT_PACKAGE
    top = sorted(p for p in package.glob("*.py") if p.stem != "__init__")
    assert len(top) + 1 <= MAX_TOP_LEVEL, [p.name for p in top]
    strays = [
        p.name
        for p in top
        if f"{ROOT_PACKAGE}.{p.stem}" not in SCHEMAS and 'if __name__ == "__main__":' not in p.read_text()
    ]
    assert not strays, f"neither a command nor a schema, move into the folder of its layer: {strays}"


def test_layers_name_folders_and_top_level_modules():
    """A layer is made of whole folders: no entry names a module inside a folder."""
    package = REPO / ROOT_PACKAGE
    for name, entries in LAYERS:
        for entry in entries:
            parts = entry.split(".")
            if entry == ROOT_PACKAGE:
                continue
            path = package.joinpath(*parts[1:])
            whole = len(parts) == 2 and ((path / "__init__.py").exists() or path.with_suffix(".py").exists())
            assert whole, f"layer '{name}': {entry} is not a folder or a top-level module of {ROOT_PACKAGE}"


def _write_package(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / name.split("/")[0]


FAKE_LAYERS = (
    ("low", ("fake", "fake.low")),
    ("mid", ("fake.a", "fake.b")),
    ("high", ("fake.high",)),
)
FAKE_FILES = {
    "fake/__init__.py": "",
    # an upward import hidden in a function, closing a cycle with high -> low
    "fake/low.py": "def f():\n    from fake.high import g\n    return g\n",
    "fake/high.py": "from fake import low\n\ndef g():\n    return low\n",
    # a cycle inside one layer: a -> b -> a
    "fake/a.py": "from fake.b import x\n",
    "fake/b.py": "import fake.a\nx = 1\n",
}


def test_fake_package_cycle_and_upward_import_are_caught(tmp_path):
    problems = check_imports(_write_package(tmp_path, FAKE_FILES), FAKE_LAYERS, set())
    assert sorted(problems) == sorted(
        [
            "upward import: fake.low imports fake.high (line 2, deferred): layer 'low' is below 'high'",
            "import cycle: fake.a -> fake.b -> fake.a",
            "import cycle: fake.high -> fake.low -> fake.high",
        ]
    )


def test_fake_package_known_violations_are_skipped_and_stale_ones_reported(tmp_path):
    package = _write_package(tmp_path, FAKE_FILES)
    known = {
        ("fake.low", "fake.high", "being fixed"),
        ("fake.b", "fake.a", "being fixed"),
        ("fake.high", "fake.a", "fixed already"),
    }
    assert check_imports(package, FAKE_LAYERS, known) == [
        "KNOWN_VIOLATIONS entry fake.high -> fake.a no longer occurs (fixed already): delete it"
    ]
    # An edge that still exists but is neither upward nor on a cycle is stale too.
    (package / "low.py").write_text("")
    (package / "a.py").write_text("")
    problems = check_imports(package, FAKE_LAYERS, known - {("fake.high", "fake.a", "fixed already")})
    assert sorted(problems) == [
        "KNOWN_VIOLATIONS entry fake.b -> fake.a is no longer upward or on a cycle: delete it",
        "KNOWN_VIOLATIONS entry fake.low -> fake.high no longer occurs (being fixed): delete it",
    ]


def test_fake_package_init_runs_are_edges_and_unplaced_modules_fail(tmp_path):
    """`from fake.sub.leaf import x` also runs fake/sub/__init__: an edge of its own."""
    package = _write_package(
        tmp_path,
        {
            "fake/__init__.py": "",
            "fake/sub/__init__.py": "from fake.a import y\n",
            "fake/sub/leaf.py": "x = 1\n",
            "fake/a.py": "from fake.sub.leaf import x\ny = 2\n",
            "fake/stray.py": "",
        },
    )
    layers = (("low", ("fake", "fake.sub.leaf")), ("mid", ("fake.a",)), ("high", ("fake.sub",)))
    assert sorted(check_imports(package, layers, set())) == [
        "fake.stray is in no layer: add it to LAYERS in tests/test_imports.py and docs/architecture.md",
        "import cycle: fake.a -> fake.sub -> fake.a",
        "upward import: fake.a imports fake.sub.leaf (line 1), via fake.sub/__init__: layer 'mid' is below 'high'",
    ]


def layer_table(markdown: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The rows (layer, modules) of the table under the "## Layers" heading of architecture.md."""
    section = markdown.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append((cells[1], tuple(re.findall(r"`([\w.]+)`", cells[2]))))
    return tuple(rows)


def test_architecture_doc_has_the_layer_table():
    assert layer_table((REPO / "docs" / "architecture.md").read_text()) == LAYERS


BENCHMARK_TESTS = {"test_benchmarks.py", "test_systems_benchmarks.py"}


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path`, deferred ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module or ""))
    return found


def test_tests_import_nothing_from_benchmarks_but_their_own():
    """Only the benchmarks' own tests import `benchmarks`; the helpers the tests share live in
    tests/support/ or the package."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.name in BENCHMARK_TESTS:
            continue
        found += [
            f"{path.relative_to(REPO)}:{line} imports {name}"
            for line, name in _imported_modules(path)
            if name == "benchmarks" or name.startswith("benchmarks.")
        ]
    assert not found, found


def test_shared_test_helpers_live_in_support():
    """tests/ holds test files and conftest.py; what several of them use lives in tests/support/, and
    no test file or helper imports a test file."""
    tests = (REPO / "tests").glob("*.py")
    strays = [p.name for p in tests if p.name != "conftest.py" and not p.name.startswith("test_")]
    assert not strays, f"move {strays} into tests/support/"
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        found += [
            f"{path.relative_to(REPO)}:{line} imports {name}"
            for line, name in _imported_modules(path)
            if name.split(".")[0].startswith("test_") or name == "conftest"
        ]
    assert not found, found
