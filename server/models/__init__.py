"""The served models: per-model state, looked up by served name."""
