"""Speculative decoding: the speculator (policy, cost model) and its proposers."""
