"""``mlxserve``: serve a model (the default) or ``mlxserve convert MODEL.gguf OUT_DIR``.

Every serve option is a field of ``ServerConfig`` or ``EngineConfig``: the flag, its type,
its default and its help text all come from the dataclass, so the CLI cannot drift from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import os
import re
import sys
import typing
from collections.abc import Sequence
from typing import Any

from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import DistributedConfig, ModelConfig, ServerConfig
from mlxserve.server.models.declarations import (
    ModelDeclaration,
    discover_models_dir,
    parse_model_option,
    parse_models_config,
)

# Google-style "name: text" or "name (type): text" lines of an "Attributes:" section.
_ATTRIBUTE_LINE = re.compile(r"^(\w+)(?: \([^)]*\))?: (.*)$")


def _attribute_help(cls: type) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` section of ``cls``'s docstring."""
    helps: dict[str, str] = {}
    name = None
    in_section = False
    for line in (inspect.getdoc(cls) or "").splitlines():
        if line.strip() == "Attributes:":
            in_section = True
        elif in_section and line and not line.startswith(" "):
            break  # the next section
        elif in_section and (m := _ATTRIBUTE_LINE.match(line.strip())) and line[4:5] != " ":
            name = m[1]
            helps[name] = m[2]
        elif in_section and name and line.strip():
            helps[name] += " " + line.strip()
    return helps


def _add_dataclass_options(
    group: argparse._ArgumentGroup, cls: type, repeated: tuple[str, ...] = ()
) -> None:
    """One ``--field-name`` option per field of the dataclass ``cls`` (those in
    ``repeated`` may be given several times: a list)."""
    hints = typing.get_type_hints(cls)
    helps = _attribute_help(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{field.name} needs a default to be a CLI option")
        kwargs: dict[str, Any] = {"default": default, "dest": field.name}
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        literal = hint
        if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
            literal = args[0]  # "Literal[...] | None": those choices, default None
        choices = typing.get_args(literal) if typing.get_origin(literal) is typing.Literal else None
        if choices:
            kwargs.update(choices=choices, type=type(choices[0]))
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif args and typing.get_origin(hint) is not typing.Literal:
            kwargs["type"] = args[0]  # "X | None": parse as X, default None
        else:
            kwargs["type"] = hint
        if field.name in repeated:
            kwargs["action"] = "append"
        if kwargs.get("type") in (int, float) and not choices:
            kwargs["metavar"] = "N" if kwargs["type"] is int else "X"
        help_text = helps.get(field.name, "").rstrip(".")
        if default is not None:
            help_text += " (default: %(default)s)"
        group.add_argument("--" + field.name.replace("_", "-"), help=help_text, **kwargs)


def _from_args(cls: type, args: argparse.Namespace) -> Any:
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def build_parser() -> argparse.ArgumentParser:
    """The ``mlxserve`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="mlxserve",
        description="Serve an LLM on MLX with an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health).",
    )
    _add_dataclass_options(
        parser.add_argument_group("model options"), ModelConfig, repeated=("model",)
    )
    _add_dataclass_options(parser.add_argument_group("server options"), ServerConfig)
    _add_dataclass_options(parser.add_argument_group("engine options"), EngineConfig)
    _add_dataclass_options(
        parser.add_argument_group("distributed options (one model over several processes)"),
        DistributedConfig,
    )
    parser.add_argument(
        "--version",
        action="store_true",
        help="print the versions, the backend and which BLAS and attention paths are active",
    )
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    convert = sub.add_parser(
        "convert",
        help="convert a GGUF file into an MLX model directory",
        description="Convert a llama.cpp GGUF file into an MLX model directory "
        "(servable with --model OUT_DIR).",
    )
    convert.add_argument("gguf_path", metavar="MODEL.gguf", help="the GGUF file to convert")
    convert.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model to")
    convert.add_argument(
        "--dequantize",
        action="store_true",
        help="write every weight as float32 (exact) instead of keeping quantized layers "
        "quantized (formats MLX cannot hold exactly, e.g. Q6_K, are then requantized to 8 bits)",
    )
    return parser


def _fail(message: str) -> int:
    # One line, no traceback: these are the user's errors (a path, a name, the network).
    print(f"mlxserve: error: {message}", file=sys.stderr)
    return 1


def _convert(gguf_path: str, out_dir: str, dequantize: bool) -> int:
    from mlxserve.mlx_backend.loading.gguf.convert import convert_gguf

    try:
        lines = convert_gguf(gguf_path, out_dir, dequantize=dequantize)
    except Exception as e:  # noqa: BLE001 - a CLI boundary: one line, no traceback
        return _fail(f"cannot convert {gguf_path}: {e}")
    for line in lines:
        print(f"  {line}")
    print(f"converted {gguf_path} -> {out_dir}")
    return 0


def _serve(
    server_config: ServerConfig,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    declarations: list[ModelDeclaration] | None,
    group: Any = None,
) -> int:
    from mlxserve.mlx_backend.loading.loader import ModelLoadError
    from mlxserve.server.lifecycle.launch import serve

    try:
        serve(server_config, model_config, engine_config, declarations, group=group)
    except (ModelLoadError, RuntimeError) as e:
        # RuntimeError: the engine failed to start (e.g. no memory for its KV pool).
        return _fail(str(e))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mlxserve`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "convert":
        return _convert(args.gguf_path, args.out_dir, args.dequantize)
    if args.version:
        return _print_version()
    specs = args.model or []
    args.model = specs[0] if len(specs) == 1 else None
    try:
        server_config = _from_args(ServerConfig, args)
        model_config = _from_args(ModelConfig, args)
        engine_config = _from_args(EngineConfig, args)
        distributed = _from_args(DistributedConfig, args)
        declarations = declared_models(specs, server_config, model_config)
        if distributed.enabled and declarations:
            raise ValueError("a distributed group serves one model (one --model)")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if distributed.ranks > 1 and not distributed.distributed:
        from mlxserve.server.lifecycle.distributed import share_cpus

        share_cpus(distributed.ranks)  # children inherit it
    _enable_fast_blas()
    if distributed.enabled:
        argv = list(sys.argv[1:] if argv is None else argv)
        return _serve_distributed(argv, server_config, model_config, engine_config, distributed)
    return _serve(server_config, model_config, engine_config, declarations)


def _serve_distributed(
    argv: list[str],
    server_config: ServerConfig,
    model_config: ModelConfig,
    engine_config: EngineConfig,
    distributed: DistributedConfig,
) -> int:
    """One rank of a tensor-parallel group: rank 0 serves HTTP, the others its forwards."""
    from mlxserve.server.lifecycle.distributed import (
        LocalRanks,
        form_group,
        run_rank,
        start_local_ranks,
    )

    local = LocalRanks()
    if not distributed.distributed:
        local = start_local_ranks(argv, distributed.ranks)
    status = 1
    try:
        group = form_group(distributed, on_exit=lambda: local.stop(0))
        if group.rank != 0:
            status = run_rank(group, model_config, engine_config)
        else:
            status = _serve(server_config, model_config, engine_config, None, group=group)
    finally:
        local.stop()
        # NOTE: after a lost rank, this rank's MLX thread may be blocked in a collective
        # for good (MLX's ring never wakes it): end the process without joining threads.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)


def declared_models(
    specs: list[str], server_config: ServerConfig, model_config: ModelConfig
) -> list[ModelDeclaration] | None:
    """The models of repeated ``--model`` options, ``--models-config`` and
    ``--models-dir``, in that order; None for one plain ``--model`` (or none), which is
    served as it always was.

    Raises:
        ValueError: a declaration is invalid, two share a name, or ``--served-model-name``
            is given with several models (each takes ``name=`` instead).
    """
    several = len(specs) > 1 or any("," in s for s in specs)
    if not several and not server_config.models_config and not server_config.models_dir:
        return None
    if model_config.served_model_name:
        raise ValueError("with several models, name each one: --model SOURCE,name=NAME")
    declarations = [parse_model_option(s) for s in specs]
    if server_config.models_config:
        declarations += parse_models_config(server_config.models_config)
    if server_config.models_dir:
        declarations += discover_models_dir(server_config.models_dir)
    if not declarations:
        raise ValueError(f"--models-dir {server_config.models_dir}: no model found in it")
    defaults = {}
    if model_config.keep_quantized:
        defaults["keep_quantized"] = True
    if model_config.tool_parser != "auto":
        defaults["tool_parser"] = model_config.tool_parser
    return [
        dataclasses.replace(d, **{k: v for k, v in defaults.items() if not _set(d, k)})
        for d in declarations
    ]


def _print_version() -> int:
    _enable_fast_blas()
    import mlx.core as mx
    import mlx_lm

    from mlxserve.server.app import VERSION
    from mlxserve.server.lifecycle.loading import (
        attention_line,
        backend_name,
        blas_line,
        native_ops_line,
    )

    print(f"mlxserve {VERSION} (mlx {mx.__version__}, mlx-lm {mlx_lm.__version__})")
    print(f"backend: {backend_name()}")
    print(f"BLAS: {blas_line()}")
    print(f"attention: {attention_line()}")
    print(f"elementwise: {native_ops_line()}")
    return 0


def _enable_fast_blas() -> None:
    """Serve MLX's CPU sgemm from OpenBLAS; must run before anything imports mlx.core."""
    from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

    status = enable_fast_blas()
    if not status.active:
        logging.getLogger("mlxserve").warning("fast CPU BLAS off: %s", status.reason)


if __name__ == "__main__":
    sys.exit(main())


def _set(declaration: ModelDeclaration, key: str) -> bool:
    """Whether a declaration set ``key`` away from its default."""
    return getattr(declaration, key) != getattr(ModelDeclaration(), key)
