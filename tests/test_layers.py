"""The package layout: one import root, one-way layers (DESIGN.md), every package installed.

The graph and its rules are in ``tests/import_graph.py`` (run it to print the graph).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

from tests.import_graph import FOLDERS, ROOT, graph, violations


class TestLayers:
    def test_the_code_follows_the_layers(self) -> None:
        bad = violations()
        assert not bad, "layering violations:\n" + "\n".join(bad)

    def test_the_rules_catch_what_they_forbid(self) -> None:
        forbidden = {
            "mlxserve.scheduler.engine": {"mlx", "mlxserve.mlx_backend.executor"},
            "mlxserve.kvpool.token_allocator": {"mlxserve.scheduler.request"},
            "mlxserve.mlx_backend.executor": {"mlxserve.scheduler.engine"},
            "mlxserve.mlx_backend.sampler": {"mlxserve.server.app"},
            "mlxserve.server.serving.choices": {"mlxserve.server.api.openai.schemas"},
            "mlxserve.server.api.openai.routes": {"mlxserve.scheduler.engine", "mlx"},
            "mlxserve.server.http.auth": {"mlxserve.server.serving.generation"},
        }
        bad = violations(forbidden)
        found = {line.split()[0] for line in bad}
        assert found == set(forbidden), bad
        assert len(bad) == 9, bad

    def test_the_scheduler_never_imports_mlx(self) -> None:
        for module, deps in graph().items():
            if module.startswith(("mlxserve.scheduler", "mlxserve.kvpool")):
                assert not {"mlx", "mlx_lm"} & deps, (module, deps)


class TestInstall:
    def test_every_package_folder_is_listed_for_the_wheel(self) -> None:
        # Folders without __init__.py hold data (the chat page's files): listed too, so
        # that setuptools ships them as namespace packages, with their package-data.
        config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
        listed = set(config["packages"])
        folders = [
            path
            for folder in FOLDERS
            for path in [ROOT / folder, *(ROOT / folder).rglob("*")]
            if path.is_dir() and path.name != "__pycache__"
        ]
        on_disk = {"mlxserve." + ".".join(path.relative_to(ROOT).parts) for path in folders}
        assert listed == on_disk, (sorted(on_disk - listed), sorted(listed - on_disk))
        assert config["package-dir"] == {f"mlxserve.{f}": f for f in FOLDERS}
        data = {
            "mlxserve." + ".".join(path.relative_to(ROOT).parts)
            for path in folders
            if not (path / "__init__.py").exists()
        }
        missing = data - set(config.get("package-data", {}))
        assert not missing, f"data folders without [tool.setuptools.package-data]: {missing}"

    def test_one_top_level_name(self, tmp_path: Path) -> None:
        # Outside the checkout, only the installed package is importable.
        code = (
            "import importlib.util as u\n"
            "import mlxserve.server, mlxserve.scheduler, mlxserve.kvpool, mlxserve.mlx_backend\n"
            "print([n for n in ('server', 'scheduler', 'kvpool', 'mlx_backend') if u.find_spec(n)])"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]", out.stdout
