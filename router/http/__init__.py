"""The HTTP side shared by every API: the app, validation, request bodies, SSE, errors, docs."""
