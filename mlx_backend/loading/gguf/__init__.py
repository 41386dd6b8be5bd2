"""GGUF files (llama.cpp's format) read by mlxserve itself into mlx-lm models.

``model_loader.load_gguf_model`` is the entry point (``loading/loader.py`` calls it);
``tokenizer.load_gguf_tokenizer`` builds the tokenizer and ``convert.convert_gguf`` writes
an MLX model directory. See ``docs/architecture.md`` for the files.
"""
