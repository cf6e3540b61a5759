"""What runs a model, looked up by name: each runtime is a subpackage imported only when a model of it loads, so
`edge-spec --help` and `import edge` load neither llama.cpp nor onnxruntime.

- `llama_cpp`: GGUF targets and drafters through llama-cpp-python's low-level API (a tree is one llama_decode).
- `onnx`: the drafter on ONNX Runtime (int4 weights, a 4-bit KV cache, a trimmed head), and the QuantSpec target.

Code above the runtimes names none of them: it asks `traits(name)` what a runtime can do and opens models through
the functions every runtime package has (Runtime below), with ModelOptions. Only the registry's parser reads names.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, Protocol

from edge.errors import UserError
from edge.protocols import Drafter, Target

RUNTIMES = ("llama_cpp", "onnx")  # the built-in runtimes (register adds others)
DEFAULT = "llama_cpp"  # what a model runs on unless models.toml or a flag says otherwise
DRAFTERS = ("onnx", "llama_cpp")  # a drafter named by its file alone runs on the first that can run it
TOOLS = "llama_cpp"  # the runtime whose tools read and rewrite model files: its tokenizer and quantizer


@dataclass(frozen=True)
class Traits:
    """What a runtime can do, for the code above it."""

    streams: bool  # a target can be used from its file's mapping and read from the drive every pass
    splits_layers: bool  # a target's layers can be split between a GPU and the CPU
    trims_head: bool  # a drafter's head can keep only a frequency-ranked vocabulary
    shared_cache: bool  # its target shares one KV cache with its drafter (QuantSpec): they load together
    max_tree: int | None  # the most nodes its target verifies; None: as many as it is sized for
    providers: bool  # an execution provider (models.toml's provider, --provider) picks its hardware
    derives_files: bool = False  # builds files from a model file on first use (graphs: up to twice its size)
    # its own KV cache whatever kv_type says: (a drafter's, a target's), sized as the llama.cpp type of as many bits
    own_kv: tuple[str, str] | None = None
    # GGUF files it can draft from: "*" any, else a set of general.architecture values (the graph builder's)
    architectures: frozenset[str] | str = "*"
    # a drafter's logits for every row of its batch (a buffer and the graph's output, sized by the batch); False: its
    # graph gives each expanded node's top-k, so only the rows a pass expands hold logits
    drafter_batch_logits: bool = True


TRAITS = {
    "llama_cpp": Traits(streams=True, splits_layers=True, trims_head=False, shared_cache=False, max_tree=None,
                        providers=False),
    "onnx": Traits(streams=False, splits_layers=False, trims_head=True, shared_cache=True, max_tree=256,
                   providers=True, derives_files=True, own_kv=("q4_0", "q8_0"),
                   architectures=frozenset({"llama", "qwen2", "gemma3"}), drafter_batch_logits=False),
}
PACKAGES = {name: f"edge.runtimes.{name}" for name in RUNTIMES}  # the package each runtime's functions are in


@dataclass(frozen=True)
class ModelOptions:
    """How to open one model, whatever runs it."""

    n_ctx: int = 4096
    kv_type: str = "f16"
    threads: int | None = None  # None: every core this process may use
    gpu_layers: int = 0
    mlock: bool = False
    streamed: bool = False  # a target read from the drive on every pass: its weights stay in the file's mapping
    # a target that decodes plainly, never verifying a tree: loaded as its runtime loads it by default (llama.cpp: its
    # repacked weights and kernels, chosen by batch size), which is faster for one token and not batch-invariant
    stock: bool = False
    # a stock target in RAM under a memory limit: the pages of its file's mapping its passes read (the tensors its
    # runtime does not repack) are locked after its first passes, so that the kernel's reclaim never takes them
    # (offload/pass_pages.py)
    lock_pass_pages: bool = False
    # a target whose requests decode in this many lanes of one pass (a server's --parallel; Pair.lanes): its own
    # context carries one token of one sequence, the lanes' context holds their KV caches (0: no lanes)
    lanes: int = 0
    plain: bool = False  # it verifies no tree: no drafter beside it (its lanes decode plainly)
    provider: str = "cpu"  # an onnxruntime execution provider
    derived_dir: Path | None = None  # where files derived from the model file go (graphs); None: beside it
    int4_block: int = 0  # a drafter's weights requantized into int4 blocks of this many (runtimes that derive files)
    # called with (a file about to be written, its size in bytes) first: refuses where the drive has no room
    reserve: Callable[[Path, int], None] | None = field(default=None, compare=False)


Report = Callable[[str], None]


class Runtime(Protocol):
    """The functions every runtime package has."""

    def open_target(self, path: Path, options: ModelOptions, max_tree: int) -> Target: ...
    def open_drafter(self, path: Path, options: ModelOptions, max_tree: int, head_ids: Any = None,
                     report: Report | None = None) -> Drafter: ...
    def open_shared(self, target: Path, drafter: Path, options: ModelOptions, head_ids: Any = None,
                    report: Report | None = None) -> tuple[Target, Drafter]: ...  # shared_cache runtimes
    def lossless_guarantee(self, weight_types: frozenset[str], kv_type: str, fix: str) -> str | None: ...


class SplitsLayers(Runtime, Protocol):
    """What a runtime whose traits say splits_layers has besides: the devices it can put a target's layers on (each
    with .name, .backend, .description, .kind, .free and .total bytes), and whether layers there leave trees exact."""

    def gpu_devices(self) -> tuple[Any, ...]: ...
    def gpu_guarantee(self, gpu_layers: int, backend: str) -> str | None: ...


class DerivesFiles(Runtime, Protocol):
    """What a runtime whose traits say derives_files has besides: the bytes of the largest file it has built here from
    a model file for a role ("drafter", "target"), which it loads in that file's place; 0 where none is built yet."""

    def derived_bytes(self, path: Path, role: str) -> int: ...


def register(name: str, package: str, traits: Traits) -> None:
    """A runtime besides the built-in ones (a GPU runtime, MLX, a test's): `package` has the Runtime functions. It can
    be named from now on, in models.toml and on the command line, as the built-in ones are."""
    PACKAGES[name] = package
    TRAITS[name] = traits


def names() -> tuple[str, ...]:
    """Every runtime that can be named: the built-in ones and those registered since."""
    return tuple(PACKAGES)


def check_name(name: str) -> str:
    if name not in PACKAGES:
        raise UserError(f"unknown runtime {name!r} (known: {', '.join(PACKAGES)})")
    return name


def runtime(name: str) -> Runtime:
    """The runtime package `name`, imported on first use."""
    return import_module(PACKAGES[check_name(name)])  # type: ignore[return-value]


def traits(name: str) -> Traits:
    return TRAITS[check_name(name)]


def drafts_from(name: str, architecture: str | None) -> bool:
    """Whether runtime `name` can run a drafter from a file of this architecture."""
    known = traits(name).architectures
    return known == "*" or architecture in known


def tools() -> Any:
    """The runtime whose tools read and rewrite model files (tokenizer, quantizer, GPU support)."""
    return import_module(f"edge.runtimes.{TOOLS}")


def default_threads() -> int:
    """The cores this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
