"""Loading models: mlx-lm directories, GGUF files, the embedded default, CPU conversion."""
