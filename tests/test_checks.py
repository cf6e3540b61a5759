"""The checks other tests make can fail: each, given its broken twin (what a wrong engine, server or chat would
produce), raises. Checks that hold whatever the code does (a count >= 1, a list of at least two lines) prove nothing."""

from __future__ import annotations

import pytest

from tests.test_cli import assert_rounds_add_up, assert_transcript
from tests.test_lossless import assert_replies_differ
from tests.test_server import assert_figures_add_up


def test_a_transcript_missing_a_reply_or_with_another_one_fails() -> None:
    replies = ["The capital of France is Paris.", "Rome."]
    assert_transcript("The capital of France is Paris.\nRome.\n", replies)
    for broken in ("The capital of France is Paris.\n", "The capital of France is Paris.\nRome.\nRome.\n",
                   "The capital of France is Paris.\n\nRome.\n", ""):
        with pytest.raises(AssertionError):
            assert_transcript(broken, replies)


def test_rounds_that_do_not_add_up_fail() -> None:
    assert_rounds_add_up({"rounds": 5, "plain_rounds": 3, "rule_rounds": {"match": 2}})
    for broken in ({"rounds": 5, "plain_rounds": 5, "rule_rounds": {"match": 1}},  # a round counted twice
                   {"rounds": 5, "plain_rounds": 3, "rule_rounds": {}},  # tree rounds not counted by rule
                   {"rounds": 0, "plain_rounds": 0, "rule_rounds": {}}):  # nothing ran
        with pytest.raises(AssertionError):
            assert_rounds_add_up(broken)


def test_figures_that_disagree_with_the_usage_fail() -> None:
    good = {"new_tokens": 24, "target_passes": 8, "tokens_per_pass": 3.0, "rounds": 8, "plain_rounds": 2,
            "rule_rounds": {"match": 6}}
    assert_figures_add_up(good, 24)
    for broken, completion in (({**good, "tokens_per_pass": 1.0}, 24),  # a figure that is not tokens / passes
                               (good, 12),  # figures of another reply
                               ({**good, "plain_rounds": 8}, 24)):  # rounds counted twice
        with pytest.raises(AssertionError):
            assert_figures_add_up(broken, completion)


def test_replies_all_alike_fail() -> None:
    assert_replies_differ([[i, 7] for i in range(8)])
    for broken in ([[1, 2]] * 8, [[i] for i in range(7)] + [[]], [[i] for i in range(5)]):
        with pytest.raises(AssertionError):
            assert_replies_differ(broken)
