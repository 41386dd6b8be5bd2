"""The KV store: slot-indexed pools per layer and the mlx-lm cache views over them."""
