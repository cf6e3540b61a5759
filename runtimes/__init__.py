"""What runs a model, looked up by name: each runtime is a subpackage imported only when a model of it loads, so
`edge-spec --help` and `import edge` load neither llama.cpp nor onnxruntime.

- `llama_cpp`: GGUF targets and drafters through llama-cpp-python's low-level API (a tree is one llama_decode).
- `onnx`: the drafter on ONNX Runtime (int4 weights, a 4-bit KV cache, a trimmed head), and the QuantSpec target.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from edge.errors import UserError
from edge.options import RUNTIMES


def runtime(name: str) -> ModuleType:
    """The runtime package `name` ("llama_cpp" or "onnx"), imported on first use."""
    if name not in RUNTIMES:
        raise UserError(f"unknown runtime {name!r} (known: {', '.join(RUNTIMES)})")
    return import_module(f"runtimes.{name}")
