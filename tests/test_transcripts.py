"""smollm2-135m's exact greedy text, pinned: a change to the engine, the runtime or the chat template that alters
what the target says fails here. Greedy speculation must give plain decoding's text, and plain decoding must not
drift."""

from __future__ import annotations

import json

import pytest
from edge.models.pair import Pair

from tests.cli_helpers import run

GREEDY_GENERATE = "The answer to this classic math problem is 4."
GREEDY_GENERATE_TOKENS = [504, 2988, 288, 451, 8170, 4119, 1732, 314, 216, 36, 30]
GREEDY_CHAT = ["L'Étoile, la Cité, la France, la France, la France, la",
               "L'Ion, la Roma, la Roma, la Roma, la Roma, la Roma,"]


@pytest.mark.parametrize("decoding", [["--no-spec"], ["--budget", "16"], []])
def test_greedy_generate_says_exactly_the_pinned_text(smollm2: Pair, decoding: list[str]) -> None:
    result = run("generate", "What is 2 + 2?", "--pair", "smollm2-135m", "--max-tokens", "24", "--temperature", "0",
                 "--json", *decoding)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["text"], out["tokens"], out["finish_reason"]) == (GREEDY_GENERATE, GREEDY_GENERATE_TOKENS, "stop")


def test_greedy_chat_says_exactly_the_pinned_transcript(smollm2: Pair) -> None:
    result = run("chat", "smollm2-135m", "--max-tokens", "20", "--temperature", "0", "--budget", "16",
                 input="What is the capital of France?\nAnd of Italy?\n")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line.strip()] == GREEDY_CHAT
