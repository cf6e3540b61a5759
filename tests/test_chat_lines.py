"""What the chat says of itself: its first line (where the target runs, whether trees pay there and why, from the
plan) and /stats' line for the last reply."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from edge.cli.render import rounds_line
from edge.cli.repl import opening_line

import edge
from edge.generate import Stats
from edge.options import LoadOptions

CORES = os.cpu_count()


def described(placement: str = "ram", streamed: bool = False, use: str = "drafter", rates: dict | None = None,
              gpu_layers: int = 0, residency: tuple[int, int] | None = None, budget: int | str = "auto") -> object:
    """A loaded pair as opening_line reads it, without loading one."""
    return SimpleNamespace(name="qwen2.5-coder-1.5b", options=LoadOptions(placement=placement, gpu_layers=gpu_layers),
                           streamed=streamed, placement="ssd" if streamed else placement, plan_use=use,
                           plan_rates=rates or {}, residency=lambda: residency, drafter=object(), corpus=None,
                           budget=budget, target=SimpleNamespace(path=Path("/nonexistent.gguf")))


def test_in_ram_the_first_line_says_trees_do_not_pay_and_how_to_see_them_pay() -> None:
    pair = described(use="plain", rates={"drafter": 4.05, "plain": 10.9, "lookup": 4.89})
    assert opening_line(pair, True) == (
        f"qwen2.5-coder-1.5b in RAM, on {CORES} cores: trees do not pay here (plain decoding 10.9 tokens/s predicted, "
        "the drafter's trees 4.05): decoding plainly; a model larger than memory, or --placement ssd, shows what "
        "they do")


def test_streamed_the_first_line_says_what_stays_in_ram_and_that_trees_pay() -> None:
    pair = described(streamed=True, rates={"drafter": 3.72, "plain": 1.05, "lookup": 1.4},
                     residency=(int(0.56 * 2**30), int(0.42 * 2**30)))
    assert opening_line(pair, True) == (
        f"qwen2.5-coder-1.5b larger than free RAM: 0.56 GiB of it kept in RAM, 0.42 GiB read from the drive every "
        f"pass, on {CORES} cores: trees pay here (the drafter's trees 3.72 tokens/s predicted, plain decoding 1.05): "
        "each pass checks a tree of guesses")


def test_the_first_line_names_gpu_layers_a_forced_placement_and_no_choice() -> None:
    forced = described(placement="ssd", rates={"drafter": 2.4, "plain": 1.81})
    assert opening_line(forced, True).startswith("qwen2.5-coder-1.5b read from the drive every pass (--placement "
                                                 f"ssd), on {CORES} cores: trees pay here")
    on_gpu = described(gpu_layers=28, budget=64)
    assert opening_line(on_gpu, True) == ("qwen2.5-coder-1.5b in RAM, 28 target layers on the GPU: trees of 64 draft "
                                          "nodes every round (--budget 64)")
    assert opening_line(described(), True).endswith(": trees sized round by round from measured pass times "
                                                    "(--budget auto), none where they do not pay")
    assert opening_line(described(), False).endswith(": speculation off (--no-spec), the target decodes alone")


@pytest.mark.parametrize("placement", ["ram", "ssd"])
def test_a_real_pairs_first_line(placement: str) -> None:
    """SmolLM2 loaded as the chat loads it (the plan chooses): in RAM, and read from the drive every pass."""
    with edge.load("smollm2-135m", speculate="auto", placement=placement, ctx=256) as pair:
        line = opening_line(pair, True)
    where = "in RAM" if placement == "ram" else "read from the drive every pass \\(--placement ssd\\)"
    trees = (r"trees do not pay here \(plain decoding [\d.]+ tokens/s predicted, the drafter's trees [\d.]+\): "
             r"decoding plainly|trees pay here \(the drafter's trees [\d.]+ tokens/s predicted, plain decoding "
             r"[\d.]+\): each pass checks a tree of guesses|the drafter's memory goes to the target.*")
    assert re.fullmatch(rf"smollm2-135m {where}, on {CORES} cores: ({trees})(; a model larger than memory, or "
                        r"--placement ssd, shows what they do)?", line), line


def test_stats_says_how_the_last_replys_rounds_went() -> None:
    stats = Stats(new_tokens=48, rounds=25, plain_rounds=3, lookup_rounds=2, target_passes=25, draft_s=2.81,
                  verify_s=17.4, prefill_s=0.6)
    assert rounds_line(stats) == ("25 rounds (22 with a tree (2 by lookup), 3 plain) · 1.92 tokens a pass · drafting "
                                  "2.81s (14%), verifying 17.40s (84%), prompt 0.60s (3%)")
