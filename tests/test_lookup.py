"""Drafting by lookup (edge/lookup.py): the suffix automaton against brute force, the proposer, the bounded corpus
of earlier replies, and lookup branches in the engine's trees: shared with the drafter's, lossless greedy and
sampled, and lookup alone where no drafter runs."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest
from edge.models.kept import MAX_FILE_TOKENS, corpus_path, open_corpus, save_corpus

from edge.budget import AutoBudget, Costs
from edge.generate import Decoder
from edge.grow import GrowConfig, grow
from edge.lookup import Branch, Corpus, Lookup, LookupTree, SuffixAutomaton, continuations, merge
from edge.policy import FixedBudget, RoundPolicy
from edge.sampling import SamplingConfig
from edge.speculative import RoundResult
from edge.tree import DRAFTED, LOOKED_UP, TokenTree
from tests.oracles import chi_square, first_tokens_distribution
from tests.tiny import TinyModel, generate_tokens


def followers(text: list[int], suffix: list[int]) -> dict[int, int]:
    """Brute force: how often each token followed an occurrence of `suffix` in `text`."""
    found: dict[int, int] = {}
    k = len(suffix)
    for end in range(k, len(text)):
        if text[end - k:end] == suffix:
            found[text[end]] = found.get(text[end], 0) + 1
    return found


def longest_earlier_suffix(text: list[int]) -> int:
    """Brute force: the longest proper suffix of `text` that also ends earlier in it."""
    for k in range(len(text) - 1, 0, -1):
        suffix = text[-k:]
        if any(text[end - k:end] == suffix for end in range(k, len(text))):
            return k
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_the_automaton_finds_the_longest_earlier_suffix_and_its_followers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 3 + seed, 150).tolist()
    automaton = SuffixAutomaton()
    for n, token in enumerate(text, 1):
        automaton.append(token)
        if n % 7 and n != len(text):
            continue
        state = automaton.link[automaton.last]
        matched = automaton.length[state] if state > 0 else 0
        assert matched == longest_earlier_suffix(text[:n])
        if matched:
            expected = followers(text[:n], text[n - matched:n])
            tree = continuations(automaton, state, matched, budget=64, min_probability=0.0)
            first = {b.token: b.probability for b in tree.branches if b.parent < 0}
            total = sum(expected.values())
            assert first == pytest.approx({t: c / total for t, c in expected.items()})


def test_continuations_are_best_first_and_parents_come_first() -> None:
    automaton = SuffixAutomaton()
    automaton.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3, 4, 7, 1, 2])
    state = automaton.link[automaton.last]
    tree = continuations(automaton, state, automaton.length[state], budget=8, min_probability=0.0)
    assert [b.token for b in tree.branches[:2]] == [3, 4]  # "1 2" -> 3 (always), then 4 (2 of 3 times)
    assert all(b.parent < i for i, b in enumerate(tree.branches))
    assert tree.branches[0].probability == 1.0 and tree.branches[1].probability == pytest.approx(2 / 3)
    assert len(continuations(automaton, state, automaton.length[state], budget=2)) == 2


def test_lookup_follows_a_growing_text_and_starts_over_on_another() -> None:
    lookup = Lookup()
    text = [5, 6, 7, 8, 9, 5, 6]
    lookup.set_text(text)
    assert [b.token for b in lookup.propose(3).branches] == [7, 8, 9]
    lookup.set_text([*text, 7])  # extended: indexed incrementally
    assert lookup.text == [*text, 7] and [b.token for b in lookup.propose(2).branches] == [8, 9]
    lookup.set_text([1, 2, 3])  # another text: indexed again
    assert lookup.text == [1, 2, 3] and len(lookup.propose(4)) == 0


def test_earlier_replies_are_proposed_after_the_texts_own() -> None:
    corpus = Corpus()
    corpus.add([40, 41, 42, 43, 44])
    lookup = Lookup(corpus)
    lookup.set_text([1, 2, 40, 41])
    assert [b.token for b in lookup.propose(3).branches] == [42, 43, 44]
    lookup.remember([50, 51, 52])
    assert corpus.replies[-1] == [50, 51, 52]
    other = Lookup(corpus)  # another conversation of the same server
    other.set_text([9, 50])
    assert [b.token for b in other.propose(2).branches] == [51, 52]


def test_a_replys_end_is_never_proposed() -> None:
    """Each reply ends with a separator (a negative id): a match at a reply's end proposes nothing past it."""
    corpus = Corpus()
    corpus.add([3, 4, 5])
    corpus.add([3, 4, 6, 7])
    lookup = Lookup(corpus)
    lookup.set_text([9, 4, 5])
    assert len(lookup.propose(4)) == 0
    lookup.set_text([9, 3, 4])
    tokens = [b.token for b in lookup.propose(8).branches]
    assert tokens and min(tokens) >= 0 and set(tokens) <= {5, 6, 7}


def test_the_corpus_is_bounded_and_round_trips() -> None:
    corpus = Corpus(max_tokens=40)
    for start in range(0, 100, 10):
        corpus.add(list(range(start, start + 9)))
    assert sum(len(r) + 1 for r in corpus.replies) <= 40 and corpus.replies[-1] == list(range(90, 99))
    again = Corpus.from_array(corpus.to_array(), max_tokens=40)
    assert again.replies == corpus.replies
    lookup = Lookup(corpus)
    lookup.set_text([7, 90, 91])
    assert lookup.propose(1).branches[0].token == 92
    for start in range(100, 200, 10):  # rebuilt past its bound while a lookup walks it: the walk starts over
        corpus.add(list(range(start, start + 9)))
    lookup.set_text([7, 90, 91, 190, 191])
    assert lookup.propose(1).branches[0].token == 192


def test_merge_keeps_one_node_per_path() -> None:
    first = LookupTree([Branch(1, -1, 0.9, 3), Branch(2, 0, 0.9, 4)])
    second = LookupTree([Branch(1, -1, 0.5, 1), Branch(3, 0, 0.5, 2)])
    merged = merge(first, second)
    assert [(b.token, b.parent) for b in merged.branches] == [(1, -1), (2, 0), (3, 0)]


def test_lookup_and_drafter_branches_share_one_tree() -> None:
    """A lookup branch whose token the drafter also proposes is one node, marked with both sources; the tree keeps
    the budget."""
    target = TinyModel(n_vocab=9, seed=5)
    drafter = target.noisy(0.3)
    drafter.prefill([1, 2])
    top = int(np.argmax(drafter.logits([1, 2, 3])))
    other = (top + 1) % 9
    lookup = LookupTree([Branch(top, -1, 0.8, 2), Branch(other, -1, 0.2, 2)])
    tree, _ = grow(drafter, 3, GrowConfig.for_budget(16), lookup=lookup)
    assert len(tree) - 1 <= 16
    first_level = {int(tree.tokens[i]): int(tree.source[i]) for i in np.flatnonzero(tree.parents == 0)}
    assert first_level[top] == DRAFTED | LOOKED_UP
    assert list(first_level).count(top) == 1
    assert other in first_level and first_level[other] & LOOKED_UP


def test_a_lookup_branch_the_drafter_overrules_gives_way() -> None:
    """Where the drafter expands a node and does not offer lookup's child there (a copy meeting an edit), the lookup
    branch is scored no higher than a child below the drafter's least offered one, and the drafter's likelier
    children take the budget; a lookup branch the drafter agrees with stays shared."""
    target = TinyModel(n_vocab=9, seed=5)
    drafter = target.noisy(0.3)
    drafter.prefill([1, 2])
    probs = np.log(np.array([0.9, 0.05, 0.03, 0.02], np.float32))

    def sure(tree, nodes, width):  # the drafter is sure of token 1 everywhere, 7 is not among its top 4
        rows = (len(nodes), 1)
        return np.tile(np.arange(1, width + 1, dtype=np.int32), rows), np.tile(probs[:width], rows)

    copy = LookupTree([Branch(7, i - 1, 1.0, 40) for i in range(20)])  # a long, sure-looking copy of token 7
    tree, _ = grow(drafter, 3, GrowConfig.for_budget(16), expand=sure, lookup=copy)
    assert int((tree.source == LOOKED_UP).sum()) <= 1  # at most the first token stays, as a runner-up would
    assert tree.depth[tree.tokens == 1].max() >= 8  # the drafter's chain has the budget
    agreed = LookupTree([Branch(1, i - 1, 1.0, 40) for i in range(20)])  # the same copy, of the drafter's token
    tree, _ = grow(drafter, 3, GrowConfig.for_budget(16), expand=sure, lookup=agreed)
    assert (tree.source[1:] & LOOKED_UP).sum() >= 10


def test_no_branch_runs_below_a_node_the_drafter_did_not_run() -> None:
    """Lookup proposes what followed earlier, a chat's end-of-turn token included: nothing below a stop token joins
    the tree, and the drafter runs a node only when it ran its parent (its keys must be in the drafter's cache; an
    ONNX drafter failed on a lookup node below a stop token, which growth marks as done without running it)."""
    target = TinyModel(n_vocab=9, seed=5)
    drafter = target.noisy(0.3)
    drafter.prefill([1, 2])
    stop = 4
    lookup = LookupTree([Branch(stop, -1, 0.9, 3), Branch(5, 0, 0.9, 4), Branch(6, 1, 0.9, 5),
                         Branch(7, -1, 0.1, 3), Branch(8, 3, 0.9, 4)])
    ran: set[int] = set()
    expand = drafter.expand

    def recording(tree, nodes, width):
        for node in nodes.tolist():
            assert node == 0 or int(tree.parents[node]) in ran, (node, int(tree.parents[node]))
            ran.add(node)
        return expand(tree, nodes, width)

    tree, _ = grow(drafter, 3, GrowConfig.for_budget(16), stop_tokens=frozenset({stop}), expand=recording,
                   lookup=lookup)
    assert not np.isin(tree.parents[1:], np.flatnonzero(tree.tokens == stop)).any()
    assert {5, 6} & set(tree.tokens[tree.source == LOOKED_UP].tolist()) == set()


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_speculation_with_lookup_equals_plain(budget: int) -> None:
    """Drafter and lookup in one tree, and lookup alone: the target's greedy text, token for token, in fewer passes
    than plain decoding (a tiny model's greedy text repeats, so lookup finds it)."""
    prompt = [1, 2, 3, 4, 1, 2]
    plain = generate_tokens(TinyModel(n_vocab=9, seed=5), None, None, prompt, 80, SamplingConfig())
    for with_drafter in (True, False):
        target = TinyModel(n_vocab=9, seed=5)
        drafter = target.noisy(0.7) if with_drafter else None
        decoder = Decoder(target, drafter, GrowConfig.for_budget(budget), SamplingConfig(), lookup=Lookup())
        decoder.load(prompt)
        steps = list(decoder.generate(80))
        assert [s.token for s in steps[:-1]] == plain
        stats = steps[-1].stats
        assert stats.target_passes < len(plain) * 0.6
        assert stats.lookup_rounds == (0 if with_drafter else stats.rounds - stats.plain_rounds)
        assert target.cache == [*prompt, *plain][:-1]


def test_lookup_alone_takes_at_most_a_fixed_budget() -> None:
    policy = RoundPolicy(FixedBudget(GrowConfig.for_budget(4)), drafts=False, max_lookup=4)
    lookup = Lookup()
    lookup.set_text([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    plan = policy.plan(room=100, wanted=50, lookup=lookup.propose(32))
    assert plan.grow is not None and plan.grow.budget == 4 and not plan.drafting


def test_a_longer_match_is_a_surer_branch() -> None:
    """The counts say 1.0 for a continuation seen once after a 2-token match and after a 40-token one; the rates
    are learned by a confidence that tells them apart."""
    short, long = Branch(7, -1, 1.0, match=2), Branch(7, -1, 1.0, match=40)
    assert short.confidence < long.confidence < 1.0
    assert Branch(7, -1, 0.5, match=40).confidence < long.confidence


def chain(tree: LookupTree, first: int) -> list[int]:
    """The tokens of the chain of `tree`'s branches that starts at the root with `first` (each node's first child)."""
    tokens, parent = [], -1
    while True:
        child = next((i for i, b in enumerate(tree.branches) if b.parent == parent
                      and (parent >= 0 or b.token == first)), None)
        if child is None:
            return tokens
        tokens.append(tree.branches[child].token)
        parent = child


@pytest.mark.parametrize("edit", ["replaced", "inserted"])
def test_a_copy_is_followed_past_an_edit(edit: str) -> None:
    """A reply that copies the prompt's code with an edit: right after the edited tokens, where the suffix matches
    have lost the copy, lookup proposes the copy's continuation (the source moved on by the edit's length, or
    waiting at the token it had next), not only whatever followed the edit's tokens elsewhere."""
    source = list(range(100, 140))  # the code in the prompt: 40 distinct tokens
    lookup = Lookup()
    lookup.set_text([1, 2, *source, 3, *source[:20]])  # the reply has copied 20 of them
    assert lookup.propose(16).branches[0].token == source[20]  # a long match: the copy goes on
    new = [900] if edit == "replaced" else [900, 901, 902]
    lookup.append(new)  # the edit: 900 in place of source[20], or three new tokens before it
    proposed = lookup.propose(32)
    following = source[21:] if edit == "replaced" else source[20:]
    assert chain(proposed, following[0])[:8] == following[:8]
    lookup.append(following[:2])  # the copy agrees again: one hypothesis is kept, surer for it
    again = lookup.propose(32)
    assert chain(again, following[2])[:8] == following[2:10]
    assert len({b.token for b in again.branches if b.parent < 0}) == 1


def test_a_copy_is_given_up_once_the_text_goes_elsewhere() -> None:
    source = list(range(100, 140))
    lookup = Lookup()
    lookup.set_text([*source, 3, *source[:20]])
    lookup.propose(16)
    lookup.append(range(500, 520))  # new text, nothing like the copy
    assert not lookup.propose(32).branches


def test_plain_rounds_teach_lookups_rates() -> None:
    """Where auto decodes plainly, the token each plain pass gives is checked against lookup's first proposals, so
    one early miss does not keep lookup's trees off for good (they are learned from again once they would hit)."""
    costs = Costs({1: 30.0, 2: 60.0, 4: 120.0, 16: 480.0}, {})  # every token of a pass costs one plain pass
    policy = RoundPolicy(AutoBudget(costs), drafts=False)
    lookup = Lookup()
    lookup.set_text([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    proposed = lookup.propose(32)
    plan = policy.plan(room=100, wanted=50, lookup=proposed)
    assert plan.grow is None and plan.unverified is proposed  # trees cannot pay here: plain, lookup kept aside
    first = proposed.branches[0]
    before = policy.lookup_acceptance.rate(first.confidence)
    for _ in range(20):
        policy.observe(plan, RoundResult([first.token], TokenTree.root(2), [0], 0, {"verify": 0.03}))
    assert policy.lookup_acceptance.rate(first.confidence) > before
    assert policy.lookup_acceptance.seen.sum() > 0


def test_lookup_trees_are_sized_to_measured_passes() -> None:
    """A pass between two measured sizes is priced at the larger one (kernels take tokens in groups), so a lookup
    tree fills a measured pass: 15 sure branches make a 16-token pass, never 12 priced on a line."""
    budget = AutoBudget(Costs({1: 30.0, 2: 56.0, 4: 83.0, 8: 146.0, 16: 228.0, 32: 449.0}, {}))
    assert budget.pass_s(9) == budget.pass_s(16) == pytest.approx(0.228)
    assert budget.pass_s(3) == budget.pass_s(4)
    policy = RoundPolicy(budget, drafts=False)
    chain = LookupTree([Branch(10 + i, i - 1, 1.0, match=60 + i) for i in range(20)])
    for _ in range(30):  # the target took every branch so far
        policy.lookup_acceptance.observe(_chain_tree(chain), list(range(21)), 99, LOOKED_UP)
    plan = policy.plan(room=100, wanted=50, lookup=chain)
    assert plan.grow is not None and plan.grow.budget == 15


def _chain_tree(chain: LookupTree) -> TokenTree:
    n = len(chain) + 1
    return TokenTree(np.array([0, *(b.token for b in chain.branches)], np.int32), np.arange(-1, n - 1, dtype=np.int32),
                     np.arange(n, dtype=np.int32), np.zeros(n, np.float32),
                     np.log([1.0, *(b.confidence for b in chain.branches)]).astype(np.float32), np.zeros(n, np.int32),
                     np.array([0, *[LOOKED_UP] * len(chain)], np.uint8))


def lookup_counts(sampling: SamplingConfig, accept: str, drafts: bool, runs: int) -> dict[tuple[int, ...], int]:
    """3-token continuations of a prompt ending in [0, 1] (which occurred before in it, so lookup proposes), with
    lookup's branches in every tree, beside a noisy drafter's or alone."""
    target = TinyModel(n_vocab=4, seed=8, scale=1.0)
    drafter = target.noisy(1.5, seed=4) if drafts else None
    decoder = Decoder(target, drafter, GrowConfig(budget=6, beams=2, width=2, max_depth=3, max_steps=3), sampling,
                      accept=accept, lookup=Lookup(Corpus()))
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(runs):  # one RNG for all runs; the corpus of earlier replies grows as they run
        key = tuple(s.token for s in decoder.reply([0, 1, 2, 3, 0, 1, 3, 0, 1], 3) if s.finish_reason is None)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize(("accept", "drafts"), [("match", True), ("residual", True), ("match", False)])
def test_sampled_speculation_with_lookup_has_the_targets_distribution(accept: str, drafts: bool) -> None:
    """Lookup branches are accepted where the target's own draw lands on them, under sample-and-match and under the
    residual rule (docs/lossless.md): the continuations keep the target's distribution."""
    sampling = SamplingConfig(temperature=0.9, top_p=0.95)
    runs = 3000
    exact = first_tokens_distribution(4, TinyModel(n_vocab=4, seed=8, scale=1.0), 3, sampling)
    statistic, critical = chi_square(lookup_counts(sampling, accept, drafts, runs), exact, runs)
    assert statistic < critical


# A kept corpus is read from the cache, which anyone who could write there made: untrusted input (docs/security.md).
VOCAB = 1000


def saved(tmp_path: Path, array: np.ndarray) -> Path:
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    path = corpus_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, array, allow_pickle=False)
    return target


@pytest.mark.parametrize("array, said", [
    (np.array([5, 6, 1000, -1], np.int32), "outside the target's vocabulary of 1000"),
    (np.array([5, 2**31 - 1, -1], np.int32), "outside the target's vocabulary"),
    (np.array([5, -7, -1], np.int32), "outside the target's vocabulary"),
    (np.array([5, 6, -1], np.int64), "int64 array"),
    (np.zeros((2, 3), np.int32), "2 dimensions"),
    (np.zeros(MAX_FILE_TOKENS + 1, np.int32), "more than the"),
])
def test_a_damaged_corpus_file_is_one_line_and_a_fresh_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               array: np.ndarray, said: str) -> None:
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    target, lines = saved(tmp_path, array), []
    corpus = open_corpus(target, "keep", VOCAB, lines.append)
    assert corpus is not None and corpus.replies == [] and len(lines) == 1 and said in lines[0], lines
    assert "starting a new one" in lines[0]


def test_a_header_claiming_a_huge_shape_is_refused_before_reading(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-byte file whose header says 2^40 tokens, and one cut short of what its header says."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    target = saved(tmp_path, np.array([1, 2, -1], np.int32))
    path = corpus_path(target)
    path.write_bytes(path.read_bytes().replace(b"(3,)", b"(1099511627776,)"))
    lines = []
    assert open_corpus(target, "keep", VOCAB, lines.append).replies == [] and "1099511627776 tokens" in lines[0]
    path.write_bytes(path.read_bytes().replace(b"(1099511627776,)", b"(30,)"))
    lines = []
    assert open_corpus(target, "keep", VOCAB, lines.append).replies == [] and "truncated" in lines[0]


def test_reading_and_trimming_a_corpus_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """200,000 separators, then a reply of 4M tokens: read in one pass over the array (tokens indexed, counted), the
    newest reply cut to the bound; adding 65,536 one-token replies past the bound indexes each token a bounded number
    of times (it was quadratic: 88 s of stalled generation)."""
    indexed = []
    append = SuffixAutomaton.append
    monkeypatch.setattr(SuffixAutomaton, "append", lambda self, token: (indexed.append(1), append(self, token)))
    tokens = np.concatenate([np.full(200_000, -1, np.int32), np.arange(4_000_000, dtype=np.int32) % 900, [-1]])
    corpus = Corpus.from_array(tokens.astype(np.int32), max_tokens=4096)
    assert len(corpus.replies) == 1 and len(corpus.replies[0]) == 4095 and corpus.replies[0][-1] == 3_999_999 % 900
    assert len(indexed) == 4096
    indexed.clear()
    corpus = Corpus(max_tokens=4096)
    for token in range(65_536):
        corpus.add([token % 900])
    assert corpus.tokens <= 4096 and corpus.replies[-1] == [65_535 % 900]
    assert len(indexed) <= 3 * 2 * 65_536, len(indexed)  # each reply and separator: added, then in a rebuild or two
    corpus.add(list(range(10_000)))  # one reply past the bound: its end is kept
    assert corpus.replies == [list(range(10_000 - 4095, 10_000))]


def test_kept_replies_are_the_users_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What clients were told is saved 0600 in a 0700 folder, through a temporary named by the process (one a killed
    run left is swept)."""
    monkeypatch.setenv("EDGE_SPEC_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "target.gguf"
    target.write_bytes(b"GGUF")
    folder = corpus_path(target).parent
    folder.mkdir(parents=True, mode=0o755)
    left = folder / f"{corpus_path(target).name}.tmp-999999999"
    left.write_bytes(b"half")
    corpus = Corpus()
    corpus.add([1, 2, 3])
    save_corpus(corpus, target)
    assert stat.S_IMODE(corpus_path(target).stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [corpus_path(target).name]  # the stale temporary swept
    assert open_corpus(target, "keep", VOCAB).replies == [[1, 2, 3]]
