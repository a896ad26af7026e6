"""The OpenAI-compatible API: chat and text completions, models, streaming chunks."""
