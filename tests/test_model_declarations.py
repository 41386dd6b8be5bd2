"""Declaring models: ``--model SOURCE[,key=value...]``, a ``--models-config`` TOML file and
a ``--models-dir`` folder, each refusing what it cannot mean (no model loads here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxserve.server.models.declarations import (
    ModelDeclaration,
    discover_models_dir,
    parse_model_option,
    parse_models_config,
)


class TestModelOption:
    def test_source_names_and_options(self) -> None:
        decl = parse_model_option(
            "/m/qwen,name=qwen,name=default,context_length=4096,pinned=true,ttl=30,"
            "tool-parser=hermes,keep_quantized=yes,max_total_tokens=8192"
        )
        assert decl == ModelDeclaration(
            source="/m/qwen",
            names=("qwen", "default"),
            context_length=4096,
            pinned=True,
            ttl=30.0,
            tool_parser="hermes",
            keep_quantized=True,
            max_total_tokens=8192,
        )

    def test_an_empty_source_is_the_embedded_model(self) -> None:
        assert parse_model_option(",name=small").source is None
        assert parse_model_option("").names == ()

    def test_adapters_and_tasks(self) -> None:
        decl = parse_model_option("/m/base,adapter=/m/lora,name=tuned")
        assert decl.adapter == "/m/lora" and decl.names == ("tuned",)
        assert parse_model_option("/m/emb,task=embed").task == "embed"

    @pytest.mark.parametrize(
        "text, message",
        [
            ("/m,nope=1", "unknown model option 'nope'"),
            ("/m,pinned", "key=value"),
            ("/m,pinned=maybe", "true or false"),
            ("/m,context_length=0", "context_length must be >= 1"),
            ("/m,name=a/b", "cannot be 'a/b'"),
            ("/m,name=..", "cannot be '..'"),
            ("/m,task=train", "task must be"),
            ("/m,tool_parser=nope", "nope"),
            ("/m,ttl=-1", "ttl must be >= 0"),
        ],
    )
    def test_refusals(self, text: str, message: str) -> None:
        with pytest.raises(ValueError, match=message):
            parse_model_option(text)


class TestModelsConfig:
    def test_tables(self, tmp_path: Path) -> None:
        path = tmp_path / "models.toml"
        path.write_text(
            '[[models]]\nsource = "/m/a"\nnames = ["a", "alias"]\npinned = true\n\n'
            '[[models]]\nsource = "/m/b"\nname = "b"\nttl = 5\ntask = "embed"\n'
        )
        a, b = parse_models_config(str(path))
        assert a == ModelDeclaration(source="/m/a", names=("a", "alias"), pinned=True)
        assert b == ModelDeclaration(source="/m/b", names=("b",), ttl=5, task="embed")

    @pytest.mark.parametrize(
        "text, message",
        [
            ("models = 3", "expected"),
            ('[[models]]\nsource = "/m"\ncolour = "red"', "unknown model option 'colour'"),
            ('other = 1\n[[models]]\nsource = "/m"', "unknown top-level key 'other'"),
            ("[[models]\n", "models.toml"),
        ],
    )
    def test_refusals(self, tmp_path: Path, text: str, message: str) -> None:
        path = tmp_path / "models.toml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            parse_models_config(str(path))

    def test_a_missing_file(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="--models-config"):
            parse_models_config(str(tmp_path / "nope.toml"))


class TestModelsDir:
    def test_model_dirs_and_gguf_files_by_name(self, tmp_path: Path) -> None:
        (tmp_path / "qwen").mkdir()
        (tmp_path / "qwen" / "config.json").write_text("{}")
        (tmp_path / "not-a-model").mkdir()
        (tmp_path / "llama.Q4_K_M.gguf").write_bytes(b"GGUF")
        (tmp_path / "notes.txt").write_text("x")
        found = discover_models_dir(str(tmp_path))
        assert [(d.names, Path(d.source).name) for d in found] == [
            (("llama.Q4_K_M",), "llama.Q4_K_M.gguf"),
            (("qwen",), "qwen"),
        ]

    def test_not_a_directory(self, tmp_path: Path) -> None:
        with pytest.raises(ValueError, match="not a directory"):
            discover_models_dir(str(tmp_path / "missing"))
