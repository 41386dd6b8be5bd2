"""The quantized-KV benchmark writes its own section of docs/benchmarks.md and keeps the
rest; its targets table says what was met."""

from __future__ import annotations

from bench.kv_quant_report import write_docs

RESULT = {
    "group_size": 64,
    "slots": {
        "budget_mib": 1024,
        "pools": {
            "off": {"bytes_per_token": 46080, "slots": 100, "x_float32": 1.0,
                    "float16_slots": 200, "x_float16": 1.0},
            "8-bit": {"bytes_per_token": 12960, "slots": 355, "x_float32": 3.55,
                      "float16_slots": 376, "x_float16": 1.88},
            "4-bit": {"bytes_per_token": 7200, "slots": 580, "x_float32": 5.8,
                      "float16_slots": 711, "x_float16": 3.56},
        },
    },
}  # fmt: skip


class TestSection:
    def test_replaces_its_section_and_keeps_the_others(self, tmp_path):
        path = tmp_path / "benchmarks.md"
        path.write_text(
            "# Benchmarks\n\nintro\n\n## Quantized KV\n\nOLD-SECTION\n\n## Prefix cache\n\nkept\n"
        )
        write_docs(RESULT, path)
        text = path.read_text()
        assert text.count("## Quantized KV") == 1 and "OLD-SECTION" not in text, text
        assert "## Prefix cache\n\nkept" in text and text.startswith("# Benchmarks\n\nintro"), text

    def test_targets_say_which_were_met(self, tmp_path):
        path = tmp_path / "benchmarks.md"
        write_docs(RESULT, path)
        text = path.read_text()
        assert "| 8-bit slots >= 3.5x the float32 pool | 3.55x | yes |" in text, text
        assert "| 4-bit slots >= 6.0x the float32 pool | 5.80x | NO |" in text, text
