"""Engine configuration: one frozen dataclass whose field defaults are the CLI defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KV_BITS = (8, 4)
KV_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and limits of the engine.

    Attributes:
        max_total_tokens: token slots in the KV pool (0 = derive from free memory).
        max_running_requests: rows of the request table (the largest decode batch).
        max_prefill_tokens: token budget of one prefill forward (several requests pack into
            it; a longer prompt is prefilled in chunks of at most this many tokens).
        mem_fraction: share of free memory the KV pool may take when sizing automatically.
        kv_memory_bytes: bytes the KV pools may take when sized automatically (0:
            ``mem_fraction`` of free memory; a memory budget shared by several models sets
            it per model).
        seed: seed of the engine's sampling RNG.
        disable_prefix_cache: recompute every prompt instead of reusing the K/V (and
            recurrent state) of earlier requests that share a prefix with it.
        kv_bits: store the K/V of attention layers quantized to this many bits (mlx-lm's
            format: packed values with a scale and a bias per group), so the same memory
            holds about 3.5x (8-bit) or 6x (4-bit) the tokens of a float32 pool; recurrent
            state stays float (default: off).
        kv_group_size: values of a K/V head row sharing one scale and bias with --kv-bits.
        speculative_method: propose tokens for decoding rows, verified in the same forward
            ("ngram": prompt lookup over the request's own prompt and output; "draft": the
            greedy continuation of a smaller model, --draft-model; "off": none). The output
            is exactly the model's (greedy: token for token).
        num_speculative_tokens: the most tokens proposed for a row in one step.
        prompt_lookup_min: the shortest suffix n-gram the ngram method looks up.
        prompt_lookup_max: the longest suffix n-gram the ngram method looks up (longer
            ones are tried first).
        draft_model: the draft model of --speculative-method draft (a model spec as for
            --model: a directory, a GGUF file or a Hugging Face id), with the same
            vocabulary as the served model; its K/V live in pools of its own, written in the
            same slots as the served model's.
        overlap: build the next decode step while the current one computes
            (``scheduler/lookahead.py``) instead of scheduling, running, waiting for and
            processing each step in turn: "auto" does where the executor says it pays (the
            MLX executor: on a GPU; not on the CPU backend, where the graph building and
            the forward share the same cores: measured no faster there), "on" and "off"
            always and never. The output is the same either way.
    """

    max_total_tokens: int = 0
    max_running_requests: int = 32
    max_prefill_tokens: int = 2048
    mem_fraction: float = 0.25
    kv_memory_bytes: int = 0
    seed: int = 0
    disable_prefix_cache: bool = False
    kv_bits: Literal[8, 4] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    speculative_method: Literal["off", "ngram", "draft"] = "off"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    overlap: Literal["auto", "on", "off"] = "auto"

    def __post_init__(self) -> None:
        if self.max_total_tokens < 0:
            raise ValueError(f"max_total_tokens must be >= 0, got {self.max_total_tokens}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.kv_memory_bytes < 0:
            raise ValueError(f"kv_memory_bytes must be >= 0, got {self.kv_memory_bytes}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if (self.speculative_method == "draft") != bool(self.draft_model):
            raise ValueError(
                "--speculative-method draft and --draft-model go together (got method "
                f"{self.speculative_method!r}, draft model {self.draft_model!r})"
            )
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS} or None, got {self.kv_bits}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto, on or off, got {self.overlap!r}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(
                f"kv_group_size must be one of {KV_GROUP_SIZES}, got {self.kv_group_size}"
            )
