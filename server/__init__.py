"""The HTTP layer: OpenAI-compatible routes over the engine (see docs/architecture.md)."""
