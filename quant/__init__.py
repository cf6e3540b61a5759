"""Drafter compression: group-wise 4-bit weights, the QuantSpec hierarchical 4-bit KV cache, and
frequency-ranked vocabularies for a trimmed draft head. numpy only."""
