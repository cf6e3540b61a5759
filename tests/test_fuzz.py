"""Property-based fuzzing of the files a stranger may have written that edge-spec reads: GGUF headers, models.toml
pairs files, the cache's pass times, machine facts, rule yields and lookup files, `--prompts` files and MODEL
references. Every input must end as a parsed value or one clear refusal (UserError), never another exception; what a
client sends the server and the chat templates a model carries are tests/test_fuzz_server.py's. Bounds:
tests/fuzzing.py.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
from edge.models.registry import Registry, load_registry
from edge.runtimes.gguf_file import GGUFInfo, check_gguf, gguf_header, gguf_shape
from hypothesis import given
from hypothesis import strategies as st

from edge.errors import UserError
from tests.fuzzing import FUZZ, JSON_VALUES, OUTCOMES, print_outcomes  # noqa: F401
from tests.ggufs import write_gguf

pytestmark = pytest.mark.usefixtures("print_outcomes")


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def _read(path: Path) -> str:
    """check_gguf, then everything start-up reads of the header; the outcome's kind."""
    try:
        info = check_gguf(path)
        gguf_header(path)
    except UserError:
        return "refused"
    assert isinstance(info, GGUFInfo)
    with suppress(UserError):  # the plan's read: this tiny file lacks a real model's keys, so mostly one clear line
        gguf_shape(path)
    return "read"


@FUZZ
@given(data=st.data())
def test_mutated_gguf_headers_are_read_or_refused(valid_gguf: bytes, tmp_path: Path, data: st.DataObject) -> None:
    blob = bytearray(valid_gguf)
    header = min(len(blob), 4096)  # the header and the first tensors: where the counts, lengths and offsets are
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, header - 1))
        blob[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    path = tmp_path / f"m{data.draw(st.integers(0, 10**9))}.gguf"
    path.write_bytes(bytes(blob))
    OUTCOMES[f"gguf {_read(path)}"] += 1


@FUZZ
@given(tail=st.binary(max_size=512))
def test_random_bytes_after_the_magic_are_refused(tail: bytes, tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(b"GGUF" + tail)
    OUTCOMES[f"gguf random {_read(path)}"] += 1


SHIPPED = (Path(__file__).resolve().parent.parent / "models.toml").read_text(encoding="utf-8")


@FUZZ
@given(data=st.data())
def test_mutated_models_toml_is_parsed_or_refused(tmp_path: Path, data: st.DataObject) -> None:
    text = list(SHIPPED)
    for _ in range(data.draw(st.integers(1, 6))):
        at = data.draw(st.integers(0, len(text) - 1))
        action = data.draw(st.sampled_from(["replace", "delete", "insert"]))
        char = data.draw(st.sampled_from(list('"=[].,#\n \\0123456789abcxyz-_:/\'{}')))
        if action == "delete":
            del text[at]
        elif action == "insert":
            text.insert(at, char)
        else:
            text[at] = char
    OUTCOMES[f"models.toml {_load(tmp_path, ''.join(text))}"] += 1


# Values of every kind TOML has, for every key a pair and a model may carry.
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=True) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["a", "b", "path"]), inner, max_size=3),
    max_leaves=8)
MODEL_KEYS = ["path", "hf", "pypi", "files", "sha256", "name", "quantize", "kv_type", "from", "runtime", "vocab",
              "provider", "size_gb", "layers", "embd", "kv_heads", "head_dim", "params_b", "nonsense"]
PAIR_KEYS = ["about", "ctx", "budget", "target", "drafter", "nonsense"]


@FUZZ
@given(pair=st.dictionaries(st.sampled_from(PAIR_KEYS), VALUES, max_size=4),
       target=st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=5),
       drafter=st.dictionaries(st.sampled_from(MODEL_KEYS), VALUES, max_size=5),
       default=st.none() | st.text(max_size=10))
def test_random_pair_tables_are_parsed_or_refused(tmp_path: Path, pair: dict, target: dict, drafter: dict,
                                                  default: str | None) -> None:
    table = {**pair, "target": target, "drafter": drafter}
    document = {"pairs": {"x": table}, **({"default": default} if default is not None else {})}
    OUTCOMES[f"pair tables {_load(tmp_path, _toml(document))}"] += 1


@FUZZ
@given(data=st.data())
def test_a_valid_pair_with_one_value_changed_is_parsed_or_refused(tmp_path: Path, data: st.DataObject) -> None:
    table = {"about": "x", "ctx": 4096, "target": {"path": "t.gguf", "kv_type": "bf16"},
             "drafter": {"from": "target", "runtime": "onnx", "vocab": 8192}}
    for _ in range(data.draw(st.integers(1, 2))):
        where = data.draw(st.sampled_from(["pair", "target", "drafter"]))
        keys = PAIR_KEYS if where == "pair" else MODEL_KEYS
        holder = table if where == "pair" else table[where]
        if isinstance(holder, dict):  # a first change may have replaced the model's table itself
            holder[data.draw(st.sampled_from(keys))] = data.draw(VALUES)
    OUTCOMES[f"one value changed {_load(tmp_path, _toml({'pairs': {'x': table}}))}"] += 1


def _load(tmp_path: Path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        registry = load_registry(path)
    except UserError as error:
        assert "\n" not in str(error) and str(path) in str(error), error
        return "refused"
    assert isinstance(registry, Registry)
    return "parsed"


def _toml(value: object, key: str = "") -> str:
    """A TOML document for nested dicts of basic values (None leaves the key out, as TOML has no null)."""
    assert isinstance(value, dict)
    lines, tables = [], []
    for name, item in value.items():
        if item is None:
            continue
        if isinstance(item, dict):
            tables.append(_toml(item, f"{key}.{json.dumps(name)}" if key else json.dumps(name)))
        else:
            lines.append(f"{json.dumps(name)} = {_inline(item)}")
    head = [f"[{key}]"] if key else []
    return "\n".join([*head, *lines, *tables]) + "\n"


def _inline(item: object) -> str:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int):
        return str(item)
    if isinstance(item, float):
        return "nan" if item != item else ("inf" if item > 0 else "-inf") if abs(item) == float("inf") else repr(item)
    if isinstance(item, str):
        return json.dumps(item)
    if isinstance(item, list):
        return "[" + ", ".join(_inline(x) for x in item if x is not None) + "]"
    assert isinstance(item, dict)
    return "{" + ", ".join(f"{json.dumps(k)} = {_inline(v)}" for k, v in item.items() if v is not None) + "}"


COSTS_KEYS = ["target_ms", "drafter_ms", "read_ahead_ms", "warm_ms", "overlap_ms", "measured"]


@FUZZ
@given(data=st.data())
def test_cached_pass_times_are_read_or_refused(data: st.DataObject) -> None:
    """pass-times.json entries, valid ones with values replaced: Costs, or ValueError/KeyError/TypeError (the pair
    times its passes again); costs that are read give finite positive pass times."""
    from edge.budget import Costs

    entry = Costs({1: 10.0, 16: 40.0}, {1: 2.0, 8: 5.0}, 3.0).to_json()
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(COSTS_KEYS))
        entry[key] = data.draw(JSON_VALUES | st.dictionaries(st.sampled_from(["1", "8", "-1", "x", "16"]),
                                                              JSON_VALUES, max_size=3))
    try:
        costs = Costs.from_json(entry)
    except (ValueError, KeyError, TypeError, AttributeError):
        OUTCOMES["pass times refused"] += 1
        return
    for n in (1, 8, 64):
        assert 0 < costs.target_s(n) < float("inf")
    OUTCOMES["pass times read"] += 1


@FUZZ
@given(data=st.data())
def test_kept_rule_yields_are_read_or_left_out(tmp_path: Path, data: st.DataObject,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """rule-yields.json, a valid file with values replaced by any JSON (or not JSON at all): what auto starts from is
    each rule's finite yield with at most KEPT_ROUNDS rounds, the rest left out, never an exception."""
    from edge.models.kept import RULE_YIELDS, rule_yields

    from edge.policy import Measured
    from edge.rules import KEPT_ROUNDS, MAX_KEPT_YIELD, RuleChoice

    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    document: dict = {"pair": {"yields": {"key": {"residual": [12.5, 40], "coupled": [9.0, 30]}}, "measured": 1.0}}
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["entry", "yields", "key", "rule", "value"]))
        value = data.draw(JSON_VALUES)
        if where == "entry":
            document["pair"] = value
        elif where == "yields" and isinstance(document["pair"], dict):
            document["pair"]["yields"] = value
        elif where == "key" and isinstance(document["pair"], dict) and isinstance(document["pair"].get("yields"), dict):
            document["pair"]["yields"]["key"] = value
        elif where in ("rule", "value"):
            with suppress(AttributeError, TypeError, KeyError):
                rules = document["pair"]["yields"]["key"]
                name = data.draw(st.sampled_from(["residual", "coupled", "match"]))
                rules[name] = value if where == "rule" else [value, data.draw(JSON_VALUES)]
    text = json.dumps(document) if data.draw(st.integers(0, 3)) else data.draw(st.text(max_size=40))
    (tmp_path / RULE_YIELDS).write_text(text)
    choice = RuleChoice.kept(Measured(rule_yields("pair").get).kept("key"))
    for name in choice.candidates:
        assert 0 <= choice.rounds[name] <= KEPT_ROUNDS
        assert 0 <= choice.mean[name] <= MAX_KEPT_YIELD
        assert choice.rounds[name] or choice.mean[name] == 0
    choice.pick()
    OUTCOMES["rule yields kept" if any(choice.rounds.values()) else "rule yields left out"] += 1


@FUZZ
@given(data=st.data())
def test_cached_machine_facts_are_read_or_measured_again(tmp_path: Path, data: st.DataObject) -> None:
    """machine.json as a person or a crash may leave it: bytes, any JSON, or a valid entry with values replaced. The
    drive's read speed comes back as a plausible figure (read or measured again), never an exception."""
    from edge.models.cache import JsonFile
    from edge.offload import probe

    model = tmp_path / "model.gguf"
    if not model.is_file():
        model.write_bytes(os.urandom(1 << 20))
    cache = tmp_path / "machine.json"
    entry = {"disk_read_gbps": 1.5, "sample_bytes": 1 << 20, "measured": 0, "method": probe.DISK_METHOD}
    for _ in range(data.draw(st.integers(0, 3))):
        entry[data.draw(st.sampled_from([*entry, "nonsense"]))] = data.draw(JSON_VALUES)
    document = data.draw(st.sampled_from(["entry", "any JSON", "bytes"]))
    if document == "entry":
        cache.write_text(json.dumps({probe.machine_key(model): entry}))
    elif document == "any JSON":
        cache.write_text(json.dumps(data.draw(JSON_VALUES)))
    else:
        cache.write_bytes(data.draw(st.binary(max_size=64)))
    speed = probe.disk_read_gbps(model, store=JsonFile(cache), sample_bytes=1 << 20)
    assert speed is not None and 1e-4 <= speed <= 1e3
    OUTCOMES["machine facts read" if speed == entry["disk_read_gbps"] else "machine facts measured again"] += 1


@FUZZ
@given(lines=st.lists(st.text(max_size=40) | st.sampled_from(["[", "[" * 3000, "[1, 2]", '"', '""', '"x"', "[{}]",
                                                              '[{"role": "user", "content": "hi"}]',
                                                              '[{"role": 1, "content": []}]', "[" + "9" * 5000 + "]",
                                                              '"\\ud800"', "\x00", "\ufeff"]),
                      max_size=6),
       raw=st.binary(max_size=64))
def test_prompts_files_are_read_or_refused(tmp_path: Path, lines: list[str], raw: bytes) -> None:
    """`bench --prompts` files: lines of any text, JSON that is barely JSON (unclosed, nested past the parser's depth,
    5,000-digit numbers, messages of the wrong types), and random bytes: prompts, or one UserError."""
    from edge.models.bench import read_prompts

    path = tmp_path / "prompts.txt"
    for content in ("\n".join(lines).encode("utf-8", "surrogatepass"), raw):
        path.write_bytes(content)
        try:
            prompts = read_prompts(path)
        except UserError:
            OUTCOMES["prompts file refused"] += 1
            continue
        assert prompts and all(isinstance(p, str | list) and len(p) > 0 for p in prompts)
        OUTCOMES["prompts file read"] += 1


LOOKUP_VOCAB = 49152


@FUZZ
@given(data=st.data())
def test_kept_lookup_files_are_read_or_started_over(tmp_path: Path, data: st.DataObject) -> None:
    """lookup/<target>-<size>.npy as a hostile user or a crash may leave it: ids anywhere in int32 (past the vocabulary,
    separators in runs), other dtypes and shapes, headers whose shape or dtype was edited, files cut short. A corpus
    within its bound comes back (one line where the file was damaged), never an exception."""
    from edge.models.kept import corpus_path

    from edge.lookup import MAX_CORPUS

    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    tokens = data.draw(st.lists(st.one_of(st.integers(0, LOOKUP_VOCAB - 1), st.just(-1),
                                          st.integers(-(2**31), 2**31 - 1)), max_size=200))
    dtype = data.draw(st.sampled_from(["<i4", "<i4", "<i8", ">i4", "<f4", "<u2"]))
    array = np.array(tokens, dtype=dtype) if dtype != "<u2" else np.array(tokens, np.int64).astype(dtype)
    if data.draw(st.booleans()):
        array = array.reshape(-1, 1) if len(array) else array.reshape(0, 2)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
        path = corpus_path(target)
        read = _corpus_read(path, array, target, data)
    assert read is not None
    corpus, lines = read
    assert corpus is not None and corpus.tokens <= MAX_CORPUS and len(lines) <= 1, lines
    assert all(0 <= token < LOOKUP_VOCAB for reply in corpus.replies for token in reply)
    OUTCOMES["lookup file started over" if lines else "lookup file read"] += 1


def _corpus_read(path: Path, array: np.ndarray, target: Path, data: st.DataObject) -> tuple:
    """`array` saved at `path`, then edited as `data` draws, and read back: the corpus and the lines said."""
    from edge.models.kept import open_corpus

    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, array, allow_pickle=False)
    raw = path.read_bytes()
    edit = data.draw(st.sampled_from(["none", "shape", "cut", "bytes"]))
    if edit == "shape":
        raw = raw.replace(f"({len(array)},".encode(), f"({data.draw(st.integers(-5, 2**62))},".encode(), 1)
    elif edit == "cut":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    elif edit == "bytes":
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        raw = raw[:at] + data.draw(st.binary(min_size=1, max_size=8)) + raw[at + 1:]
    path.write_bytes(raw)
    lines: list[str] = []
    return open_corpus(target, "keep", LOOKUP_VOCAB, lines.append), lines


@FUZZ
@given(name=st.text(max_size=300) | st.from_regex(r"(hf\.co/)?[\w.-]{1,20}/[\w.-]{1,20}(:[\w-]{0,10})?",
                                                  fullmatch=True))
def test_model_references_are_a_source_or_one_line(name: str) -> None:
    """Whatever is given as MODEL: a file source, a Hugging Face source, or one UserError."""
    from edge.models.loading import model_source

    try:
        source = model_source(name)
    except UserError as problem:
        assert "\n" not in str(problem)
        OUTCOMES["model names refused"] += 1
        return
    assert (source.path is None) != (source.hf is None)
    OUTCOMES["model names read"] += 1
