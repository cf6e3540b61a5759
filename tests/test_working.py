"""What `working` draws on a terminal while a model is fetched: a spinner on the step at hand and one row per
download, which goes once the download is finished (the library's next line says how it went)."""

from __future__ import annotations

import io
import time
from collections import deque

import pytest
from edge.cli.options import working
from edge.cli.render import Working, report
from rich.console import Console


def drawn(shown: Working) -> str:
    console = Console(file=io.StringIO(), width=100, record=True)
    console.print(shown)
    return console.export_text()


def test_a_download_is_one_row_while_under_way(capsys: pytest.CaptureFixture[str]) -> None:
    shown = Working("loading smollm2-135m")
    assert drawn(shown).split()[1:] == ["loading", "smollm2-135m"]  # after the spinner's frame
    shown("downloading model.gguf from PyPI (2 wheels)")
    assert "downloading model.gguf from PyPI (2 wheels)" in capsys.readouterr().err  # printed, and the spinner's
    shown.download("model.gguf", 0, None, False)
    assert "0/? bytes" in drawn(shown)
    shown.download("model.gguf", 30_000_000, 120_000_000, False)
    rows = drawn(shown).splitlines()
    assert len(rows) == 2 and rows[0].startswith("model.gguf") and "30.0/120.0 MB" in rows[0]
    assert rows[0].endswith("? -:--:--")  # no speed yet
    shown.seen["model.gguf"] = deque([(time.monotonic() - 1, 30_000_000)])  # as if that was a second ago
    shown.download("model.gguf", 40_000_000, 130_000_000, False)  # 10 MB later, with a new estimate of the total
    assert drawn(shown).splitlines()[0].endswith("40.0/130.0 MB 10.0 MB/s 0:00:09")
    assert rows[1].endswith("downloading model.gguf from PyPI (2 wheels)")
    shown.download("model.gguf", 120_000_000, 120_000_000, True)
    assert len(drawn(shown).splitlines()) == 1  # the spinner alone


def test_off_a_terminal_only_lines_are_reported() -> None:
    with working("loading smollm2-135m") as said:  # pytest's stderr is no terminal
        assert said is report and not hasattr(said, "download")
