"""The import graph between mlxserve's packages, and the layering rules it must follow.

Run it to print the graph (every import counts, inside functions too)::

    .venv/bin/python tests/import_graph.py            # package -> packages it imports
    .venv/bin/python tests/import_graph.py --modules  # module -> modules, one line each

``tests/test_layers.py`` checks ``violations()`` is empty (DESIGN.md's one-way layers).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "scheduler", "kvpool", "mlx_backend")
# The units of the package graph: subpackages of server/, the other folders whole.
SERVER_UNITS = ("api", "http", "serving", "models", "lifecycle", "webui")
# scheduler/'s numpy contract types, the only part of it the backend may import.
CONTRACT = {"batch", "memory_plan", "outputs"}
# What touches MLX: the libraries (mlx-embeddings and the mlx-vlm it imports are MLX too)
# and the backend.
MLX_PACKAGES = ("mlx", "mlx_lm", "mlx_embeddings", "mlx_vlm", "mlx_backend")
# Composition roots: they build an MLX executor and hand it to the engine.
COMPOSITION_ROOTS = ("mlxserve.server.lifecycle", "mlxserve.server.app", "mlxserve.server.cli")


def module_files() -> dict[str, Path]:
    """``mlxserve.<folder>.<...>`` -> its file, for every module of the four folders."""
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out["mlxserve." + ".".join(parts)] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Every module ``name`` imports (absolute names; relative imports resolved)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            # "from pkg import module" imports the module when it is one.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    """module -> the mlxserve modules and external top-level packages it imports."""
    files = module_files()
    out = {}
    for name, path in files.items():
        deps = set()
        for imported in imports_of(name, path):
            if imported.startswith("mlxserve."):
                if imported in files:
                    deps.add(imported)
            else:
                deps.add(imported.split(".")[0])
        out[name] = deps - {name}
    return out


def unit(module: str) -> str:
    """The package-graph unit of a module (``server.api``, ``scheduler``, ``mlx`` ...)."""
    parts = module.split(".")
    if parts[0] != "mlxserve":
        return parts[0]
    if parts[1] == "server" and len(parts) > 2 and parts[2] in SERVER_UNITS:
        return f"server.{parts[2]}"
    return parts[1]


def violations(modules: dict[str, set[str]] | None = None) -> list[str]:
    """Imports of ``modules`` (default: this checkout's ``graph()``) that break DESIGN.md's
    layers, one line each (empty: none)."""
    bad = []
    for module, deps in sorted((graph() if modules is None else modules).items()):
        here = unit(module)
        for dep in sorted(deps):
            there = unit(dep)
            short = dep.removeprefix("mlxserve.")
            if here in ("scheduler", "kvpool") and there in MLX_PACKAGES:
                bad.append(f"{module} imports {short}: {here}/ never touches MLX")
            if here in ("scheduler", "kvpool") and there.startswith("server"):
                bad.append(f"{module} imports {short}: {here}/ never imports the server")
            if here == "kvpool" and there == "scheduler":
                bad.append(f"{module} imports {short}: kvpool/ is below the scheduler")
            if here == "mlx_backend" and there.startswith("server"):
                bad.append(f"{module} imports {short}: mlx_backend/ never imports the server")
            if here == "mlx_backend" and there == "scheduler":
                if short.split(".")[1] not in CONTRACT:
                    bad.append(f"{module} imports {short}: only scheduler's contract types")
            composition = module.startswith(COMPOSITION_ROOTS)
            if here.startswith("server") and not composition:
                if there in MLX_PACKAGES:
                    bad.append(f"{module} imports {short}: only composition roots touch MLX")
                if short in ("scheduler.engine", "scheduler.scheduler"):
                    bad.append(f"{module} imports {short}: the server uses EngineClient")
            if here == "server.serving" and there == "server.api":
                bad.append(f"{module} imports {short}: the neutral pipeline knows no protocol")
            if here == "server.http" and there in ("server.serving", "server.api"):
                bad.append(f"{module} imports {short}: http/ is below the serving pipeline")
    return bad


def package_edges() -> dict[str, set[str]]:
    """unit -> the units it imports (external packages: only mlx and mlx_lm shown)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, deps in graph().items():
        here = unit(module)
        edges[here]
        for dep in deps:
            there = unit(dep)
            if there != here and (dep.startswith("mlxserve.") or there in ("mlx", "mlx_lm")):
                edges[here].add(there)
    return edges


def main(argv: list[str]) -> int:
    if "--modules" in argv:
        for module, deps in sorted(graph().items()):
            inner = sorted(d.removeprefix("mlxserve.") for d in deps if d.startswith("mlxserve."))
            print(f"{module.removeprefix('mlxserve.')} -> {', '.join(inner) or '-'}")
    else:
        for here, theirs in sorted(package_edges().items()):
            print(f"{here:18} -> {', '.join(sorted(theirs)) or '-'}")
    bad = violations()
    print(f"\n{len(bad)} layering violations" + (":" if bad else ""))
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
