"""A runtime written from edge/protocols.py alone, as someone adding one (a GPU runtime, MLX) would: numpy models
over a GGUF file's vocabulary (tests/ggufs.write_gguf's), registered by name (runtimes.register) and then loaded,
decoded, benchmarked and served like the built-in ones (tests/test_layout.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from edge.runtimes import ModelOptions, Report, Traits
from edge.runtimes.gguf_file import check_gguf

from edge.protocols import SpecialTokens
from tests.tiny import TinyModel

TRAITS = Traits(streams=False, splits_layers=False, trims_head=False, shared_cache=False, max_tree=None,
                providers=False)


class FakeModel(TinyModel):
    """A target or a drafter: next-token logits from the last two tokens (TinyModel), its special tokens the file's."""

    runtime = "fake"

    def __init__(self, path: Path, options: ModelOptions, noise: float = 0.0):
        info = check_gguf(path)
        super().__init__(n_vocab=info.n_vocab, seed=3)
        if noise:  # a drafter that mostly agrees with the target of the same file
            shake = np.random.default_rng(4).standard_normal(self.table.shape).astype(np.float32)
            self.table = self.table + shake * noise
        self.path, self.n_ctx = path, options.n_ctx
        bos, eos = info.bos_token_id, info.eos_token_id
        self.special = SpecialTokens(bos=bos, eos=eos, stop=frozenset({eos}), ids=frozenset({0, bos, eos}))

    def kv_bytes_per_token(self) -> float:
        return 0.0

    def close(self) -> None:
        self.cache, self.pending = [], []


def open_target(path: Path, options: ModelOptions, max_tree: int) -> FakeModel:
    target = FakeModel(path, options)
    target.max_tree = max_tree
    return target


def open_drafter(path: Path, options: ModelOptions, max_tree: int, head_ids=None,
                 report: Report | None = None) -> FakeModel:
    return FakeModel(path, options, noise=0.5)


def open_shared(target: Path, drafter: Path, options: ModelOptions, head_ids=None, report: Report | None = None):
    raise NotImplementedError("fake models keep their own caches")


def lossless_guarantee(weight_types: frozenset[str], kv_type: str, fix: str) -> str | None:
    return None  # numpy, one row at a time: every token's logits are the same in any batch
