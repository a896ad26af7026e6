"""textgate: a streaming-first text-generation gateway (TGI- and OpenAI-compatible)."""

__version__ = "0.1.0"
