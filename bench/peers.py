"""The peers of ``bench/compare.py`` beyond this checkout's mlx_lm.server: vllm-mlx 0.6.0 and
mlx_lm.server 0.31.3, both from one virtual environment the bench sets up itself.

vllm-mlx is a pure-Python wheel that pins ``mlx-lm>=0.31.3,<0.32`` (mlxserve uses 0.32), so it
gets a venv of its own (``bench/.peer-venv``, ignored by git): ``mlx[cpu]``, that mlx-lm,
``vllm-mlx==0.6.0`` without its dependencies (most of them, gradio, torchvision, opencv, are
for its UI and vision paths) plus the few its text server imports. None of it is a
dependency of mlxserve. Both peers run through ``bench/run_peer_server.py`` in that venv,
which preloads the same OpenBLAS and shim mlxserve uses (paths from this venv) and serves
the float32 copy of the model ``bench/run_mlx_lm_server.py`` writes, so all servers compute
with the same weights and BLAS. vllm-mlx persists its prefix cache under
``~/.cache/vllm-mlx``: it runs with a throwaway ``HOME``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _env  # noqa: E402

VENV = _env.REPO_ROOT / "bench" / ".peer-venv"
REQUIREMENTS = [
    "mlx[cpu]",
    "mlx-lm>=0.31.3,<0.32",
    "fastapi",
    "starlette>=1.0.1",
    "uvicorn",
    "jsonschema",
    "requests",
    "python-multipart",
    "psutil",
]
NO_DEPS = ["vllm-mlx==0.6.0"]
VLLM_MLX, MLX_LM_OLD = "vllm-mlx", "mlx_lm.server 0.31"
_STAMP = "installed.txt"


def ensure_venv(venv: Path = VENV) -> Path:
    """Create the peers' venv once (idempotent); returns its python."""
    python = venv / "bin" / "python"
    stamp = venv / _STAMP
    wanted = "\n".join(REQUIREMENTS + NO_DEPS)
    if stamp.is_file() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + REQUIREMENTS, check=True, timeout=1800)
    subprocess.run(pip + ["--no-deps", *NO_DEPS], check=True, timeout=600)
    stamp.write_text(wanted)
    return python


def blas_paths() -> tuple[str, str] | None:
    """(libscipy_openblas, mlxserve's shim) from this venv, or None when either is missing."""
    from mlxserve.mlx_backend.cpu.blas import _packaged_shim, _scipy_openblas_lib

    openblas, shim = _scipy_openblas_lib(), _packaged_shim()
    if openblas is None or shim is None:
        return None
    return str(openblas), str(shim)


def peer_commands(
    python: Path, model: str, host: str, port: int, batch: int, prompt_concurrency: int
) -> dict[str, list[str]]:
    """The two peers' command lines (run through ``bench/run_peer_server.py``)."""
    wrapper = [str(python), str(_env.REPO_ROOT / "bench" / "run_peer_server.py")]
    blas = blas_paths()
    if blas is not None:
        wrapper += ["--openblas", blas[0], "--shim", blas[1]]
    vllm = wrapper + ["vllm-mlx", "serve", model, "--host", host, "--port", str(port)]
    vllm += ["--continuous-batching", "--max-num-seqs", str(batch)]
    old = wrapper + ["mlx_lm.server", "--model", model, "--host", host, "--port", str(port)]
    old += ["--decode-concurrency", str(batch), "--prompt-concurrency", str(prompt_concurrency)]
    return {VLLM_MLX: vllm, MLX_LM_OLD: old}


def throwaway_home() -> str:
    """A fresh HOME for a peer run (vllm-mlx writes its prefix cache under it)."""
    return tempfile.mkdtemp(prefix="mlxserve-peer-home-")


def peer_env(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env["HOME"] = home
    env.pop("PYTHONPATH", None)
    return env


if __name__ == "__main__":
    print(ensure_venv())
