"""ggml's own calls that llama-cpp-python's bindings leave out, from its own ggml libraries: a threadpool kept for a
context's passes, and an eval callback that says as each layer of a pass is computed; and a Ctrl-C that lands inside
a callback of a native call, kept for when the call returns."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import llama_cpp.llama_cpp as ll

GGML_MAX_N_THREADS = 512  # ggml.h: the length of a threadpool's CPU mask


class _ThreadpoolParams(ctypes.Structure):
    _fields_ = [("cpumask", ctypes.c_bool * GGML_MAX_N_THREADS), ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int), ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


@functools.cache
def _threadpool_calls() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml's threadpool calls, from llama-cpp-python's own ggml libraries (its bindings leave them out)."""
    folder = Path(ll.__file__).parent / "lib"
    base, cpu = ctypes.CDLL(str(folder / "libggml-base.so")), ctypes.CDLL(str(folder / "libggml-cpu.so"))
    base.ggml_threadpool_params_default.restype = _ThreadpoolParams
    base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
    cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
    ll._lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    ll._lib.llama_attach_threadpool.restype = None
    return base, cpu


class Threadpool:
    """A CPU threadpool kept for a context's passes, as llama.cpp's own programs attach one (common_threadpools,
    polling at ggml's default level): without one, ggml starts its worker threads anew for every pass."""

    def __init__(self, n_threads: int):
        base, self._cpu = _threadpool_calls()
        params = base.ggml_threadpool_params_default(n_threads)
        self.ptr = self._cpu.ggml_threadpool_new(ctypes.byref(params))
        if not self.ptr:
            raise RuntimeError(f"ggml could not start a threadpool of {n_threads} threads")

    def attach(self, ctx: ll.llama_context_p) -> None:
        ll._lib.llama_attach_threadpool(ctx, self.ptr, self.ptr)

    def close(self) -> None:
        if self.ptr:
            self._cpu.ggml_threadpool_free(self.ptr)
            self.ptr = None


# Python runs a Ctrl-C's handler in the main thread at the next bytecode it runs there. During a long native call (a
# model's load, a context's, a pass) that is inside a callback the call makes (llama.cpp's log, a pass's layer
# callback), and ctypes prints an exception a callback raises and drops it (sys.unraisablehook): the Ctrl-C was lost,
# and `edge-spec generate` read a 15,000-word prompt to its end after one. It is kept here instead, and raised in the
# main thread once the native call returns (raise_dropped_interrupt).
_DROPPED_INTERRUPT = threading.Event()


def keep_dropped_interrupts() -> None:
    """Have a KeyboardInterrupt that a ctypes callback raised kept for raise_dropped_interrupt (once a process)."""
    previous = sys.unraisablehook
    if getattr(previous, "keeps_interrupts", False):
        return

    def unraisable(info: Any) -> None:
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            _DROPPED_INTERRUPT.set()
        else:
            previous(info)

    unraisable.keeps_interrupts = True  # type: ignore[attr-defined]
    sys.unraisablehook = unraisable


def raise_dropped_interrupt() -> None:
    """After a native call that makes callbacks: raise the Ctrl-C one of them dropped (in the main thread, where
    Python raises a Ctrl-C; another thread's calls leave it to the main thread's)."""
    if _DROPPED_INTERRUPT.is_set() and threading.current_thread() is threading.main_thread():
        _DROPPED_INTERRUPT.clear()
        raise KeyboardInterrupt


LAYER_OUTPUT = b"l_out-"  # llama.cpp's name for a layer's output tensor ("l_out-12"): the layer is computed


@functools.cache
def _tensor_name() -> Callable[[int], bytes]:
    """ggml_get_name from llama-cpp-python's own ggml library (the one its llama library runs on), called with the GIL
    held (PyDLL): it only returns a pointer, and the eval callback asks it for every node of a pass, each call from
    ggml's thread; a CDLL call lets go of the GIL and must take it back, behind whatever Python thread took it
    meanwhile (the server's, the read-ahead's)."""
    lib = ctypes.PyDLL(str(Path(ll.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    return lib.ggml_get_name


def layer_callback(on_layer: Callable[[int], None], active: Callable[[], bool]) -> Any:
    """A ggml eval callback that calls on_layer(i) as each layer's output is computed during a pass where active()
    says so, and leaves the rest of the graph alone: ggml computes the nodes between two layer outputs in one go (one
    synchronization a layer; a pass that is not followed has none: streamed from the drive, 28 of them made a
    one-token pass of Qwen2.5-Coder-1.5B 4-9% slower). A streamed target's read-ahead follows the pass with it
    (offload/window.py)."""
    name = _tensor_name()

    def callback(tensor: int, ask: bool, user_data: int) -> bool:
        if not ask:
            label = name(tensor)
            on_layer(int(label[len(LAYER_OUTPUT):]))
            return True  # go on computing
        # observe this node (compute up to it, then call back) only where a pass is followed
        return active() and name(tensor).startswith(LAYER_OUTPUT)

    return ll.ggml_backend_sched_eval_callback(callback)


class LayerHook(Protocol):
    """What a context with layer progress calls: hook(i) as layer i is computed, in passes where hook.active()."""

    def __call__(self, layer: int) -> None: ...
    def active(self) -> bool: ...
