"""The chat template of a GGUF file: its own, else its family's standard one (logged).

Many GGUF files carry no ``tokenizer.chat_template``. llama.cpp then picks a built-in
template by the model's family; mlxserve does the same, recognising the family by the
vocabulary's control tokens (the surest sign of the format the model was tuned on), then
by architecture, and falling back to ChatML as llama.cpp's server does.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# Gemma has no system role: a system message is put in front of the first user turn.
GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + ns.system + message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
PHI3 = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
# Mistral's [INST] format (v0.1-v0.3): the system message joins the first user turn.
MISTRAL = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\\n\\n' %}"
    "{% elif message['role'] == 'user' %}"
    "{{ '[INST] ' + ns.system + message['content'] + ' [/INST]' }}{% set ns.system = '' %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "phi3": PHI3, "mistral": MISTRAL}

# A control token that identifies the format, checked in this order.
_MARKERS = (
    ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"),
    ("<|im_start|>", "chatml"),
    ("<|assistant|>", "phi3"),
    ("[INST]", "mistral"),
)
# Architecture table families -> template when the vocabulary has no marker.
_BY_FAMILY = {"gemma": "gemma", "phi3": "phi3", "chatml": "chatml", "llama": "mistral"}


def default_template_name(tokens: list[str], arch_family: str) -> str:
    """The built-in template for a file without one (see the module doc)."""
    vocab = set(tokens)
    for marker, name in _MARKERS:
        if marker in vocab:
            return name
    return _BY_FAMILY.get(arch_family, "chatml")


def chat_template_for(metadata: dict, arch_family: str) -> tuple[str, str]:
    """``(template, source)``: the file's ``tokenizer.chat_template`` (source ``"file"``) or
    the family default (source: its name), which is logged."""
    own = metadata.get("tokenizer.chat_template")
    if isinstance(own, str) and own.strip():
        return own, "file"
    name = default_template_name(metadata.get("tokenizer.ggml.tokens") or [], arch_family)
    logger.info("GGUF file has no chat template; using the built-in %s template", name)
    return TEMPLATES[name], name
