"""OpenAI-compatible HTTP server: `braid serve` (FastAPI + uvicorn, one engine thread)."""
