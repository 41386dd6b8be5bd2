"""The native parts of mlxserve, built with CMake at install (``pip install``, ``make install``).

On Linux two libraries are built from ``csrc/`` (see ``csrc/CMakeLists.txt``):

- ``mlxserve.mlx_backend.attention._native``: the ragged paged attention MLX primitive,
  compiled against the MLX of the build environment (pyproject.toml's build requirements
  pin the nanobind that mlx.core was built with);
- ``mlxserve.mlx_backend.cpu._cblas_shim``: the OpenBLAS shim that serves MLX's sgemm
  (a plain shared library loaded with ctypes, not a Python module).

Neither is required: a part whose build fails is left out with a one-line warning, and the
server then runs on the pure-MLX path (``mlxserve --version`` says which path is active).
``MLXSERVE_NATIVE=off`` skips both. Everything else about the package is in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


class CMakePart(Extension):
    """One part of ``csrc/CMakeLists.txt`` (``MLXSERVE_PART``), installed as ``name``."""

    def __init__(self, name: str, part: str, built_file: str) -> None:
        super().__init__(name, sources=[])
        self.part = part
        self.built_file = built_file


class NativeBuild(build_ext):
    """Builds each CMake part; a failed part is dropped with a warning, never fatal."""

    def build_extensions(self) -> None:
        built = []
        for ext in self.extensions:
            try:
                self._build(ext)
                built.append(ext)
            except (OSError, subprocess.CalledProcessError, RuntimeError) as e:
                print(
                    f"WARNING: mlxserve: building {ext.name} failed ({e}); "
                    "mlxserve will run without it (pure-MLX path)",
                    file=sys.stderr,
                )
        # Dropped parts are neither copied in place nor listed as outputs.
        self.extensions = built

    def _build(self, ext: CMakePart) -> None:
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"mlxserve-{ext.part}-") as tmp:
            out = Path(tmp) / "out"
            configure = [
                cmake,
                "-S",
                str(CSRC),
                "-B",
                tmp,
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DMLXSERVE_PART={ext.part}",
                f"-DMLXSERVE_OUTPUT_DIR={out}",
                f"-DPython_EXECUTABLE={sys.executable}",
            ]
            _run(configure)
            jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
            _run([cmake, "--build", tmp, "--parallel", jobs])
            produced = list(out.glob(ext.built_file))
            if len(produced) != 1:
                raise RuntimeError(f"expected one {ext.built_file} in {out}, found {produced}")
            shutil.copyfile(produced[0], target)


def _run(cmd: list[str]) -> None:
    """Run a build command; on failure raise with the last lines of its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{Path(cmd[0]).name} exited {proc.returncode}: " + " | ".join(tail))


def _parts() -> list[CMakePart]:
    if not sys.platform.startswith("linux"):
        return []  # Metal and Accelerate on macOS: MLX's own kernels serve
    if os.environ.get("MLXSERVE_NATIVE", "").strip().lower() in {"off", "0", "false", "no"}:
        return []
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return [
        CMakePart("mlxserve.mlx_backend.attention._native", "attention", f"_native{suffix}"),
        CMakePart("mlxserve.mlx_backend.cpu._cblas_shim", "cblas", "libmlxserve_cblas.so"),
    ]


setup(ext_modules=_parts(), cmdclass={"build_ext": NativeBuild})
