"""Grammar constraints for structured output: llguidance matchers, one per request.

A request with a constraint samples only tokens its grammar allows. Each step, the
scheduler asks every constrained row's matcher for its token mask (a bitmask, computed on
the CPU, all rows at once on llguidance's thread pool); the sampler sets the logits of the
other tokens to -inf; after the step the matcher consumes the token that was sampled.
Unconstrained rows of the same batch are untouched (their mask row is all ones and the
sampler skips masking entirely when no row is constrained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

# JSON as OpenAI writes it (``{"a": 1, "b": [2, 3]}``). NOTE: llguidance's default allows
# any run of whitespace between tokens, and a small model at temperature > 0 can then emit
# newlines until max_tokens; a schema's own "x-guidance" options still override this.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

GrammarKind = Literal["json_schema", "json_object", "regex", "lark", "choice"]


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: a JSON schema (as JSON text), any JSON object, a regex,
    a Lark grammar (llguidance's dialect), or one of a list of strings (JSON list)."""

    kind: GrammarKind
    value: str = ""


class GrammarDeadEnd(ValueError):
    """The request's grammar allows no token the model can produce: the request's fault
    (a grammar this vocabulary cannot satisfy), reported to the client as a 4xx."""


class GrammarUnsatisfiable(ValueError):
    """The grammar matches nothing at all (e.g. a regex of an empty character class): found
    when it is compiled, before the request is queued."""


class Constraint:
    """One request's matcher: the tokens allowed next, and the tokens sampled so far.

    Args:
        matcher: the compiled grammar's matcher, at the start of the output.
        spec: what it was compiled from.
    """

    def __init__(self, matcher: llguidance.LLMatcher, spec: GrammarSpec) -> None:
        self.matcher = matcher
        self.spec = spec

    def copy(self) -> Constraint:
        """An independent matcher in the same state (another choice of the same request),
        without compiling the grammar again."""
        return Constraint(self.matcher.deep_copy(), self.spec)

    def accept(self, token: int) -> None:
        """Advance by the sampled token.

        Raises:
            GrammarDeadEnd: the grammar did not allow it. The sampler only picks masked-out
                tokens when the mask allows none: the grammar needs something the
                vocabulary cannot spell (e.g. a byte no token contains), or llguidance gave
                up on it (its limits).
        """
        if self.matcher.consume_token(token):
            return
        message = (
            "the grammar allows no token this model can produce here (it needs text the "
            "model's vocabulary cannot spell, or exceeds the grammar engine's limits)"
        )
        if self.matcher.is_error():
            # llguidance's first line says what failed; the rest dumps the whole grammar.
            message += f": {self.matcher.get_error().splitlines()[0][:200]}"
        raise GrammarDeadEnd(message)

    @property
    def finished(self) -> bool:
        """The grammar can take no further token (only end-of-sequence is left)."""
        return bool(self.matcher.is_stopped())


class ConstraintCompiler:
    """Builds constraints for one tokenizer (building the token trie takes ~1 s, once).
    Thread-safe: requests compile their grammars on worker threads.

    Args:
        tokenizer: the model's tokenizer (mlx-lm's wrapper or a Hugging Face fast one).
        vocab_size: the width of the model's logits (may exceed the tokenizer's vocab).
        eos_token_ids: ids that end a sequence; the first is the grammar's end token.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = list(eos_token_ids) or None
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)

    def grammar(self, spec: GrammarSpec) -> str:
        """llguidance's grammar text for ``spec``.

        Raises:
            ValueError: the spec cannot be turned into a grammar (says why).
        """
        Matcher = llguidance.LLMatcher
        try:
            if spec.kind == "json_schema":
                return Matcher.grammar_from_json_schema(spec.value, defaults=JSON_STYLE)
            if spec.kind == "json_object":
                return Matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
            if spec.kind == "regex":
                return Matcher.grammar_from_regex(spec.value)
            if spec.kind == "lark":
                return Matcher.grammar_from_lark(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                alternatives = " | ".join(json.dumps(str(c)) for c in choices)
                return Matcher.grammar_from_lark(f"start: {alternatives}")
        except (ValueError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"invalid {spec.kind} grammar: {e}") from e
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def compile(self, spec: GrammarSpec) -> Constraint:
        """A fresh matcher for ``spec``.

        Raises:
            ValueError: the grammar is invalid (the message is llguidance's reason).
        """
        matcher = llguidance.LLMatcher(self.tokenizer, self.grammar(spec))
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} grammar: {matcher.get_error()}")
        # A grammar whose language is empty only shows it when its first mask is computed
        # (llguidance then stops with an error): without this check the request would end
        # at once with an empty, "successful" answer.
        matcher.compute_bitmask()
        if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
            reason = matcher.get_error().splitlines()[0][:200] if matcher.is_error() else ""
            raise GrammarUnsatisfiable(
                f"the {spec.kind} grammar matches no text at all"
                + (f" ({reason})" if reason else "")
            )
        return Constraint(matcher, spec)


class TokenMasks:
    """Computes the allowed-token bitmasks of a batch's constrained rows, all rows at once
    on llguidance's thread pool.

    Args:
        vocab_size: the width of the model's logits.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()

    def __call__(self, constraints: list[Constraint | None]) -> np.ndarray | None:
        """The int32 bitmask ``[B, ceil(V / 32)]`` of the allowed tokens of each row (all
        ones for rows without a constraint), or None when no row has one."""
        rows = [(c.matcher, i) for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(constraints), self.vocab_size)
        fill_next_token_bitmask_par(self.executor, rows, bitmask)
        return bitmask
