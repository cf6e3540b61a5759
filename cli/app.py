"""The one typer app every command registers on, its global options (--models, --version) and its --help style."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run models larger than your memory at interactive speed: lossless tree speculative decoding.",
)


def _help_without_type_labels() -> None:
    """--help without typer's <int> / <bool> / <str> beside every option: a flag takes no value, and the option's
    name and help say what the others take (as llama-cli's and ollama's help read)."""
    from typer import core

    for kind in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        if kind is not None and hasattr(kind, "display_type_rich"):
            kind.display_type_rich = lambda self, ctx: self.metavar  # None unless an option names its own


_help_without_type_labels()


@app.callback()
def main_options(
    ctx: typer.Context,
    models: Annotated[Path | None, typer.Option("--models", help="models.toml to use (default: the packaged one)",
                                                 show_default=False)] = None,
    version: Annotated[bool, typer.Option("--version", help="print edge-spec's version and exit",
                                          callback=lambda shown: _print_version(shown), is_eager=True)] = False,
) -> None:
    ctx.obj = models


def _print_version(asked: bool) -> None:
    if not asked:
        return
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        print(f"edge-spec {installed('edge-spec')}")
    except PackageNotFoundError:
        print("edge-spec (not installed as a package)")
    raise typer.Exit(0)
