"""Which models a server serves: declared by ``--model`` options, a ``--models-config`` TOML
file or a ``--models-dir`` folder, each with its served names and per-model settings.

``--model`` takes ``SOURCE[,key=value...]``: the source is a model directory, a ``.gguf``
file or a Hugging Face repo id (empty: the embedded SmolLM2); keys are the fields of
``ModelDeclaration`` (``name`` may repeat: every name is served). The TOML file has one
``[[models]]`` table per model with the same fields (``source``, ``names``). A models folder
declares every model directory (one with a ``config.json``) and ``.gguf`` file in it, named
by its folder or file name. A request's ``model`` only ever selects a declared name: it is
never a path or a repo id to load.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import tomllib

from mlxserve.server.serving.tool_parsers import check_tool_parser_name

Task = Literal["generate", "embed"]

# What a served name may look like: no path separators, nothing a hub id could parse as.
_NAME_FORBIDDEN = ("/", "\\", "..")


@dataclass(frozen=True)
class ModelDeclaration:
    """One declared model.

    Attributes:
        source: the model directory, ``.gguf`` file or Hugging Face repo id (None: the
            embedded SmolLM2-135M-Instruct).
        names: the served names (the first is the one ``/v1/models`` lists first; empty:
            the loaded model's own id).
        context_length: cap on the model's context (None: the model's own).
        max_total_tokens: token slots of its KV pool (None: from the memory budget).
        tool_parser: how its tool calls are read ("auto", "hermes", an mlx-lm parser).
        keep_quantized: on the CPU backend, keep its quantized weights as they are.
        adapter: a LoRA adapter directory (``adapters.safetensors`` +
            ``adapter_config.json``) applied over the source model, served under its own
            names; several adapters over one base share the base's weights.
        pinned: never unloaded to make room (nor by the idle time-out).
        ttl: seconds without a request after which it is unloaded (None: the server's
            ``--model-ttl``; 0: never).
        task: "generate" (chat, completions) or "embed" (``/v1/embeddings``).
        matryoshka: its embeddings may be cut short (``dimensions``): Matryoshka
            representations (None: as its config.json says, ``is_matryoshka`` or
            ``matryoshka_dimensions``).
    """

    source: str | None = None
    names: tuple[str, ...] = ()
    context_length: int | None = None
    max_total_tokens: int | None = None
    tool_parser: str = "auto"
    keep_quantized: bool = False
    adapter: str | None = None
    pinned: bool = False
    ttl: float | None = None
    task: Task = "generate"
    matryoshka: bool | None = None

    def __post_init__(self) -> None:
        for name in self.names:
            if not name or any(bad in name for bad in _NAME_FORBIDDEN):
                raise ValueError(f"a served model name cannot be {name!r}")
        check_tool_parser_name(self.tool_parser)
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}")
        for key in ("context_length", "max_total_tokens"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.ttl is not None and self.ttl < 0:
            raise ValueError(f"ttl must be >= 0, got {self.ttl}")

    @property
    def label(self) -> str:
        """How logs name it before it is loaded."""
        if self.names:
            return self.names[0]
        return self.source or "embedded SmolLM2-135M-Instruct"


_FIELDS = {f.name: f for f in dataclasses.fields(ModelDeclaration)}


def _typed(key: str, value: Any) -> Any:
    """A declaration field's value from its text (``--model``) or TOML value."""
    kind = _FIELDS[key].type
    if not isinstance(value, str):
        return value
    if "bool" in kind:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if "int" in kind:
        return int(value)
    if "float" in kind:
        return float(value)
    return value


def from_fields(fields: dict[str, Any], where: str) -> ModelDeclaration:
    """A declaration from a mapping of its fields (``name`` or ``names`` for the names).

    Raises:
        ValueError: an unknown key or a bad value, naming ``where`` it came from.
    """
    fields = dict(fields)
    names = fields.pop("names", [])
    names = [names] if isinstance(names, str) else list(names)
    if "name" in fields:
        name = fields.pop("name")
        names.extend([name] if isinstance(name, str) else name)
    unknown = sorted(set(fields) - set(_FIELDS) - {"names"})
    if unknown:
        raise ValueError(f"{where}: unknown model option {unknown[0]!r}")
    try:
        typed = {k: _typed(k, v) for k, v in fields.items()}
        return ModelDeclaration(names=tuple(names), **typed)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def parse_model_option(text: str) -> ModelDeclaration:
    """``--model SOURCE[,key=value...]`` -> a declaration.

    Raises:
        ValueError: an option is not ``key=value`` or not a field.
    """
    source, *options = text.split(",")
    fields: dict[str, Any] = {"source": source.strip() or None}
    names = []
    for option in options:
        key, sep, value = option.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--model {text!r}: options are key=value, got {option!r}")
        if key == "name":
            names.append(value.strip())
        else:
            fields[key] = value.strip()
    fields["names"] = names
    return from_fields(fields, f"--model {text!r}")


def parse_models_config(path: str) -> list[ModelDeclaration]:
    """The ``[[models]]`` tables of a TOML file.

    Raises:
        ValueError: the file cannot be read or parsed, or a table is invalid.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--models-config {path}: {e}") from None
    tables = data.get("models")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"--models-config {path}: expected [[models]] tables")
    unknown = sorted(set(data) - {"models"})
    if unknown:
        raise ValueError(f"--models-config {path}: unknown top-level key {unknown[0]!r}")
    return [from_fields(t, f"{path}, model {i + 1}") for i, t in enumerate(tables)]


def discover_models_dir(path: str) -> list[ModelDeclaration]:
    """Every model directory (with a ``config.json``) and ``.gguf`` file in ``path``, named
    by its folder or file name (``.gguf`` dropped), in name order.

    Raises:
        ValueError: ``path`` is not a directory.
    """
    root = Path(os.path.expanduser(path))
    if not root.is_dir():
        raise ValueError(f"--models-dir {path}: not a directory")
    found = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.is_dir() and (entry / "config.json").is_file():
            found.append(ModelDeclaration(source=str(entry), names=(entry.name,)))
        elif entry.is_file() and entry.suffix.lower() == ".gguf":
            found.append(ModelDeclaration(source=str(entry), names=(entry.stem,)))
    return found
