"""The OpenAI API: chat and text completions, models, tokenize, their schemas and SSE."""
