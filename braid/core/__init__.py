"""The engine's bottom layer: requests, the scheduler, the block manager and prefix cache, the
step records and the stats. Plain Python: no torch, no model, nothing of braid above it."""
