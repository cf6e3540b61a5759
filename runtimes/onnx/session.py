"""A session over one decoder graph (runtimes/onnx/graph.py), fed with numpy views: onnxruntime's, or OpenVINO's
own runtime reading the same file (Intel CPUs, GPUs and NPUs) where the installed onnxruntime has no OpenVINO
provider."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge.errors import Remedy, UserError

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "directml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "openvino-gpu": "OpenVINOExecutionProvider",
    "openvino-npu": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
}
# the OpenVINO device of each openvino provider: "openvino" is the CPU's plugin, as "cpu" is onnxruntime's
OPENVINO_DEVICES = {"openvino": "CPU", "openvino-gpu": "GPU", "openvino-npu": "NPU"}


def open_session(path: Path, provider: str = "cpu", threads: int | None = None, mem_reuse: bool = False):
    """The session that runs `path` on `provider`: onnxruntime's execution provider where the installed onnxruntime
    carries it, else, for the openvino providers, OpenVINO's runtime (the `openvino` package) on the same file."""
    if provider.lower() in OPENVINO_DEVICES and not _ort_has(PROVIDERS[provider.lower()]) and _has_openvino():
        return OpenVinoSession(path, OPENVINO_DEVICES[provider.lower()], threads)
    return DecoderSession(path, provider, threads, mem_reuse)


def _ort_has(name: str) -> bool:
    import onnxruntime as ort

    return name in ort.get_available_providers()


def _has_openvino() -> bool:
    from importlib.util import find_spec

    return find_spec("openvino") is not None


def provider_name(provider: str) -> str:
    """'cpu', 'cuda', 'directml', 'openvino', 'qnn' (or an onnxruntime provider name) -> the installed provider."""
    import onnxruntime as ort

    name = PROVIDERS.get(provider.lower(), provider)
    available = ort.get_available_providers()
    if name not in available:
        known = ", ".join(k for k, v in PROVIDERS.items() if v in available)
        fix = ("install OpenVINO's runtime (pip install openvino)" if provider.lower() in OPENVINO_DEVICES else
               "install the onnxruntime build that carries it (e.g. onnxruntime-gpu for cuda)")
        raise UserError(f"onnxruntime provider {provider!r} is not installed here (available: {known}); {fix}",
                        "provider")
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
            name = provider_name(provider)
            device = OPENVINO_DEVICES.get(provider.lower())
            self.session = ort.InferenceSession(str(path), options, providers=[
                (name, {"device_type": device}) if device else name])
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


class OpenVinoSession:  # the same interface as DecoderSession
    """The same graph on OpenVINO's runtime: its ONNX reader takes the Microsoft domain's MatMulNBits and
    GroupQueryAttention, and its plugins (CPU, GPU, NPU) compile the graph once, with the shapes left dynamic."""

    def __init__(self, path: Path, device: str = "CPU", threads: int | None = None):
        import openvino as ov

        core = ov.Core()
        if device not in core.available_devices:
            raise UserError(f"OpenVINO has no {device} device here (it has {', '.join(core.available_devices)}); "
                            "choose the openvino provider of one of those, or cpu", "provider")
        config = {}
        if device == "CPU":
            # float32 arithmetic, as onnxruntime's CPU provider runs the graph: on CPUs with AMX or AVX512-BF16 the
            # plugin would otherwise run bfloat16, whose drafts agree less often with the target
            config["INFERENCE_PRECISION_HINT"] = "f32"
            if threads:
                config["INFERENCE_NUM_THREADS"] = threads
        try:
            # the file's real folder: OpenVINO refuses weights (.data) outside the folder it reads the graph from,
            # which a link into another cache would be
            self.compiled = core.compile_model(core.read_model(str(Path(path).resolve())), device, config)
        except Exception as e:  # OpenVINO raises its own RuntimeError with the plugin's lines
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            raise UserError(f"OpenVINO's {device} plugin could not compile the drafter's graph "
                            f"({lines[-1] if lines else type(e).__name__}); set `provider` to cpu",
                            "provider") from None
        self.request = self.compiled.create_infer_request()
        # a port may carry several names (an output that is also an inner node's): keep the graph's own
        import onnx

        graph = onnx.load(str(path), load_external_data=False).graph
        declared = {value.name for value in [*graph.input, *graph.output]}
        self.input_names = {port.get_any_name() for port in self.compiled.inputs}
        self.output_names = [next(iter(port.get_names() & declared)) for port in self.compiled.outputs]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {k: v for k, v in feeds.items() if k in self.input_names}
        results = self.request.infer(feeds)
        # the request's output tensors are reused by the next run: hand back copies, as onnxruntime does
        return {name: np.array(results[port]) for name, port in zip(self.output_names, self.compiled.outputs,
                                                                    strict=True)}


Session = DecoderSession | OpenVinoSession
