"""edge-spec's cache: where it is, files written into it atomically (and synced), one process at a time preparing a
model, what killed runs left cleaned, a full drive in one line."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from edge.models.cache import STALE_AFTER_S, atomic_path, cache_dir, clean_stale, one_at_a_time, sha256_file

from edge.errors import UserError


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EDGE_SPEC_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "edge-spec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "edge-spec"
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_one_process_at_a_time_prepares_a_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second process asking for the model another is fetching waits for it, saying so once; a cache where no lock
    file can be made runs unlocked."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    code = ("import time\nfrom edge.models.cache import one_at_a_time\n"
            "with one_at_a_time('pypi m==1: a.gguf', print):\n    print('held', flush=True)\n"
            "    time.sleep(1.5)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        said: list[str] = []
        started = time.monotonic()
        with one_at_a_time("pypi m==1: a.gguf", said.append):
            waited = time.monotonic() - started
        assert said == ["waiting for another edge-spec process, which is preparing pypi m==1: a.gguf"] and waited > 0.5
        assert holder.wait(10) == 0
        with (one_at_a_time("pypi m==1: b.gguf", said.append),  # another model: nothing to wait for
              one_at_a_time("pypi m==1: a.gguf", said.append)):
            pass
        assert len(said) == 1
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "file" / "cache"))  # no folder can be made there
    ran = []
    with one_at_a_time("pypi m==1: a.gguf", said.append):
        ran.append(True)
    assert ran and len(said) == 1


def test_atomic_path(tmp_path: Path) -> None:
    dest = tmp_path / "sub" / "out.bin"
    with atomic_path(dest) as tmp:
        assert tmp.parent == dest.parent and tmp != dest
        tmp.write_bytes(b"ok")
        assert not dest.exists()
    assert dest.read_bytes() == b"ok"
    with pytest.raises(RuntimeError), atomic_path(dest) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError
    assert dest.read_bytes() == b"ok"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["out.bin"]


def test_sha256_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"part of a model " * 100_000)
    assert sha256_file(path) == hashlib.sha256(b"part of a model " * 100_000).hexdigest()


def test_what_killed_runs_left_is_cleaned(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)  # a process that has exited
    stale = [tmp_path / f"m.gguf.tmp-{dead}", tmp_path / f".pip-{dead}-x1y2", tmp_path / f"g.onnx.tmp-{dead}"]
    stale[0].write_bytes(b"half a file")
    (stale[1] / "w.whl").parent.mkdir()
    (stale[1] / "w.whl").write_bytes(b"w")
    (stale[2]).mkdir()
    reused = tmp_path / "old.gguf.tmp-1"  # pid 1 is alive, but this is two days old: its pid was reused
    reused.write_bytes(b"x")
    os.utime(reused, (time.time() - 2 * STALE_AFTER_S,) * 2)
    kept = [tmp_path / f"mine.gguf.tmp-{os.getpid()}", tmp_path / "live.gguf.tmp-1", tmp_path / "model.gguf",
            tmp_path / "model.gguf.tmp"]
    for path in kept:
        path.write_bytes(b"x")
    assert sorted(clean_stale(tmp_path)) == sorted([*stale, reused])
    assert sorted(tmp_path.iterdir()) == sorted(kept)


def test_a_full_drive_is_one_line_naming_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Free space is checked before a write of known size, and a drive that fills up anyway is one line too."""
    import errno
    from collections import namedtuple

    from edge.models import cache as cache_module

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(cache_module.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 10**6))
    dest = tmp_path / "big.gguf"
    with pytest.raises(UserError, match=r"big.gguf needs 2.00 GB but .* has 0.00 GB free; free some space"), \
            atomic_path(dest, 2 * 10**9):
        pass
    with pytest.raises(UserError, match=r"the drive filled up writing .*small.gguf; free some space"), \
            atomic_path(tmp_path / "small.gguf", 10) as tmp:
        tmp.write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []  # nothing half-written left
