"""Does a path's logits in a tree pass depend on where its ancestors' cells lie? The same chain of the fixed check
text's tokens verified alone (its cells where plain decoding puts them), then with sibling leaves after each node (its
ancestors' cells spread out), each against plain decoding one token a pass (edge.invariance.compare): on a backend
whose attention sums the cache in tiles, the spread chain moves where the lone one does not (docs/runtimes.md).

    PYTHONPATH=<a GPU build of llama-cpp-python>:. python benchmarks/scattered_cells.py --gpu-layers 31
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from edge.models.checking import TEXT
from edge.models.opening import materialize
from edge.models.registry import load_registry
from edge.runtimes import DEFAULT, ModelOptions, runtime

from edge.grow import MAX_LEAVES
from edge.invariance import compare
from edge.tree import TokenTree

PREFIX, CHAIN = 140, 16


def spread_chain(chain: list[int], siblings: int, vocab: int) -> TokenTree:
    """chain[0] as the root, then each next token of the chain with `siblings` leaves after it (other tokens)."""
    tokens, parents, last = [chain[0]], [-1], 0
    for token in chain[1:]:
        tokens.append(token)
        parents.append(last)
        node = len(tokens) - 1
        for s in range(siblings):
            tokens.append((token + 7 + s) % vocab)
            parents.append(last)
        last = node
    parent = np.array(parents, np.int32)
    depth = np.zeros(len(tokens), np.int32)
    for i in range(1, len(tokens)):
        depth[i] = depth[parent[i]] + 1
    return TokenTree(np.array(tokens, np.int32), parent, depth, np.zeros(len(tokens), np.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="smollm2-135m")
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--kv-type", default="bf16")
    args = parser.parse_args()
    path = materialize(load_registry().pair(args.pair).target, print)
    target = runtime(DEFAULT).open_target(path, ModelOptions(n_ctx=1024, kv_type=args.kv_type,
                                                             gpu_layers=args.gpu_layers), MAX_LEAVES + 1)
    try:
        tokens = target.tokenizer.tokenize(TEXT, add_special=True, parse_special=False)
        prefix, chain = tokens[:PREFIX], tokens[PREFIX:PREFIX + CHAIN + 1]
        for siblings in (0, 1, 3):
            tree = spread_chain(chain, siblings, target.n_vocab)
            checked, worst, flips = compare(target, tree, prefix, max_paths=100)
            print(json.dumps({"chain": CHAIN, "siblings_a_node": siblings, "nodes": len(tree), "checked": checked,
                              "max_abs_diff": worst, "argmax_differences": flips}), flush=True)
    finally:
        target.close()


if __name__ == "__main__":
    main()
