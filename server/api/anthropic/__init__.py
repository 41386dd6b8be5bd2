"""The Anthropic Messages protocol adapter: ``/v1/messages`` and its ``count_tokens``."""
