"""Running `edge-spec` in-process as users type it (typer's CliRunner), and the check every bad input must pass."""

from __future__ import annotations

from edge.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()


def run(*args: str, input: str | None = None):
    return runner.invoke(app, list(args), input=input)


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def missing_flags(line: str) -> list[str]:
    """The flags an `edge-spec COMMAND ...` line shows that COMMAND does not take (a missing COMMAND: all of them)."""
    import re

    words = re.sub(r"\"[^\"]*\"|'[^']*'|\$\([^)]*\)", " ", line).replace("|", " ").split()  # values, not flags
    if "edge-spec" not in words:
        return []
    words = words[words.index("edge-spec") + 1:]
    if not words or words[0].startswith("-"):
        return [word for word in words if word not in ("--version", "--help", "--models") and word.startswith("-")]
    shown = run(words[0], "--help")
    if shown.exit_code != 0:
        return [words[0]]
    flags = (word.strip("[]") for word in words[1:] if word.strip("[]").startswith("-"))
    return [flag for flag in flags
            if not re.search(rf"(^|[\s,]){re.escape(flag.split('=')[0])}([\s,/]|$)", shown.stdout, re.MULTILINE)]
