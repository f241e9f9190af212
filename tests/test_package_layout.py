"""The package's walls: kvpool's folders import in one direction (kernels, pools, host, storage,
then cache; transfer above pools and host; the leaf modules from anywhere), no module imports
another's private name, and no import circle closes, function-level and ``TYPE_CHECKING`` imports
included. Read from the source with ``ast``, so a violation fails here before it reaches a user.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "kvpool"
#: Folders by layer: a module may import its own folder, a lower layer, and the leaf modules.
LAYERS = {"kernels": 0, "pools": 1, "host": 2, "storage": 3, "transfer": 4, "cache": 4}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, str]]:
    """(imported kvpool module, imported name or "") for every import in the module, at any depth."""
    found = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "kvpool":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, alias.name))
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "kvpool"]
    return [(t, n) for t, n in found if t in MODULES]


EDGES = {m: _imports(m, p) for m, p in MODULES.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else ""


def test_every_folder_is_placed_in_a_layer():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"folders without a layer here: {sorted(folders - set(LAYERS))}"


def test_folders_import_only_their_own_and_lower_layers():
    wrong = []
    for m, targets in EDGES.items():
        fm = _folder(m)
        for t, _ in targets:
            ft = _folder(t)
            if fm and ft and fm != ft and LAYERS[ft] >= LAYERS[fm]:
                wrong.append(f"{m} imports {t}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_leaf_modules_import_no_folder():
    """``kvpool/checks.py``, ``errors.py``, ``config.py``, ... are imported from every folder, so they
    import none (the package's ``__init__`` aside, which exports everything)."""
    wrong = [f"{m} imports {t}" for m, ts in EDGES.items() if m != "kvpool" and not _folder(m)
             for t, _ in ts if _folder(t)]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_another_modules_private_name():
    private = [f"{m} imports {n} from {t}" for m, ts in EDGES.items() for t, n in ts
               if n.startswith("_") and not n.startswith("__")]  # fmt: skip
    assert not private, "\n".join(private)


def test_no_import_circle_closes():
    def own_package(m: str, t: str) -> bool:  # a package importing its own submodules, or the reverse
        return (MODULES[m].name == "__init__.py" and t.startswith(m + ".")) or (
            MODULES[t].name == "__init__.py" and m.startswith(t + ".")
        )

    graph = {m: {t for t, _ in ts if t != m and not own_package(m, t)} for m, ts in EDGES.items()}
    circles, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                circles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not circles, "\n".join(circles)
