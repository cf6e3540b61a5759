"""The layout the design card draws, checked on the code's own imports: dependencies point one way, nothing imports
in a circle, the engine stays free of runtimes and file plumbing, the command line holds no model assembly."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("edge", "models", "runtimes", "quant", "offload", "cli", "serve")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top, under TYPE_CHECKING or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _project_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {imported for imported in _imports(path) if imported in modules and imported != name}
            for name, path in modules.items()}


def test_no_module_imports_in_a_circle() -> None:
    graph = _project_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for imported in sorted(graph[name]):
            if state.get(imported) == 1:
                circles.append([*path[path.index(imported):], imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    # a package's __init__ re-exporting its own modules is not a circle between concerns
    circles = [c for c in circles if not any(a.startswith(b + ".") or b.startswith(a + ".") for a, b in pairwise(c))]
    assert not circles, "\n".join(" -> ".join(circle) for circle in circles)


def test_the_engine_imports_no_runtime_and_no_file_plumbing() -> None:
    forbidden = ("huggingface_hub", "subprocess", "llama_cpp", "onnxruntime", "onnx", "runtimes", "offload", "quant",
                 "cli", "models", "rich", "typer", "serve", "fastapi", "uvicorn")
    for name, path in _modules().items():
        if not name.startswith("edge"):
            continue
        imported = _imports(path)
        if name == "edge.api":  # the library's face: edge.load hands over to models/loading.py, inside the call
            imported -= {"models.loading", "models.loading.open_pair", "models.pair", "models.pair.Pair"}
        bad = sorted(i for i in imported if i.split(".")[0] in forbidden)
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_the_command_line_holds_no_model_assembly() -> None:
    for name, path in _modules().items():
        if name.startswith(("cli", "serve")):  # the front ends: the server too goes through the library
            bad = sorted(i for i in _imports(path) if i.split(".")[0] in ("runtimes", "llama_cpp", "onnxruntime"))
            assert not bad, f"{path.relative_to(REPO)} imports {bad}: loading models is library code (models/)"


def test_import_edge_and_help_load_nothing_heavy() -> None:
    heavy = ("llama_cpp", "onnxruntime", "onnx", "huggingface_hub", "gguf", "models", "runtimes")
    code = "import sys, edge; print(__import__('json').dumps(sorted(m for m in sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    assert not [m for m in loaded if m.split(".")[0] in heavy]
    code = ("import sys\nfrom cli.main import main\nsys.argv = ['edge-spec', '--help']\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint(__import__('json').dumps(sorted(sys.modules)), file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(run.stderr.strip().splitlines()[-1]))
    assert not [m for m in loaded if m.split(".")[0] in ("llama_cpp", "onnxruntime", "onnx", "huggingface_hub",
                                                         "fastapi", "uvicorn", "sse_starlette")]
