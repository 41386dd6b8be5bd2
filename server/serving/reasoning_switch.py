"""A request's wish about reasoning, onto the model's chat-template switch where it has one.

The agent protocols say whether (Anthropic's ``thinking``) and how hard (Anthropic's
``output_config.effort``, the Responses API's ``reasoning.effort``) the model should think.
Open models take that as a chat template variable, if at all:

- ``enable_thinking`` (Qwen3, SmolLM3, GLM, ...): true or false;
- ``reasoning_effort`` (gpt-oss): "low", "medium" or "high".

mlx-lm's custom renderers (``TokenizerWrapper``'s own ``chat_template`` callables) take
``enable_thinking`` too (mlx-lm renames it for the ones that call it ``thinking``). With no
wish, mlx-lm's own default applies (``enable_thinking`` is the model's ``has_thinking``).

``reasoning_template_kwargs`` gives the variables the model's template reads (none for a
template without a switch: the request's wish then changes nothing, as for a model that
does not reason).
"""

from __future__ import annotations

from typing import Any

# Efforts the protocols name -> the three levels templates know.
_EFFORT_LEVELS = {
    "none": "low",
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def _template_source(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "chat_template", None) or "")


def reasoning_template_kwargs(
    tokenizer: Any, enabled: bool | None, effort: str | None = None
) -> dict[str, Any]:
    """The template variables that carry a reasoning wish to this model's template.

    Args:
        tokenizer: the model's tokenizer (its ``chat_template`` source is read).
        enabled: think (True), do not (False), or the model's default (None).
        effort: how hard to think ("none", "minimal", "low", ..., "max"; None: default).
            An effort of "none" also means ``enabled`` false where ``enabled`` is None.

    Returns:
        ``{"enable_thinking": bool}`` and/or ``{"reasoning_effort": level}`` as the
        template reads them; empty when it reads neither or nothing was asked.
    """
    source = _template_source(tokenizer)
    if enabled is None and effort == "none":
        enabled = False
    kwargs: dict[str, Any] = {}
    custom_renderer = getattr(tokenizer, "_chat_template", None) is not None
    if enabled is not None and ("enable_thinking" in source or custom_renderer):
        kwargs["enable_thinking"] = enabled
    if effort is not None and "reasoning_effort" in source:
        kwargs["reasoning_effort"] = _EFFORT_LEVELS.get(effort, "medium")
    return kwargs
