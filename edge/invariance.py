"""Is a target batch-invariant? Tree-pass logits against plain one-token-per-pass decoding, bit for bit.

Speculation is lossless in floating point only if a token's logits do not depend on how many tokens shared
its pass. This measures that for a target as configured (weights, KV type, kernels), on tree shapes that
matter: a deep chain, the widest tree llama.cpp allows, and a tree grown by the drafter; and where the target
verifies trees past 255 nodes, a 1024-node tree of 255 leaves and a grown one of that budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edge.grow import MAX_LEAVES, GrowConfig, grow
from edge.protocols import Drafter, Target, verifies_chains_only
from edge.tree import TokenTree


@dataclass
class ShapeResult:
    shape: str
    nodes: int
    nodes_checked: int
    max_abs_diff: float
    argmax_differences: int


def tree_shapes(drafter: Drafter, prefix: list[int], root: int) -> dict[str, TokenTree]:
    chain = TokenTree(np.array([root, *range(100, 116)], np.int32), np.arange(-1, 16, dtype=np.int32),
                      np.arange(17, dtype=np.int32), np.zeros(17, np.float32))
    star = TokenTree(np.array([root, *range(200, 200 + MAX_LEAVES)], np.int32),
                     np.array([-1] + [0] * MAX_LEAVES, np.int32), np.array([0] + [1] * MAX_LEAVES, np.int32),
                     np.zeros(MAX_LEAVES + 1, np.float32))
    drafter.truncate(0)
    drafter.prefill(prefix)
    # without the one-node passes that extend the best path past the first steps: a 30-pass tree already
    # reaches 30 deep, and every checked leaf's whole path is decoded one token a pass
    grown, _ = grow(drafter, root, replace(GrowConfig.for_budget(255), extend_prob=None))
    drafter.truncate(0)
    return {"chain of 16": chain, "255 leaves": star, "grown, budget 255": grown}


def large_tree_shapes(drafter: Drafter, prefix: list[int], root: int, nodes: int = 1024) -> dict[str, TokenTree]:
    """Trees of `nodes` draft nodes and the most leaves llama.cpp allows: MAX_LEAVES chains of (nearly) equal length
    under the root, and the tree growth makes at that budget."""
    chain = np.arange(nodes) // MAX_LEAVES  # node i + 1 is the (i // 255)-th token of chain i % 255
    parents = np.where(chain == 0, 0, np.arange(nodes) + 1 - MAX_LEAVES).astype(np.int32)
    wide = TokenTree(np.array([root, *range(300, 300 + nodes)], np.int32), np.array([-1, *parents], np.int32),
                     np.array([0, *(chain + 1)], np.int32), np.zeros(nodes + 1, np.float32))
    drafter.truncate(0)
    drafter.prefill(prefix)
    grown, _ = grow(drafter, root, replace(GrowConfig.for_budget(nodes), extend_prob=None))
    drafter.truncate(0)
    return {f"{nodes} nodes, {MAX_LEAVES} leaves": wide, f"grown, budget {nodes}": grown}


def sequential_logits(target: Target, prefix: list[int], tokens: list[int]) -> np.ndarray:
    """Plain decoding, one token per pass after `prefix`: [len(tokens), n_vocab]."""
    target.truncate(0)
    target.prefill(prefix)
    return np.array([_one_pass(target, token) for token in tokens])


def _one_pass(target: Target, token: int) -> np.ndarray:
    """Run `token` alone after what the cache holds and keep it there: its logits."""
    root = TokenTree.root(token)
    logits = target.verify(root)[0].copy()
    target.commit(root, [0])
    return logits


def compare(target: Target, tree: TokenTree, prefix: list[int], max_paths: int = 60,
            cuts: bool = True) -> tuple[int, float, int]:
    """(nodes checked, max |difference|, argmax differences) between the tree pass and plain decoding, on the nodes
    of up to `max_paths` root-to-leaf paths.

    Plain decoding walks those nodes depth first, one pass a node, each seeing exactly its path's cells, each cell
    made by a one-token pass as plain decoding makes it. Stepping back to a node's parent cuts the cache there
    (a cell depends on its position and the cells before it, not on what ran after it): one pass per checked node.
    `cuts=False` for a cache a cut does not restore bit for bit (a QuantSpec cache re-runs a cut group as one batch):
    the prompt and the node's ancestors then run anew, as decoding each path from the prompt would."""
    target.truncate(0)
    target.prefill(prefix)
    tree_logits = target.verify(tree).copy()  # [n_nodes, n_vocab]
    mask = tree.ancestor_mask()
    leaves = tree.leaves()
    chosen = np.zeros(len(tree), bool)
    for leaf in leaves[:: max(1, len(leaves) // max_paths)]:
        chosen |= mask[leaf]
    children: dict[int, list[int]] = {}
    for node in np.flatnonzero(chosen)[1:].tolist():
        children.setdefault(int(tree.parents[node]), []).append(node)
    target.truncate(len(prefix))
    held = 0  # path nodes the cache holds past the prompt
    worst, flips = 0.0, 0
    stack = [0]
    while stack:
        node = stack.pop()
        depth = int(tree.depth[node])
        if held > depth and cuts:
            target.truncate(len(prefix) + depth)
        elif held > depth:
            target.truncate(0)
            target.prefill(prefix)
            for ancestor in np.flatnonzero(mask[node])[:-1].tolist():
                _one_pass(target, int(tree.tokens[ancestor]))
        reference = _one_pass(target, int(tree.tokens[node]))
        held = depth + 1
        worst = max(worst, float(np.abs(reference - tree_logits[node]).max()))
        flips += int(reference.argmax() != tree_logits[node].argmax())
        stack.extend(reversed(children.get(node, [])))
    target.truncate(0)
    return int(chosen.sum()), worst, flips


def check_batch_invariance(target: Target, drafter: Drafter, tokens: list[int],
                           progress: Callable[[str, int, int], None] | None = None) -> list[ShapeResult]:
    """Each tree shape's logits against sequential decoding; `progress(shape, done, total)` after each shape. A
    target that verifies a tree's likeliest path alone (verifies_chains_only) is checked on what it verifies: the
    chain and the grown tree's likeliest path."""
    prefix, root = tokens[:-1], tokens[-1]
    results = []
    shapes = tree_shapes(drafter, prefix, root)
    if verifies_chains_only(target):
        grown = shapes["grown, budget 255"].spine()
        shapes = {"chain of 16": shapes["chain of 16"], "grown, budget 255: its likeliest path": grown}
    elif target.max_tree > 1024 and target.n_ctx > len(tokens) + 1024:
        shapes.update(large_tree_shapes(drafter, prefix, root))
    for shape, tree in shapes.items():
        checked, worst, flips = compare(target, tree, prefix)
        results.append(ShapeResult(shape, len(tree), checked, worst, flips))
        if progress is not None:
            progress(shape, len(results), len(shapes))
    return results
