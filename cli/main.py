"""The `edge-spec` command. Every command works with no arguments on the default pair.

The commands live by concern and register on the one app (cli/app.py) when imported here, in --help's order:
cli/decoding.py (generate, chat, serve), cli/managing.py (models, rm, pull, prepare), cli/measuring.py (bench, check,
plan); cli/options.py holds the options and helpers they share."""

from __future__ import annotations

from edge.cli import decoding, managing, measuring  # noqa: F401  (importing a command module registers its commands)
from edge.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app(prog_name="edge-spec")
