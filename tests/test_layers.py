"""The package's layering: imports go one way, and no module imports itself back.

Layers, lowest first (DESIGN.md): ``errors``, ``optim``, ``adaptive`` -> ``config`` ->
``parallel`` -> ``engine`` -> ``train``, ``tasks``, ``study`` -> ``cli``; the root
``bigbatch/__init__.py`` and ``__main__.py`` share the top layer with ``cli`` (which reads
``__version__`` there). Every import counts, also one
inside a function or under ``TYPE_CHECKING``: a helper that needs its caller's type
declares a Protocol instead. Importing ``bigbatch.a.b`` also runs ``bigbatch/a/__init__.py``,
so that package counts as imported too.
"""

import ast
from pathlib import Path

import pytest

import bigbatch

ROOT = Path(bigbatch.__file__).parent
LAYERS = {
    "errors": 0, "optim": 0, "adaptive": 0,
    "config": 1,
    "parallel": 2,
    "engine": 3,
    "train": 4, "tasks": 4, "study": 4, "planner": 4, "integrations": 4,
    "cli": 5,
    "__init__": 5, "__main__": 5,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The bigbatch modules (and packages) a module imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one.
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known:
                out.add(t)
                # Importing bigbatch.a.b runs bigbatch/a/__init__ too (the root excepted).
                parts = t.split(".")
                for i in range(2, len(parts)):
                    parent = ".".join(parts[:i])
                    if not name.startswith(parent + ".") and name != parent:
                        out.add(parent)
    out.discard(name)
    return out


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS["__init__" if len(parts) == 1 else parts[1]]


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def test_every_module_has_a_layer():
    unplaced = {n.split(".")[1] for n in modules() if "." in n} - set(LAYERS)
    assert not unplaced, f"add these to LAYERS (and DESIGN.md): {sorted(unplaced)}"


def test_the_top_level_stays_small():
    entries = [p.name for p in ROOT.iterdir() if not p.name.startswith((".", "__pycache__"))]
    # The twelve layers' packages (integrations the latest), __init__ and __main__.
    assert len(entries) <= 14, sorted(entries)


def test_no_upward_imports():
    upward = [f"{src} imports {dst}" for src, dsts in graph().items() for dst in sorted(dsts)
              if layer(dst) > layer(src)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    # Inside a package, its __init__ importing its own modules (and they it) is how
    # packages work; every other cycle is a design error.
    def edges(n):
        return {d for d in g[n] if not (n.startswith(d + ".") or d.startswith(n + "."))}

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(edges(n)):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state and n != "bigbatch":
            visit(n)
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("name", ["bigbatch.optim", "bigbatch.adaptive"])
def test_lowest_layers_need_only_torch_and_numpy(name):
    allowed = {"torch", "numpy", "bigbatch", "__future__"}
    import sys
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for mod, path in modules().items():
        if mod != name and not mod.startswith(name + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{mod}: {n}" for n in names
                    if n.split(".")[0] not in allowed | stdlib]
    assert not bad, bad
