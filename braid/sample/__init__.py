"""Sampling: per-row sampling metadata and position-keyed randomness (sampler.py), verification
of speculative windows (verify.py), and the step's glue from logits to tokens and logprobs
(step.py)."""
