"""The request layer: a generation request as every API hands it to the engine.

The canonical parameters (`schemas.GenerateParameters`, TGI's names), their validation
and tokenization (`validation.Validator` -> `engine.request.ValidRequest`), grammars, and
the result a request's channel events add up to (`result.collect`). No HTTP, no API's
own shapes: `http/` and the APIs import this, never the other way round.
"""
