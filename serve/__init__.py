"""`edge-spec serve`: an OpenAI-compatible HTTP server over one loaded pair (FastAPI, uvicorn, sse-starlette).

serve/run.py binds and runs it, serve/app.py holds the endpoints, serve/schemas.py the request and reply bodies, and
serve/worker.py the one generation thread that requests queue for. docs/server.md says how to use it.
"""
