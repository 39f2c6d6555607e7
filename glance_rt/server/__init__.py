"""`glance-rt serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn; imported only by serve)."""
