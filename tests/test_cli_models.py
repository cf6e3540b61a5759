"""The command line on models and the cache: a pair by name, a GGUF file, a Hugging Face reference, `models`, `pull`,
`check`, `rm`, and a read-only cache, on the real small pair (smollm2-135m)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from edge.models.pair import Pair
from edge.models.registry import load_registry

from tests.cli_helpers import assert_one_line_error, run

SMALL = "smollm2-135m"  # the pair each command names


def test_models_json(smollm2: Pair, gemma3: Pair) -> None:
    out = json.loads(run("models", "--json").stdout)
    assert out["qwen2.5-coder-1.5b"]["default"] is True and out["smollm2-135m"]["default"] is False
    for name in ("smollm2-135m", "gemma3-270m"):
        for role in ("target", "drafter"):
            assert out[name][role]["present"] is True and Path(out[name][role]["path"]).exists()
    assert out["llama3.1-70b"]["target"]["source"].startswith("hf ")


@pytest.fixture
def read_only_cache(smollm2: Pair, tmp_path: Path):
    """A cache holding smollm2-135m's prepared files and nothing else, mounted read-only (a shared or read-only
    mount): hard links to the run's files (its links to the user's, copied as links: a hard link through one would
    touch the user's file) in a folder bound read-only over itself. Skipped where this process cannot mount."""
    import shutil
    import subprocess

    from edge.models.cache import cache_dir

    import edge

    with edge.load(SMALL, budget=4, gpu_layers=0):  # its drafter's graph is built and cached
        pass
    folder = tmp_path / "cache"
    for sub in ("models", "prepared"):
        source = cache_dir() / sub
        if source.is_dir():
            shutil.copytree(source, folder / sub, symlinks=True, copy_function=os.link)
    mount = ["mount", "--bind", str(folder), str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("needs root and mount(8) to bind a folder read-only")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount the bound folder read-only here")
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)


def test_a_read_only_cache_serves_what_is_prepared(read_only_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """machine.json and pass-times.json cannot be written: the plan and --budget auto measure, and the reply comes."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(read_only_cache))
    with pytest.raises(OSError):
        (read_only_cache / "probe").write_text("x")
    result = run("generate", "Name three colors.", "--pair", SMALL, "-n", "8", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["new_tokens"] == 8
    assert not (read_only_cache / "pass-times.json").exists() and not (read_only_cache / "machine.json").exists()


def greedy_text(model: str, *args: str) -> str:
    result = run("generate", "Name three colors.", "-m", model, "-n", "12", "--temperature", "0", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["text"]


def test_a_model_named_by_its_file(files: dict[str, Path]) -> None:
    """`chat PATH.gguf` and `generate -m PATH.gguf` on a copy of the SmolLM2 file, drafting for itself on ONNX
    Runtime; the graph goes to edge-spec's cache, not beside the user's file."""
    import shutil
    import tempfile

    folder = Path(tempfile.gettempdir()) / "edge-spec-test-model"  # a stable copy: its graph is built once
    copy = folder / "my-model.gguf"
    if not copy.exists():
        folder.mkdir(exist_ok=True)
        shutil.copyfile(files["smol"], copy)
    plain = greedy_text(SMALL)
    assert greedy_text(str(copy), "--budget", "8") == plain
    chat = run("chat", str(copy), "--temperature", "0", "-n", "12", input="Name three colors.\n")
    assert chat.exit_code == 0, chat.output
    assert chat.stdout.strip() == plain.strip()
    assert not list(folder.glob("*.onnx*"))
    assert "my-model.gguf" in run("plan", str(copy)).stdout


def test_a_gguf_alone_drafts_by_lookup_in_chat_generate_and_serve(files: dict[str, Path]) -> None:
    """`--drafter lookup`: a model file with no drafter model, lookup drafting alone, in chat, generate and serve; the
    greedy text is the target's. A second chat turn that asks again runs rounds by lookup."""
    from benchmarks.serve_process import ServerProcess

    model = str(files["smol"])
    plain = greedy_text(SMALL)
    assert greedy_text(model, "--drafter", "lookup", "--budget", "8") == plain
    chat = run("chat", model, "--drafter", "lookup", "--budget", "8", "--temperature", "0", "-n", "24",
               input="Name three colors.\nSay that again, word for word.\n")
    assert chat.exit_code == 0, chat.output
    assert plain.strip() in chat.stdout
    lookups = re.findall(r"(\d+) by lookup", chat.stderr)
    assert lookups and int(lookups[-1]) > 0, chat.stderr
    with ServerProcess([model, "--drafter", "lookup", "--ctx", "1024"]) as server:
        import urllib.request

        body = json.dumps({"model": files["smol"].name, "messages": [{"role": "user", "content": "Name three colors."}],
                           "max_tokens": 12, "temperature": 0}).encode()
        request = urllib.request.Request(server.url + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.loads(response.read())
    assert answer["choices"][0]["message"]["content"].strip() == plain.strip()
    off = run("generate", "hi", "-m", model, "--drafter", "lookup", "--lookup", "off")
    assert_one_line_error(off, "drafter lookup drafts by lookup alone")


def test_a_hugging_face_reference_from_the_cache(files: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """user/repo:QUANT and hf.co/user/repo:QUANT resolve from a Hugging Face cache laid out as huggingface_hub
    lays it out, offline."""
    repo = tmp_path / "hub" / "models--someone--SmolLM2-135M-Instruct-GGUF"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "SmolLM2-135M-Instruct-Q4_1.gguf").symlink_to(files["smol"])
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    plain = greedy_text(SMALL)
    for reference in ("someone/SmolLM2-135M-Instruct-GGUF:Q4_1", "hf.co/someone/SmolLM2-135M-Instruct-GGUF:Q4_1"):
        assert greedy_text(reference) == plain
    assert not list(snapshot.glob("*.onnx*"))
    missing = run("generate", "hi", "-m", "someone/SmolLM2-135M-Instruct-GGUF:Q8_0")
    assert missing.exit_code == 1 and "no .gguf file with 'Q8_0'" in missing.output


def test_models_fit_80_columns_with_sizes(smollm2: Pair, gemma3: Pair) -> None:
    listing = run("models").stdout  # not a terminal: 80 columns
    assert max(len(line.rstrip()) for line in listing.splitlines()) <= 80
    joined = "".join(listing.split())  # long names wrap, they are not cut
    assert "hf.co/bartowski/Meta-Llama-3.1-70B-Instruct-GGUF:Q4_0" in joined and "0.10GB" in joined
    out = json.loads(run("models", "--json").stdout)
    assert out["smollm2-135m"]["target"]["size_bytes"] > 50e6
    assert out["llama3.1-70b"]["target"]["size_gb"] > 30 and out["llama3.1-70b"]["target"]["size_bytes"] is None


def test_rm_removes_a_models_cached_files_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(cache))
    models_file = tmp_path / "models.toml"
    models_file.write_text('[pairs.fake]\nabout = "x"\ntarget.pypi = ["fake-model==1.0"]\n'
                           'target.files = ["fake_model/fake.gguf"]\ntarget.quantize = "q8_0"\n'
                           'drafter.from = "target"\n'
                           '[pairs.other]\nabout = "y"\ntarget.pypi = ["other-model==1.0"]\n'
                           'target.files = ["other_model/other.gguf"]\ndrafter.from = "target"\n')
    from edge.models.sources import prepared_path

    spec = load_registry(models_file).pair("fake")
    (cache / "models").mkdir(parents=True)
    (cache / "prepared").mkdir()
    ours = [cache / "models" / "fake.gguf", cache / "models" / "fake.gguf.sha256",
            cache / "models" / "fake.int4-full-kv4.v6.onnx", prepared_path(spec.target)]
    theirs = [cache / "models" / "other.gguf", cache / "models" / "fakeish.gguf"]
    for path in ours + theirs:
        path.write_bytes(b"x" * 1000)
    result = run("--models", str(models_file), "rm", "fake")
    assert result.exit_code == 0, result.output
    assert not any(path.exists() for path in ours) and all(path.exists() for path in theirs)
    assert "4 files removed" in result.stdout
    assert "nothing of it" in run("--models", str(models_file), "rm", "fake").stdout


def test_rm_of_a_users_file_removes_its_graphs_not_another_files(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's foo.gguf: its graphs (foo-KEY.VARIANT.onnx) go, foo-bar.gguf's (foo-bar-KEY...) stay, and the file
    itself is kept."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(cache))
    graphs = cache / "prepared" / "graphs"
    graphs.mkdir(parents=True)
    from tests.ggufs import write_gguf

    model = write_gguf(tmp_path / "foo.gguf")
    ours = [graphs / "foo-0123456789ab.int4-full-kv4.v7.onnx", graphs / "foo-0123456789ab.int4-full-kv4.v7.onnx.data"]
    theirs = [graphs / "foo-bar-0123456789ab.int4-full-kv4.v7.onnx", graphs / "foo-bar-ba9876543210.int8-full.onnx"]
    for path in ours + theirs:
        path.write_bytes(b"x" * 100)
    result = run("rm", str(model))
    assert result.exit_code == 0, result.output
    assert not any(path.exists() for path in ours) and all(path.exists() for path in theirs) and model.exists()
    assert "2 files removed" in result.stdout


def test_pull_and_check_take_a_model(smollm2: Pair) -> None:
    """`pull MODEL` prints the cached files; `check MODEL` measures the model's target under tree batching and in
    lanes of one pass (the shipped Q4_1 target is bit-exact here, tests/test_lossless.py's premise)."""
    pulled = run("pull", "smollm2-135m")
    assert pulled.exit_code == 0 and "target: " in pulled.stdout and "drafter: " in pulled.stdout
    checked = run("check", "smollm2-135m", "--json")
    assert checked.exit_code == 0, checked.output
    result = json.loads(checked.stdout)
    assert result["bit_exact"] is True and result["shapes"]
    lanes = next(shape for shape in result["shapes"] if shape["shape"] == "4 lanes in one pass")
    assert lanes["nodes_checked"] == 64 and lanes["max_abs_diff"] == 0.0  # serve --parallel's passes too
    trees = next(shape for shape in result["shapes"] if shape["shape"] == "trees of 3 lanes in one pass")
    assert trees["nodes_checked"] >= 60 and trees["max_abs_diff"] == 0.0 and trees["argmax_differences"] == 0
