"""An ONNX graph written op by op (onnx.helper underneath): each op returns its output's name, and initializers of
EXTERNAL_MIN bytes or more go straight to the external .data file as they come, so a graph of a model's size is
never held in memory (runtimes/onnx/graph.py builds the decoders with it)."""

from __future__ import annotations

import sys
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10  # onnxruntime 1.31 reads ir_version <= 13; the onnx package writes newer by default
OPSET = 21
EXTERNAL_MIN = 1024  # an initializer this large (sys.getsizeof of its bytes, as onnx counts) goes to the .data file


class GraphWriter:
    """Small helper over onnx.helper: every op returns its output name."""

    def __init__(self, data: BinaryIO | None = None, location: str = ""):
        """data: where initializers of EXTERNAL_MIN bytes or more are written as they come (the file `location`
        beside the graph names), so the graph never holds the model's weights; None: all kept in the proto."""
        self.data, self.location = data, location
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count = 0
        self._consts: dict[tuple, str] = {}

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, hint: str | None = None, domain: str = "", n_out: int = 1, **attrs):
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name: str, array: np.ndarray) -> str:
        array = np.asarray(array, order="C")  # keeps 0-d arrays 0-d
        if self.data is None or sys.getsizeof(b"") + array.nbytes < EXTERNAL_MIN:
            self.initializers.append(numpy_helper.from_array(array, name))
            return name
        # what onnx.save_model(save_as_external_data=True) writes, in the same order, without a copy in the proto
        tensor = TensorProto(name=name, dims=array.shape, data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                             data_location=TensorProto.EXTERNAL)
        offset = self.data.tell()
        self.data.write(memoryview(array.reshape(-1)).cast("B"))
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def const(self, value, dtype=np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(self.name("const"), array)
        return self._consts[key]

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "edge_spec_decoder", self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = IR_VERSION
        model.producer_name = "edge-spec"
        return model
