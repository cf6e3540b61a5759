"""The layout the design card draws, checked on the code's own imports: dependencies point one way, nothing imports
in a circle, the engine stays free of runtimes and file plumbing, the command line holds no model assembly."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("edge", "models", "runtimes", "quant", "offload", "cli", "serve")
SUBPACKAGES = PACKAGES[1:]  # shipped inside edge (edge.models, ...): each is a folder of the repository, a concern here


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _concern(name: str) -> str:
    """A module's name as the repository's folders give it: edge.models.pair -> models.pair."""
    parts = name.split(".")
    return ".".join(parts[1:]) if len(parts) > 1 and parts[0] == "edge" and parts[1] in SUBPACKAGES else name


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top, under TYPE_CHECKING or inside a function (by concern: _concern)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {_concern(name) for name in names}


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
    code = ("import sys\nfrom edge.cli.main import main\nsys.argv = ['edge-spec', '--help']\ntry:\n    main()\n"
            "except SystemExit:\n    pass\nprint(__import__('json').dumps(sorted(sys.modules)), file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(run.stderr.strip().splitlines()[-1]))
    assert not [m for m in loaded if m.split(".")[0] in ("llama_cpp", "onnxruntime", "onnx", "huggingface_hub",
                                                         "fastapi", "uvicorn", "sse_starlette")]


def _code(path: Path) -> list[ast.AST]:
    """Every node of a module but its docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree) if id(node) not in docstrings]


def test_the_library_asks_models_nothing_outside_the_protocols() -> None:
    """What the library calls on a model is in edge/protocols.py: no probing with hasattr or getattr(x, "name", None),
    and no __getattr__ passing everything through, in the engine, models/ or offload/."""
    found = []
    for name, path in _modules().items():
        if name.split(".")[0] not in ("edge", "models", "offload"):
            continue
        for node in _code(path):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
                    node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3
                                                  and isinstance(node.args[2], ast.Constant)
                                                  and node.args[2].value is None)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}")
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                found.append(f"{path.relative_to(REPO)}:{node.lineno} __getattr__")
    assert not found, found


def test_no_runtime_is_named_outside_the_runtimes() -> None:
    """Code above runtimes/ asks a runtime's traits; only the runtimes and the registry's parser spell their names."""
    from edge.runtimes import RUNTIMES

    found = []
    for name, path in _modules().items():
        if name.startswith("runtimes") or name == "models.registry":
            continue
        for node in _code(path):
            if isinstance(node, ast.Constant) and node.value in RUNTIMES:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_a_runtime_made_from_the_protocols_alone_runs_in_the_engine_the_bench_and_the_server(tmp_path: Path) -> None:
    """tests/fake_runtime.py knows edge/protocols.py and runtimes' Traits and Runtime functions, nothing else: once
    registered, a models.toml pair of its models loads, decodes speculatively (the same text as plain decoding),
    runs in `bench` and answers the server's chat completions."""
    from edge.models.bench import run_bench
    from edge.runtimes import register
    from edge.serve.app import create_app
    from edge.serve.worker import Worker
    from fastapi.testclient import TestClient

    import edge
    from edge.sampling import SamplingConfig
    from tests.fake_runtime import TRAITS
    from tests.ggufs import write_gguf

    register("fake", "tests.fake_runtime", TRAITS)  # until the test ends (conftest.own_state)
    model = write_gguf(tmp_path / "fake.gguf", shape=True)
    models = tmp_path / "models.toml"
    models.write_text(f'[pairs.fake]\nabout = "numpy models"\nctx = 512\nbudget = 16\ntarget.path = "{model}"\n'
                      'target.runtime = "fake"\ndrafter.from = "target"\ndrafter.runtime = "fake"\n')
    with edge.load("fake", models_file=models) as pair:
        assert (pair.target.runtime, pair.drafter.runtime, pair.lossless_warning) == ("fake", "fake", None)
        tree = edge.generate(pair, "Hello there", max_tokens=24)
        plain = edge.generate(pair, "Hello there", max_tokens=24, speculate=False)
        assert tree.tokens == plain.tokens and tree.stats.target_passes < plain.stats.target_passes
        bench = run_bench(pair, ["Hello there", "Say more"], [16], 12, SamplingConfig())
        assert [row["matches_plain"] for row in bench["rows"]] == [True, True]
        worker = Worker(pair)
        try:
            client = TestClient(create_app(pair, worker))
            reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello there"}],
                                                              "max_tokens": 24, "temperature": 0})
        finally:
            worker.close()
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == tree.text


def test_an_app_with_its_own_models_and_serve_modules_loads_a_pair(tmp_path: Path, smollm2: object) -> None:
    """edge-spec's code imports itself under one name, edge: an application whose folder holds its own models.py and
    serve.py (every Django or FastAPI project has one) loads and runs a pair, its modules untouched."""
    import os

    for own in ("models", "serve", "cli"):
        (tmp_path / f"{own}.py").write_text(f"raise ImportError('the application\\'s own {own}.py was imported')\n")
    code = ("import edge\nwith edge.load('smollm2-135m', threads=1, gpu_layers=0) as pair:\n"
            "    print(len(edge.generate(pair, 'Hi', max_tokens=4).tokens))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's edge, as an installed one would be found
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "4", run.stderr


def test_the_wheel_installs_one_top_level_package_and_no_benchmark_tooling(tmp_path: Path) -> None:
    """`pip install .` installs what the wheel holds: edge alone at the top (models, runtimes, ... inside it), the
    prompt files bench reads, and none of the benchmark scripts or the test tooling."""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist()
    assert {name.split("/")[0] for name in names} == {"edge", "edge_spec-0.1.0.dist-info"}
    assert {package for package in SUBPACKAGES if any(name.startswith(f"edge/{package}/") for name in names)} \
        == set(SUBPACKAGES)
    assert "edge/models/models.toml" in names and "edge/models/benchmarks/chat-prompts.txt" in names
    assert not [name for name in names if name.endswith(("memcap.py", "serve_process.py", "_bench.py"))]


LIBRARY = ("edge", "models", "runtimes", "quant", "offload")  # below the front ends (cli/, serve/)
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")
COMMANDS = ("chat", "generate", "serve", "bench", "plan", "prepare", "pull", "check", "models", "rm", "list")
COMMAND = re.compile(r"edge-spec (?:" + "|".join(COMMANDS) + r")\b")  # a command to run


def _raised_texts(path: Path) -> list[tuple[int, str]]:
    """The string pieces of every exception raised or built in `path` (f-strings' literal parts included)."""
    texts = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Raise) and node.exc is not None and not isinstance(node.exc, ast.Call):
            call = node.exc  # raise error (a name): its text was built elsewhere
        elif isinstance(node, ast.Call) and _is_error(node.func):
            call = node
        else:
            continue
        pieces = {id(part) for sub in ast.walk(call) if isinstance(sub, ast.JoinedStr) for part in sub.values}
        texts += [(sub.lineno, _text(sub)) for sub in ast.walk(call) if isinstance(sub, ast.JoinedStr)
                  or (isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in pieces)]
    return texts


def _text(node: ast.expr) -> str:
    """A string constant, or an f-string with each value as X."""
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "X" for part in node.values)
    return node.value


def _is_error(func: ast.expr) -> bool:
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name.endswith(("Error", "Fault", "Full", "Refused"))


def test_the_library_words_its_errors_by_option_not_by_flag() -> None:
    """A library error names the option (`temperature`) and the task that fixes it (prepare the pair), and each front
    end words them its way (`UserError.option`, `UserError.remedy`: the command line says --temperature and
    `edge-spec prepare PAIR`, the server "temperature"): no message below cli/ and serve/ names a flag or a command."""
    found = [f"{path.relative_to(REPO)}:{line}: {text!r}" for package in LIBRARY for path in (REPO / package).rglob(
        "*.py") for line, text in _raised_texts(path) if FLAG.search(text) or COMMAND.search(text)]
    assert not found, "\n".join(found)


def test_a_broken_twin_is_caught_and_options_are_worded_as_words() -> None:
    """The scan above finds a flag in a raised message (its broken twin), and the command line words an option
    where it stands as a word of its own, not inside a path or a longer name."""
    from edge.cli.render import flag, worded

    from edge.errors import Remedy, UserError

    twin = ('def f(x):\n    raise UserError(f"--temperature must be >= 0 (got {x})")\n'
            'def g(x):\n    raise UserError(f"no vocabulary; run `edge-spec prepare {x} --vocab 3`")\n')
    hits = [text for _, text in _raised_texts_of(twin) if FLAG.search(text) or COMMAND.search(text)]
    assert hits == ["--temperature must be >= 0 (got X)", "no vocabulary; run `edge-spec prepare X --vocab 3`"]
    problem = UserError("no 3-token vocabulary yet; prepare it first", remedy=Remedy("prepare", "p", (("vocab", 3),)))
    assert worded(problem) == "no 3-token vocabulary yet; prepare it first: `edge-spec prepare p --vocab 3`"
    problem = UserError("/tmp/models_file/x is a directory; give `models_file` a models.toml", "models_file")
    assert problem.worded(flag) == "/tmp/models_file/x is a directory; give --models a models.toml"
    problem = UserError("the openvino execution provider failed; set `provider` to cpu", "provider")
    assert problem.worded(flag).endswith("set --provider to cpu") and "execution provider" in problem.worded(flag)
    assert UserError("top_k must be >= 0 (got -1)", "top_k").worded(flag) == "--top-k must be >= 0 (got -1)"


def _raised_texts_of(source: str) -> list[tuple[int, str]]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as handle:
        handle.write(source)
    try:
        return _raised_texts(Path(handle.name))
    finally:
        Path(handle.name).unlink()


def test_no_engine_function_takes_more_than_eight_parameters() -> None:
    """A function of the engine (edge/) takes at most 8 parameters (self and cls not counted, *args and **kwargs
    counted once): more travel together as one object (a RoundPlan, a Reply, LoadOptions, GenerateOptions)."""
    wide = []
    for path in (REPO / "edge").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                names = [*args.posonlyargs, *args.args, *args.kwonlyargs]
                count = len(names) + bool(args.vararg) + bool(args.kwarg)
                count -= bool(names) and names[0].arg in ("self", "cls")
                if count > 8:
                    wide.append(f"{path.name}:{node.lineno} {node.name} ({count})")
    assert not wide, wide
