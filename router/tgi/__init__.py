"""TGI's API: `/generate`, `/generate_stream`, `POST /`, `/tokenize` and their JSON shapes."""
