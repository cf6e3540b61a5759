"""Tests own their state (tests/isolation.py): the run's cache is its own and nothing is written under the user's,
each test finds the runtimes registry as the run began and the shared pairs with no earlier reply to draft from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from edge.models.cache import cache_dir, write_json
from edge.models.pair import Pair
from edge.runtimes import RUNTIMES, names, register

import edge
from tests.conftest import REPO
from tests.fake_runtime import TRAITS
from tests.isolation import (
    USER_CACHE,
    changes,
    default_cache,
    forget_shared_replies,
    link_models,
    restored_registries,
    tree_state,
)


def test_the_run_has_a_cache_of_its_own_outside_the_home_folder() -> None:
    cache = cache_dir()
    for user in (Path.home(), default_cache(), Path(os.environ[USER_CACHE])):
        assert not cache.resolve().is_relative_to(user.resolve()), (cache, user)
    child = subprocess.run([sys.executable, "-c", "from edge.models.cache import cache_dir; print(cache_dir())"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(cache)  # a process a test starts writes there too


def test_the_run_reads_the_users_files_through_file_links_only() -> None:
    """A write into a linked folder would land in the user's: every link in the run's cache names a file."""
    for root, folders, files in os.walk(cache_dir()):
        for name in folders + files:
            path = Path(root, name)
            assert not path.is_symlink() or (path.is_file() and name in files), path


def test_writing_over_a_linked_model_file_leaves_the_users_file(tmp_path: Path) -> None:
    """The cache's writes rename a new file over the old name: over a link, the link goes and its target stays."""
    user, cache = tmp_path / "user", tmp_path / "cache"
    for name in ("models/a.gguf", "models/a.gguf.sha256", "prepared/a-0123abcd.vocab-8.npz", "pass-times.json"):
        (user / name).parent.mkdir(parents=True, exist_ok=True)
        (user / name).write_text(name)
    before = tree_state(user)
    link_models(user, cache)
    assert sorted(str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_symlink()) == \
        ["models/a.gguf", "models/a.gguf.sha256"]  # vocabularies and measurements are made by each run
    write_json(cache / "models" / "a.gguf.sha256", {"sha256": "0" * 64})
    assert not (cache / "models" / "a.gguf.sha256").is_symlink()
    assert tree_state(user) == before and (user / "models" / "a.gguf.sha256").read_text() == "models/a.gguf.sha256"


def test_the_tree_state_sees_a_new_file_a_new_folder_and_a_new_mtime(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    assert tree_state(folder) == {}
    folder.mkdir()
    empty = tree_state(folder)
    assert list(empty) == ["."]
    (folder / "lookup").mkdir()
    assert changes(empty, tree_state(folder)) == [".", "lookup"]
    (folder / "lookup").rmdir()
    os.utime(folder, ns=(empty["."][2], empty["."][2]))
    assert changes(empty, tree_state(folder)) == []
    (folder / "machine.json").write_text("{}")
    written = tree_state(folder)
    os.utime(folder / "machine.json", ns=(0, 10**9))
    assert changes(written, tree_state(folder)) == ["machine.json"]


@pytest.mark.parametrize("writes_home", [False, True])
def test_a_run_that_writes_in_the_users_cache_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    writes_home: bool) -> None:
    """conftest's hooks in a run of their own, under a made-up home: a test writing its own cache passes, one writing
    in ~/.cache/edge-spec fails the run with one line that says so."""
    home = tmp_path / "home"
    (home / ".cache" / "edge-spec" / "models").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "run" / "conftest.py").write_text(
        "from tests.conftest import (pytest_configure, pytest_sessionfinish, pytest_terminal_summary,  # noqa: F401\n"
        "                            pytest_unconfigure)\n")
    (tmp_path / "run" / "test_writes.py").write_text(
        "from pathlib import Path\nfrom edge.models.cache import cache_dir\n\n\ndef test_writes() -> None:\n"
        "    (cache_dir() / 'pass-times.json').write_text('{}')\n"
        + ("    (Path.home() / '.cache' / 'edge-spec' / 'pass-times.json').write_text('{}')\n" if writes_home else ""))
    for name in ("EDGE_SPEC_CACHE", USER_CACHE, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=tmp_path / "run", timeout=120)
    said = [line for line in run.stdout.splitlines() if "edge-spec cache changed during the test run" in line]
    assert (run.returncode, len(said)) == ((1, 1) if writes_home else (0, 0)), run.stdout + run.stderr
    assert "1 passed" in run.stdout
    if writes_home:
        assert said[0].startswith("the user's edge-spec cache changed during the test run: "
                                  f"{home / '.cache' / 'edge-spec'} (2 changed, first .)")


def test_a_registered_runtime_is_gone_after_the_test() -> None:
    assert names() == RUNTIMES  # whatever ran before: conftest's own_state restored the registry
    with restored_registries():
        register("fake", "tests.fake_runtime", TRAITS)
        assert "fake" in names()
    assert names() == RUNTIMES


def test_the_shared_pairs_start_each_test_with_no_earlier_reply(smollm2: Pair) -> None:
    assert smollm2.corpus is not None and smollm2.corpus.replies == []  # whatever ran before
    reply = edge.generate(smollm2, "Name three colors.", max_tokens=8).tokens
    assert smollm2.corpus.replies and smollm2.corpus.replies[-1][:len(reply)] == reply
    forget_shared_replies()
    assert smollm2.corpus.replies == [] and not smollm2._decoders
    assert edge.generate(smollm2, "Name three colors.", max_tokens=8).tokens == reply
