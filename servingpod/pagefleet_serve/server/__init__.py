"""The serving pod's OpenAI-compatible HTTP server (FastAPI under uvicorn)."""
