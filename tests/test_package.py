"""The package's shape: a public API with __all__, no import circles between its modules, and one module that reads
the "auto" of a stronghold setting.

The import graph is read with `ast` (every import, module-level, in functions and under TYPE_CHECKING): a circle
is a pair of concerns that cannot be understood apart, whether or not Python would trip on it at run time.
"""
import ast
from pathlib import Path

import stronghold

PACKAGE = Path(stronghold.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the package uses absolute imports")
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                graph[name] |= submodules or {node.module}
            elif isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names} & modules.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_cycle_finder_sees_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


RESOLVER = "stronghold.config"
"""The one module that compares a value with "auto": `resolve` turns the "stronghold" section into the settings the rest
reads, where stronghold's choice is None (or a number decided there), never the string."""
DEEPSPEED_KEYS = "stronghold.deepspeed_keys"
"""Reads DeepSpeed's own keys, where "auto" is the HF Trainer's placeholder (zero_optimization.stage), not a stronghold
setting."""


def auto_comparisons(source: str) -> list[int]:
    """Lines of `source` that compare something with the string "auto": ==, !=, is, in a literal tuple / list / set,
    or a `case "auto"`. Docstrings, messages and a value set to "auto" (hf.py fills DeepSpeed's own keys with it) are
    not comparisons."""
    def is_auto(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_auto(item) for item in node.elts)
        return isinstance(node, ast.Constant) and node.value == "auto"

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(is_auto(side) for side in (node.left, *node.comparators)):
            found.add(node.lineno)
        elif isinstance(node, ast.MatchValue) and is_auto(node.value):
            found.add(node.lineno)
    return sorted(found)


def test_only_the_config_compares_with_auto():
    found = {name: lines for name, path in _modules().items()
             if name not in (RESOLVER, DEEPSPEED_KEYS) and (lines := auto_comparisons(path.read_text()))}
    assert found == {}, f"compare with \"auto\" in {RESOLVER}.resolve only; the rest reads its Settings"
    assert auto_comparisons(_modules()[RESOLVER].read_text())


def test_auto_finder_sees_a_comparison():
    source = '''
"""A docstring that says "auto"."""
def f(config, value):
    if config.window_size == "auto":
        return "auto"
    x = value not in ("auto", False, 0)
    y = {"auto": None}.get(value, "auto")
    match value:
        case "auto":
            return None
'''
    assert auto_comparisons(source) == [4, 6, 9]


def test_public_api():
    assert set(stronghold.__all__) == {"initialize", "StrongholdEngine", "StrongholdConfig", "__version__"}
    for name in stronghold.__all__:
        assert getattr(stronghold, name) is not None
    assert stronghold.StrongholdEngine.__name__ == "StrongholdEngine"
    assert stronghold.StrongholdConfig.__name__ == "StrongholdConfig"
