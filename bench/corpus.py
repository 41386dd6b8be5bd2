"""A deterministic prompt corpus: chat prompts of mixed lengths drawn with a fixed seed.

Every prompt asks for a long, open-ended answer (so that greedy decoding rarely stops before
``max_tokens``) and carries a different list of words, so no two prompts in a run share more
than the chat template's prefix. The same ``(seed, index)`` always gives the same prompt.
"""

from __future__ import annotations

import random

# A small vocabulary of common English words (no rare tokens, no punctuation).
WORDS: tuple[str, ...] = tuple(
    """
    apple river mountain garden window village forest ocean candle market bridge lantern
    harbor meadow castle library teacher doctor farmer sailor painter baker engineer pilot
    winter summer autumn spring morning evening midnight sunrise thunder rain snow wind cloud
    silver golden copper wooden stone glass paper cotton velvet marble iron crystal
    quiet bright gentle ancient modern hidden narrow distant curious patient brave clever
    journey secret promise letter song story dream memory question answer puzzle riddle
    horse rabbit eagle dolphin tiger sparrow turtle wolf fox bear owl whale
    travel build discover remember imagine explore gather wander listen whisper carry repair
    kitchen station school museum theater factory island desert valley canyon lake road
    bread cheese honey tea coffee soup orange lemon pepper salt sugar rice
    clock compass map ladder basket blanket mirror hammer needle rope shovel wheel
    friend family neighbor stranger captain student artist writer singer dancer child elder
    """.split()
)

# Task openings that invite a long answer; one is chosen per prompt.
TASKS: tuple[str, ...] = (
    "Write a long, detailed story that uses all of the following words",
    "Write a detailed essay that explains how the following things are connected",
    "Describe, step by step and at length, a day in a town where you find these things",
    "Write a long travel diary entry that mentions each of the following",
    "Explain in detail, with many examples, what each of the following words means",
)

# Word counts of the word list: a mix of short and long prompts (about 45-190 tokens).
LENGTHS: tuple[int, ...] = (4, 8, 16, 32, 48, 72)


def make_prompt(seed: int, index: int) -> str:
    """The ``index``-th prompt of the corpus with ``seed``.

    Args:
        seed: corpus seed; the same seed and index always give the same prompt.
        index: position in the corpus (any non-negative int).

    Returns:
        The user message text.
    """
    rng = random.Random(seed * 1_000_003 + index)
    n_words = LENGTHS[index % len(LENGTHS)]
    words = [rng.choice(WORDS) for _ in range(n_words)]
    task = rng.choice(TASKS)
    return f"Request {index}. {task}: {', '.join(words)}."


def make_prompts(seed: int, count: int, start: int = 0) -> list[str]:
    """``count`` consecutive prompts of the corpus, starting at ``start``."""
    return [make_prompt(seed, start + i) for i in range(count)]


def chat_ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001 - a model's tokenizer
    """The token ids of ``text`` as one user message of the model's chat template, with
    the generation prompt."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    if hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
