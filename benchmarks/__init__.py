"""Measurement scripts (README.md here); a package so that the tests can use their tooling (memcap, serve_process)."""
