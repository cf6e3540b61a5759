"""smollm2-135m's exact greedy text, pinned: a change to the engine, the runtime or the chat template that alters
what the target says fails here. Greedy speculation must give plain decoding's text, and plain decoding must not
drift."""

from __future__ import annotations

import json

import pytest
from edge.models.pair import Pair

from tests.cli_helpers import run
from tests.oracles import simd_level

# ggml's AVX-512 and AVX2 kernels round differently, and SmolLM2's greedy text follows: pinned for each. "bf16": the
# pair's settings, which trees verify on and --no-spec decodes on; "f16": llama.cpp's own settings (an f16 KV cache),
# which `--budget auto` decodes plainly on where the plan drops the drafter. On AVX-512 the two texts are one.
GREEDY_GENERATE = {
    "avx512": {"bf16": ("The answer to this classic math problem is 4.",
                        [504, 2988, 288, 451, 8170, 4119, 1732, 314, 216, 36, 30])},
    "avx2": {"bf16": ("The answer is 4.", [504, 2988, 314, 216, 36, 30]),
             "f16": ("The answer to this classic math problem is 4.",
                     [504, 2988, 288, 451, 8170, 4119, 1732, 314, 216, 36, 30])},
}
GREEDY_CHAT = ["L'Étoile, la Cité, la France, la France, la France, la",
               "L'Ion, la Roma, la Roma, la Roma, la Roma, la Roma,"]


@pytest.mark.parametrize("decoding", [["--no-spec"], ["--budget", "16"], []])
def test_greedy_generate_says_exactly_the_pinned_text(smollm2: Pair, decoding: list[str]) -> None:
    pinned = GREEDY_GENERATE.get(simd_level())
    if pinned is None:
        pytest.skip(f"no greedy text pinned for a {simd_level()} CPU")
    result = run("generate", "What is 2 + 2?", "--pair", "smollm2-135m", "--max-tokens", "24", "--temperature", "0",
                 "--json", *decoding)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    # --budget auto (no flag) may decode on either settings; the others on the pair's
    texts = list(pinned.values()) if not decoding else [pinned["bf16"]]
    assert (out["text"], out["tokens"]) in texts and out["finish_reason"] == "stop", out


def test_greedy_chat_says_exactly_the_pinned_transcript(smollm2: Pair) -> None:
    result = run("chat", "smollm2-135m", "--max-tokens", "20", "--temperature", "0", "--budget", "16",
                 input="What is the capital of France?\nAnd of Italy?\n")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line.strip()] == GREEDY_CHAT
