"""`edge-spec check` as a library call: is this target batch-invariant on this machine, with this KV cache type?"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from edge.errors import UserError
from edge.grow import MAX_LEAVES
from edge.invariance import check_batch_invariance

# A fixed text, so results are comparable between machines and files.
TEXT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined "
        "movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses were running in "
        "more than two hundred cities across Europe, and the price of books fell sharply. ") * 3


def run_check(path: Path, kv_type: str, threads: int | None, report) -> dict[str, Any]:
    from edge.models.registry import KV_TYPES
    from edge.runtimes import DEFAULT, ModelOptions, runtime
    from edge.runtimes.gguf_file import check_gguf

    if kv_type not in KV_TYPES:
        raise UserError(f"kv_type must be one of {', '.join(KV_TYPES)} (got {kv_type!r})", "kv_type")
    info = check_gguf(path)
    engine = runtime(DEFAULT)  # loaded as a pair loads a target of this file
    target = engine.open_target(path, ModelOptions(n_ctx=1024, kv_type=kv_type, threads=threads), MAX_LEAVES + 1)
    drafter = engine.open_drafter(path, ModelOptions(n_ctx=1024, kv_type="q4_0", threads=threads), MAX_LEAVES + 1)
    try:
        tokens = target.tokenizer.tokenize(TEXT, add_special=True, parse_special=False)[:160]
        report(f"checking {path.name}: {len(tokens)} tokens of context, three tree shapes")
        started = time.perf_counter()

        def progress(shape: str, done: int, total: int) -> None:
            left = (time.perf_counter() - started) / done * (total - done)
            report(f"checked the {shape} tree ({done} of {total} shapes" + (f", about {left:.0f} s left)"
                                                                            if done < total else ")"))

        shapes = [dataclasses.asdict(r) for r in check_batch_invariance(target, drafter, tokens, progress)]
    finally:
        drafter.close()
        target.close()
    return {
        "file": str(path),
        "weight_types": sorted(info.weight_types),
        "kv_type": kv_type,
        "bit_exact": all(s["max_abs_diff"] == 0.0 for s in shapes),
        "edge_spec_guarantee": engine.lossless_guarantee(info.weight_types, kv_type, "target_dtype q8_0") is None,
        "shapes": shapes,
    }
