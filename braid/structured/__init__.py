"""Structured output: grammars (llguidance) that mask each sampled position, drafts included."""
