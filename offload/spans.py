"""A target file's tensors as spans of its mapping, in the order a pass reads them, and the runs of pages a layer
takes: what offload/window.py keeps resident, streams and drops behind the pass."""

from __future__ import annotations

import mmap
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One tensor's bytes: its range in the target's mapping and in the file, and the last layer that uses it."""

    start: int
    end: int
    offset: int  # the file offset of `start` (page-aligned, as the mapping is)
    size: int  # the tensor's bytes
    layer: int  # dropped once this layer is computed; the head and a tied token table: n_layers (at the pass's end)


def resident_set(spans: list[Span], resident: int) -> tuple[list[Span], frozenset[int]]:
    """The spans, and the indices of those that stay resident (up to `resident` bytes): the head first, then the
    first spans in pass order, the one the set ends in cut in two at a page (the set then holds exactly what the
    memory has room for). The rest, a contiguous sweep of the pass's last layers, streams.

    The head (the spans past the last block: the output matrix, and a tied token table) is one matmul: it cannot be
    dropped behind the pass as it goes, as a layer is, and where it is larger than the window its own read-ahead
    evicts its first pages before the pass reads them. Streamed last, it read 1.19x its bytes a pass (Qwen2.5-Coder-
    1.5B under 1049 MiB: a 191 MB head in a 134 MiB window); kept, the layers that stream instead go a layer at a
    time. Where the head alone does not fit, the set is the first spans in pass order."""
    last = max((span.layer for span in spans), default=0)
    head = [index for index, span in enumerate(spans) if span.layer == last]
    head_bytes = sum(spans[index].size for index in head)
    if head_bytes > resident:
        head, head_bytes = [], 0
    kept, total = list(head), head_bytes
    for index, span in enumerate(spans):
        if index in head:
            continue
        if total + span.size > resident:
            cut = span.start + (resident - total) // mmap.PAGESIZE * mmap.PAGESIZE
            if span.start < cut < span.end:  # the span the set ends in: its first pages stay
                first = Span(span.start, cut, span.offset, cut - span.start, span.layer)
                rest = Span(cut, span.end, span.offset + cut - span.start, span.end - cut, span.layer)
                spans = [*spans[:index], first, rest, *spans[index + 1:]]
                kept = [k + (k > index) for k in kept] + [index]
            break
        kept.append(index)
        total += span.size
    return spans, frozenset(kept)


def merged_runs(spans: list[Span]) -> list[tuple[int, int, int]]:
    """Spans merged into contiguous runs of the mapping (start, end, file offset), in address order."""
    runs: list[tuple[int, int, int]] = []
    for span in sorted(spans, key=lambda span: span.start):
        if runs and span.start <= runs[-1][1] + mmap.PAGESIZE:
            start, end, offset = runs[-1]
            runs[-1] = (start, max(span.end, end), offset)
        else:
            runs.append((span.start, span.end, span.offset))
    return runs


def whole_pages(runs: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The whole pages of each run (start is page-aligned; a last page shared with what follows is left out)."""
    kept = [(start, end - end % mmap.PAGESIZE) for start, end, _ in runs]
    return [(start, end) for start, end in kept if end > start]


def outside(run: tuple[int, int, int], kept: list[tuple[int, int]]) -> tuple[int, int, int]:
    """A streamed run less any page of the resident set (locked: madvise refuses a range holding one) at its ends."""
    start, end, offset = run
    for low, high in kept:
        if low <= start < high:
            offset, start = offset + high - start, high
        if low < end <= high:
            end = low
    return start, max(start, end), offset


def layer_regions(spans: list[Span]) -> dict[int, list[tuple[int, int, int]]]:
    """Each layer's spans merged into contiguous runs (start, end, file offset): a file keeps a layer's tensors
    together, though not always its layers in order (blk.1 before blk.10 before blk.2, sorted by name)."""
    by_layer: dict[int, list[Span]] = {}
    for span in spans:
        by_layer.setdefault(span.layer, []).append(span)
    return {layer: merged_runs(layer_spans) for layer, layer_spans in by_layer.items()}


def layer_of(name: str) -> int | None:
    match = re.match(r"blk\.(\d+)\.", name)
    return int(match.group(1)) if match else None
