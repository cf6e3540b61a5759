"""What the fuzzing modules share (tests/test_fuzz.py, tests/test_fuzz_server.py): hypothesis's bounds for the
suite (EDGE_SPEC_FUZZ_EXAMPLES inputs per property, 150 by default, derandomized so CI is repeatable), any JSON value,
and the count of what the inputs came to, which docs/security.md quotes from a longer run (printed with -s)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("EDGE_SPEC_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
OUTCOMES: Counter[str] = Counter()  # what the inputs came to, for docs/security.md (printed with -s)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def print_outcomes() -> Iterator[None]:
    """After a module: what the fuzzed inputs came to (shown with -s)."""
    yield
    print("\nfuzzing outcomes:", dict(sorted(OUTCOMES.items())))
