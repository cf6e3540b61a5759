"""`edge-spec serve`: an OpenAI-compatible HTTP server over one loaded pair (FastAPI, uvicorn, sse-starlette).

serve/run.py binds and runs it; serve/app.py holds the endpoints, each a function of the request and the app's state;
serve/gate.py refuses what no endpoint should see, serve/reading.py reads and checks a request's body,
serve/schemas.py holds the request and reply bodies, serve/replies.py sends a reply whole or streamed, and
serve/worker.py is the one generation thread that requests queue for. docs/server.md says how to use it.
"""
