"""Which kernel moves a tree node's logits? The first tensor of the graph whose row for one node of a tree pass differs
from plain decoding's pass of that node, bit for bit: every node of both passes observed through llama.cpp's eval
callback, each F32 tensor read back (ggml_backend_tensor_get) and the node's row compared.

The tree is benchmarks/scattered_cells.py's chain with `--siblings` leaves after each node (node 2k is the k-th
sibling leaf with one sibling a node), or any tree given by its parents (`--parents -1,0,1,2,2`).

    PYTHONPATH=<a GPU build of llama-cpp-python>:. python benchmarks/first_difference.py --gpu-layers 31 --node 8
"""

from __future__ import annotations

import argparse
import ctypes
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import edge.runtimes.llama_cpp._native as native
import llama_cpp.llama_cpp as ll
import numpy as np
from edge.models.checking import TEXT
from edge.models.opening import materialize
from edge.models.registry import load_registry
from edge.runtimes import DEFAULT, ModelOptions, runtime
from edge.runtimes.llama_cpp.models import spine_first

from benchmarks.scattered_cells import CHAIN, PREFIX, spread_chain
from edge.grow import MAX_LEAVES
from edge.invariance import _one_pass
from edge.tree import TokenTree

# struct ggml_tensor (ggml.h): type, then the buffer, then ne[4]
BUFFER, NE = 8, 16


def _ggml() -> ctypes.PyDLL:
    lib = ctypes.PyDLL(str(Path(ll.__file__).parent / "lib" / "libggml-base.so"))
    for name, restype, argtypes in (
            ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
            ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
            ("ggml_backend_buffer_name", ctypes.c_char_p, [ctypes.c_void_p]),
            ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t])):
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


class Recorder:
    """An eval callback observing every node while `tensors` is a list: (name, op, where it ran, shape, data)."""

    def __init__(self) -> None:
        self.lib, self.tensors = _ggml(), None
        self.callback = ll.ggml_backend_sched_eval_callback(self._observe)

    def _where(self, tensor: int) -> str:
        buffer = ctypes.c_void_p.from_address(tensor + BUFFER).value
        return self.lib.ggml_backend_buffer_name(buffer).decode() if buffer else "?"

    def _observe(self, tensor: int, ask: bool, user_data: int) -> bool:
        if ask:
            return self.tensors is not None
        ne = tuple((ctypes.c_int64 * 4).from_address(tensor + NE))
        data = None
        if ctypes.c_int32.from_address(tensor).value == 0 and self.lib.ggml_is_contiguous(tensor):  # F32
            size = self.lib.ggml_nbytes(tensor)
            data = np.empty(size // 4, np.float32)
            self.lib.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, size)
            data = data.reshape(ne[::-1])
        self.tensors.append((self.lib.ggml_get_name(tensor).decode(), self.lib.ggml_op_desc(tensor).decode(),
                             self._where(tensor), ne, data))
        return True

    def pass_of(self, run: Callable[[], None]) -> list:
        self.tensors = []
        try:
            run()
            return self.tensors
        finally:
            self.tensors = None


def with_callback(recorder: Recorder, offload_kqv: bool) -> None:
    """Contexts made from now on call `recorder` for every node (and keep their KV cache on the CPU without
    offload_kqv): llama.cpp takes the callback only as a context is made."""
    filled = native._filled

    def fill(params: ctypes.Structure, **values: object) -> ctypes.Structure:
        params = filled(params, **values)
        if "n_ctx" in values:  # a context's parameters
            params.cb_eval, params.offload_kqv = recorder.callback, offload_kqv
        return params

    native._filled = fill


def token_row(data: np.ndarray, ne: tuple, other: tuple, row: int) -> np.ndarray | None:
    """A tensor's row for one token: along the one dimension where the two passes' shapes differ (their token counts),
    or the last dimension of more than one element where they agree; None where neither tells."""
    differ = [d for d in range(4) if ne[d] != other[d]]
    if len(differ) > 1:
        return None
    axis = differ[0] if differ else max((d for d in range(4) if ne[d] > 1), default=0)
    return np.take(data, row, axis=3 - axis)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--pair", default="smollm2-135m")
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--kv-type", default="bf16")
    parser.add_argument("--siblings", type=int, default=1)
    parser.add_argument("--parents", default=None, help="the tree by its parents instead, root first: -1,0,1,2,2")
    parser.add_argument("--prefix", type=int, default=PREFIX, help="the text's tokens before the tree's root")
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--no-offload-kqv", action="store_true", help="the KV cache on the CPU (llama.cpp -nkvo)")
    args = parser.parse_args()
    recorder = Recorder()
    with_callback(recorder, not args.no_offload_kqv)
    path = materialize(load_registry().pair(args.pair).target, print)
    target = runtime(DEFAULT).open_target(path, ModelOptions(n_ctx=1024, kv_type=args.kv_type,
                                                             gpu_layers=args.gpu_layers), MAX_LEAVES + 1)
    try:
        tokens = target.tokenizer.tokenize(TEXT, add_special=True, parse_special=False)
        prefix, chain = tokens[:args.prefix], tokens[args.prefix:args.prefix + CHAIN + 1]
        tree = spread_chain(chain, args.siblings, target.n_vocab)
        if args.parents:
            parents = [int(p) for p in args.parents.split(",")]
            depth = [0] * len(parents)
            for i in range(1, len(parents)):
                depth[i] = depth[parents[i]] + 1
            # a node continuing its parent's chain carries the text's token there; any other, another token
            picked = [chain[min(depth[i], CHAIN)] + (0 if parents[i] == i - 1 or i == 0 else 7)
                      for i in range(len(parents))]
            tree = TokenTree(np.array(picked, np.int32), np.array(parents, np.int32), np.array(depth, np.int32),
                             np.zeros(len(parents), np.float32))
        place = np.empty(len(tree), np.int64)
        place[spine_first(tree)] = np.arange(len(tree))
        target.truncate(0)
        target.prefill(prefix)
        logits = []
        tree_pass = recorder.pass_of(lambda: logits.append(target.verify(tree)[args.node].copy()))
        target.truncate(0)
        target.prefill(prefix)
        path_nodes = np.flatnonzero(tree.ancestor_mask()[args.node]).tolist()
        for ancestor in path_nodes[:-1]:
            _one_pass(target, int(tree.tokens[ancestor]))
        plain_pass = recorder.pass_of(lambda: logits.append(_one_pass(target, int(tree.tokens[args.node]))))
    finally:
        target.close()
    out = {"node": args.node, "depth": int(tree.depth[args.node]), "cell_in_tree": args.prefix + int(place[args.node]),
           "cell_plain": args.prefix + int(tree.depth[args.node]),
           "logits_max_abs_diff": float(np.abs(logits[0] - logits[1]).max()), "first_difference": None,
           "attention_by_layer": []}
    seen, index = Counter(), {}
    for i, (name, *_rest) in enumerate(tree_pass):
        index[(name, seen[name])] = i
        seen[name] += 1
    seen = Counter()
    for name, op, _where, ne, data in plain_pass:
        key = (name, seen[name])
        seen[name] += 1
        if key not in index or data is None or tree_pass[index[key]][4] is None:
            continue
        other = tree_pass[index[key]]
        plain_row = token_row(data, ne, other[3], 0)
        tree_row = token_row(other[4], other[3], ne, int(place[args.node]))
        if plain_row is None or tree_row is None or plain_row.shape != tree_row.shape:
            continue
        diff = float(np.abs(plain_row - tree_row).max())
        if op == "FLASH_ATTN_EXT":
            out["attention_by_layer"].append(diff)
        if diff and out["first_difference"] is None:
            out["first_difference"] = {"tensor": name, "op": op, "ran_on": other[2], "max_abs_diff": diff}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
