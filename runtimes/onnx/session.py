"""An onnxruntime session over one decoder graph (runtimes/onnx/graph.py), fed with numpy views."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.errors import Remedy, UserError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "directml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
}


def provider_name(provider: str) -> str:
    """'cpu', 'cuda', 'directml', 'openvino', 'qnn' (or an onnxruntime provider name) -> the installed provider."""
    import onnxruntime as ort

    name = PROVIDERS.get(provider.lower(), provider)
    available = ort.get_available_providers()
    if name not in available:
        known = ", ".join(k for k, v in PROVIDERS.items() if v in available)
        raise UserError(f"onnxruntime provider {provider!r} is not installed here (available: {known}); "
                        "install the onnxruntime build that carries it (e.g. onnxruntime-gpu for cuda)")
    return name


class DecoderSession:
    def __init__(self, path: Path, provider: str = "cpu", threads: int | None = None, mem_reuse: bool = False):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Planning buffer reuse across the graph's ~1000 nodes was about half of a drafter session's start; without
        # it the passes run as fast, give the same bits and peak at the same RSS (benchmarks/session_start.py).
        options.enable_mem_reuse = mem_reuse
        options.log_severity_level = 3
        # Workers spin within a run (no wake-up per op; docs/drafter.md has the growth times) but stop when it
        # ends, so they do not steal the cores from llama.cpp's target pass between drafter runs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        try:
            self.session = ort.InferenceSession(str(path), options, providers=[provider_name(provider)])
        except UserError:
            raise
        except Exception as e:  # onnxruntime raises its own exception types
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            if provider != "cpu":  # the provider's compiler refused the graph: the file is fine
                raise UserError(f"the {provider} execution provider could not run the drafter's graph "
                                f"({lines[-1] if lines else type(e).__name__}); set `provider` to cpu",
                                "provider") from None
            raise UserError(f"onnxruntime could not load {path} ({lines[0] if lines else type(e).__name__}); "
                            "delete it, and preparing the pair builds it again",
                            remedy=Remedy("prepare", "PAIR")) from None
        self.input_names = {i.name for i in self.session.get_inputs()}
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {k: v for k, v in feeds.items() if k in self.input_names}
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=False))
