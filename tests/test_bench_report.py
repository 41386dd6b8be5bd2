"""The benchmark report rewrites its own sections of docs/benchmarks.md and keeps the rest."""

from __future__ import annotations

from bench.report import _other_sections

OLD = """# Benchmarks

## Results

old table

## Prefix cache

prefix table

## Grammar constraints

grammar table
"""

NEW = """# Benchmarks

## Results

new table
"""


def test_sections_other_benchmarks_wrote_survive_a_rewrite():
    kept = _other_sections(OLD, NEW)
    assert "## Prefix cache\n\nprefix table" in kept
    assert "## Grammar constraints\n\ngrammar table" in kept
    assert "old table" not in kept, "the report's own sections are replaced, not kept"


def test_nothing_kept_when_every_section_is_regenerated():
    assert _other_sections(NEW, NEW) == ""
