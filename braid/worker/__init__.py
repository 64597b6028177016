"""Everything that touches tensors: the model runner, KV memory sizing, and each step's
sampling and verification of drafts."""
