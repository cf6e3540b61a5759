"""The docs say only what the code still has: every `edge-spec` command line they quote takes the flags it shows, and
every constant they name (in backticks, or as NAME = value) is the code's, with that value."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.cli_helpers import missing_flags
from tests.conftest import REPO

DOCS = sorted((REPO / "docs").glob("*.md"))
CODE = ("edge", "models", "runtimes", "quant", "offload", "cli", "serve", "benchmarks")
# Names the docs quote that are not edge-spec's constants: the OS's and other projects' (madvise, prctl, the Hub)
FOREIGN = re.compile(r"^(MADV_|PR_SET_|HF_|GGML_|POSIX_)")


def _constants() -> dict[str, object]:
    """Every module-level NAME = literal in the code (a value that is not a literal counts as None)."""
    found: dict[str, object] = {}
    for folder in CODE:
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                    if isinstance(node, ast.AnnAssign) else []
                for target in targets:
                    if isinstance(target, ast.Name) and target.id.isupper():
                        try:
                            found[target.id] = ast.literal_eval(node.value) if node.value is not None else None
                        except ValueError:
                            found.setdefault(target.id, None)
    return found


def _strings() -> str:
    """The code's text, for environment variables it reads by name."""
    return "\n".join(path.read_text(encoding="utf-8") for folder in CODE for path in (REPO / folder).rglob("*.py"))


def _command_lines(text: str) -> list[str]:
    """`edge-spec ...` as quoted: in code spans and in code blocks (a line ending in a backslash goes on)."""
    lines = re.findall(r"`(edge-spec [^`]+)`", text)
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        lines += [line.split("#", 1)[0] for line in block.replace("\\\n", " ").splitlines() if "edge-spec " in line]
    return lines


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_quoted_commands_take_the_flags_they_show(doc: Path) -> None:
    missing = [(line, flag) for line in _command_lines(doc.read_text(encoding="utf-8"))
               for flag in missing_flags(line)]
    assert not missing, missing


def test_quoted_constants_are_the_codes() -> None:
    constants, code = _constants(), _strings()
    wrong = []
    for doc in [*DOCS, REPO / "README.md"]:
        text = doc.read_text(encoding="utf-8")
        for name in set(re.findall(r"`([A-Z][A-Z0-9_]{3,})`", text)) - {n for n in constants if n in text}:
            if not FOREIGN.match(name) and f'"{name}"' not in code:  # an environment variable the code reads
                wrong.append((doc.name, name, "not in the code"))
        for name, value in re.findall(r"\b([A-Z][A-Z0-9_]{3,}) = (-?[0-9][0-9_.]*)\b", text):
            if name in constants and constants[name] is not None and float(value.replace("_", "")) != constants[name]:
                wrong.append((doc.name, name, f"{value} in the docs, {constants[name]} in the code"))
            elif name not in constants and not FOREIGN.match(name):
                wrong.append((doc.name, name, "not in the code"))
    assert not wrong, wrong
