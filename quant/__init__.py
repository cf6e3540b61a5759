"""Drafter compression: group-wise 4-bit weights (int4), a GGUF file's own block grids packed without loss
(grid), the QuantSpec hierarchical 4-bit KV cache (kv), and frequency-ranked vocabularies for a trimmed draft
head. Imports numpy only; int4 calls onnxruntime's own MatMulNBits packers (and onnx for initializers) inside the
functions that need them."""
