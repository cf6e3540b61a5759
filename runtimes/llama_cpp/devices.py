"""The devices the installed llama.cpp build can run layers on, as its backends report them (ggml's device
registry): the CPU always, and a GPU per device of each GPU backend it was built with (CUDA, HIP, Metal, Vulkan,
SYCL). nvidia-smi sees NVIDIA cards only, and only whether one is there; llama.cpp says whether it can use it."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as ll

# enum ggml_backend_dev_type (ggml-backend.h)
KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: "CPU", "CUDA0", "Vulkan0", "Metal", ...
    description: str  # the device's own: "NVIDIA GeForce RTX 4090", "llvmpipe (LLVM 15.0.6, 256 bits)", ...
    kind: str  # "cpu", "gpu" (its own memory), "igpu" (the host's memory), "accel" (with the CPU: AMX, BLAS)
    free: int  # bytes of its memory free now
    total: int

    @property
    def backend(self) -> str:
        """The backend's name: the device's without its number ("CUDA0" -> "CUDA")."""
        return self.name.rstrip("0123456789") or self.name

    @property
    def offloads(self) -> bool:
        """Whether llama.cpp places layers on it (n_gpu_layers): a GPU, integrated or not."""
        return self.kind in ("gpu", "igpu")

    def describe(self) -> str:
        memory = f", {self.free / 2**30:.1f} of {self.total / 2**30:.1f} GiB free" if self.total else ""
        return f"{self.name} ({self.description}{memory})"


@functools.cache
def _calls() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """ggml's device calls, from llama-cpp-python's own libraries (its bindings leave them out): the registry in
    libggml, the device's getters in libggml-base."""
    folder = Path(ll.__file__).parent / "lib"
    registry, base = ctypes.CDLL(str(folder / "libggml.so")), ctypes.CDLL(str(folder / "libggml-base.so"))
    registry.ggml_backend_dev_count.restype = ctypes.c_size_t
    registry.ggml_backend_dev_get.restype = ctypes.c_void_p
    registry.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(base, name).restype = ctypes.c_char_p
        getattr(base, name).argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                             ctypes.POINTER(ctypes.c_size_t)]
    return registry, base


@functools.cache
def devices() -> tuple[Device, ...]:
    """Every device of every backend this build registered, in ggml's order (GPUs first)."""
    ll.llama_backend_init()
    registry, base = _calls()
    found = []
    for i in range(registry.ggml_backend_dev_count()):
        dev = registry.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(Device(name=base.ggml_backend_dev_name(dev).decode(errors="replace"),
                            description=(base.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                            kind=KINDS.get(base.ggml_backend_dev_type(dev), "other"),
                            free=int(free.value), total=int(total.value)))
    return tuple(found)


def gpu_devices() -> tuple[Device, ...]:
    """The devices llama.cpp can put layers on."""
    return tuple(device for device in devices() if device.offloads)


def backend_line() -> str:
    """What llama.cpp runs layers on here, in one line: "Vulkan0 (llvmpipe ..., 1.9 of 23.5 GiB free), CPU"."""
    return ", ".join(device.describe() if device.offloads else device.name for device in devices()
                     if device.kind != "accel")
