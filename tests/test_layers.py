"""The layout's rules, checked over the source (AST; imports inside functions count too): no import circle between
modules, and no module imports from a layer above its own. docs/usage.md, "Layout", describes the layers."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"

# Lowest first. A module's layer is that of the longest name here that it is, or is inside of.
LAYERS = [
    ("foundations", ["speculate.errors", "speculate.grammar", "speculate.tree_shape", "speculate.sampling",
                     "speculate.stats", "speculate.text", "speculate.params", "speculate.plugins"]),
    ("models", ["speculate.models"]),
    ("parts", ["speculate.verifiers", "speculate.drafters", "speculate.heads", "speculate.heads.io",
               "speculate.heads.eagle", "speculate.heads.medusa", "speculate.policy"]),
    ("engine", ["speculate.engine", "speculate.spec", "speculate"]),
    ("server", ["speculate.server"]),
    ("bench", ["speculate.bench"]),
    ("tools", ["speculate.heads.command", "speculate.heads.train", "speculate.heads.data", "speculate.answers",
               "speculate.calc"]),
    ("cli", ["speculate.cli", "speculate.__main__"]),
    ("deploy", ["speculate.serve_ray"]),  # Ray Serve's application builder: settings through the CLI's parser
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the speculate modules it imports (a name imported from a package is its submodule where one is)."""
    paths = {module_name(p): p for p in SRC.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    out.add(sub if sub in paths else target)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
        graph[name] = {m for m in out if m in paths and m != name}
    return graph


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), as sorted names."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_reads_relative_and_lazy_imports():
    graph = import_graph()
    assert "speculate.models.cpu" in graph["speculate.models.kernel"]  # from .cpu import ...
    assert "speculate.models.fast" in graph["speculate.models.kv"]  # inside KVModel()
    assert "speculate.models.loader" in graph["speculate.models"]  # from .loader import ... in a package


def test_no_import_circle():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # (the check finds one)


def test_no_import_from_a_higher_layer():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert upward == []


def test_the_docs_layout_names_every_module_and_only_real_ones():
    """docs/usage.md's "Layout" block cannot go stale: it names every source file, and every file it names exists."""
    import re

    docs = (SRC.parent / "docs" / "usage.md").read_text()
    block = docs.split("## Layout", 1)[1].split("```", 2)[1]
    named = set(re.findall(r"\b([a-z_0-9]+\.(?:py|c))\b", block))
    files = {p.name for p in (SRC / "speculate").rglob("*") if p.suffix in (".py", ".c")} - {"__init__.py",
                                                                                             "__main__.py"}
    assert sorted(files - named) == [], "source files the layout does not name"
    assert sorted(named - files) == [], "files the layout names that do not exist"
