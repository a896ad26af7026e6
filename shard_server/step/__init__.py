"""textgate.shard_server.step: what one step does, after the servicer hands it a batch.

The per-request state (`sequence`: tokens, stopping, detokenizer), the flat varlen batch
a plan describes (`step_inputs`), the paged KV cache and the decode graphs replayed over
it, and what follows the forward pass: sampling, grammar masks and their token budget,
prompt logprobs, appending each sampled token (`postprocess`). Both step protocols
(`protocols/`) compose these; nothing here knows which protocol runs it.
"""
