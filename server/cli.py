"""``mlxserve``: serve a model (the default) or ``mlxserve convert MODEL.gguf OUT_DIR``.

Every serve option is a field of ``ServerConfig`` or ``EngineConfig``: the flag, its type,
its default and its help text all come from the dataclass, so the CLI cannot drift from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import re
import sys
import typing
from collections.abc import Sequence
from typing import Any

from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ModelConfig, ServerConfig

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


def _add_dataclass_options(group: argparse._ArgumentGroup, cls: type) -> None:
    """One ``--field-name`` option per field of the dataclass ``cls``."""
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
    _add_dataclass_options(parser.add_argument_group("model options"), ModelConfig)
    _add_dataclass_options(parser.add_argument_group("server options"), ServerConfig)
    _add_dataclass_options(parser.add_argument_group("engine options"), EngineConfig)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    convert = sub.add_parser(
        "convert",
        help="convert a GGUF file into an MLX model directory",
        description="Convert a llama.cpp GGUF file into an MLX model directory "
        "(servable with --model OUT_DIR).",
    )
    convert.add_argument("gguf_path", metavar="MODEL.gguf", help="the GGUF file to convert")
    convert.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model to")
    return parser


def _fail(message: str) -> int:
    # One line, no traceback: these are the user's errors (a path, a name, the network).
    print(f"mlxserve: error: {message}", file=sys.stderr)
    return 1


def _convert(gguf_path: str, out_dir: str) -> int:
    from mlxserve.mlx_backend.loading.gguf_convert import convert_gguf

    try:
        convert_gguf(gguf_path, out_dir)
    except Exception as e:  # noqa: BLE001 - a CLI boundary: one line, no traceback
        return _fail(f"cannot convert {gguf_path}: {e}")
    print(f"converted {gguf_path} -> {out_dir}")
    return 0


def _serve(
    server_config: ServerConfig, model_config: ModelConfig, engine_config: EngineConfig
) -> int:
    from mlxserve.mlx_backend.loading.loader import ModelLoadError
    from mlxserve.server.lifecycle.launch import serve

    try:
        serve(server_config, model_config, engine_config)
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
        return _convert(args.gguf_path, args.out_dir)
    try:
        server_config = _from_args(ServerConfig, args)
        model_config = _from_args(ModelConfig, args)
        engine_config = _from_args(EngineConfig, args)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _enable_fast_blas()
    return _serve(server_config, model_config, engine_config)


def _enable_fast_blas() -> None:
    """Serve MLX's CPU sgemm from OpenBLAS; must run before anything imports mlx.core."""
    from mlxserve.mlx_backend.cpu.blas import enable_fast_blas

    status = enable_fast_blas()
    if not status.active:
        logging.getLogger("mlxserve").warning("fast CPU BLAS off: %s", status.reason)


if __name__ == "__main__":
    sys.exit(main())
