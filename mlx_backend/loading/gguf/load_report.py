"""What a GGUF load did with each tensor type: the lines the load log shows."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

_HANDLING_TEXT = {
    "exact": "kept quantized exactly as MLX {bits}-bit{mode}",
    "float": "kept as float ({dtype})",
    "dequantized": "dequantized exactly to {dtype}",
    "requantized": "dequantized, then requantized to MLX 8-bit (not exact; --keep-quantized "
    "or a GPU keeps weights quantized)",
}


@dataclass
class LoadReport:
    """Counts of (GGUF type, handling, detail) over a load, plus free-form notes."""

    counts: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def add(self, type_name: str, handling: str, detail: dict[str, str]) -> None:
        self.counts[(type_name, handling, tuple(sorted(detail.items())))] += 1

    def lines(self) -> list[str]:
        """One line per (type, handling): ``Q6_K: 9 tensors dequantized exactly to float32``."""
        out = []
        for (type_name, handling, detail), n in sorted(self.counts.items()):
            text = _HANDLING_TEXT[handling].format(**dict(detail))
            out.append(f"{type_name}: {n} tensor{'s' if n != 1 else ''} {text}")
        return out + self.notes

    def handled(self, type_name: str) -> set[str]:
        """The handlings seen for one GGUF type (for tests and the CLI)."""
        return {h for (t, h, _), _ in self.counts.items() if t == type_name}
