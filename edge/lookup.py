"""Drafting by lookup: continuations of the text's current suffix, found where that suffix occurred before (in the
prompt, the conversation, earlier replies), proposed as tree branches with no drafter pass (SuffixDecoding, REST,
prompt lookup).

The index is a suffix automaton (Blumer et al.): each state stands for a set of substrings that end at the same
positions, `link` goes to the state of their longest suffix that also ends elsewhere, and `next` holds the tokens that
followed them. Appending a token costs amortized O(1); `count` (how often a state's strings occur) is kept on the
way. The longest suffix of the text that occurred before is the state `link(last)`, found in O(1), and its
continuations are its transitions, each weighted by how often it followed: a tree of them is read off in as many
steps as it has nodes, whatever the text's length.

A second automaton over earlier replies (several texts, each ended by its own separator so that no match crosses
two) follows the current text with the classic matching walk, again O(1) a token amortized, and is bounded: past
MAX_CORPUS tokens it is rebuilt from the newest replies.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

COUNT_STEPS = 64  # a new position counts in at most this many states up its suffix links (lower bounds past)
REWALK = 256  # tokens of the text's end matched again against a rebuilt corpus (longer matches are rare)
MAX_CORPUS = 1 << 17  # tokens of earlier replies an index keeps (about 20 MB): the newest replies are kept
ANCHOR = 8  # a match this long says the text is being copied from where it first occurred (Lookup: the copy)
FOLLOW = 16  # tokens a copy is followed past an edit with no token agreeing before it is given up


class SuffixAutomaton:
    """A suffix automaton over token sequences, built online (states as parallel lists: a token stream of n tokens
    makes at most 2n states)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]  # state -> {token: state}
        self.link: list[int] = [-1]
        self.length: list[int] = [0]  # the longest string of the state
        self.count: list[int] = [0]  # how many positions its strings end at (capped walks: a lower bound)
        self.first: list[int] = [-1]  # where its strings first end: the index of their last token in the text
        self.last = 0  # the state of the whole text so far
        self.size = 0  # tokens appended

    def append(self, token: int) -> None:
        """One more token at the end of the text."""
        nxt, link, length, count = self.next, self.link, self.length, self.count
        current = len(nxt)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        count.append(0)
        self.first.append(self.size)
        state = self.last
        while state != -1 and token not in nxt[state]:
            nxt[state][token] = current
            state = link[state]
        if state != -1:
            target = nxt[state][token]
            if length[state] + 1 == length[target]:
                link[current] = target
            else:  # split: a clone holds the shorter strings, which now also end at this position
                clone = len(nxt)
                nxt.append(dict(nxt[target]))
                link.append(link[target])
                length.append(length[state] + 1)
                count.append(count[target])
                self.first.append(self.first[target])
                while state != -1 and nxt[state].get(token) == target:
                    nxt[state][token] = clone
                    state = link[state]
                link[target] = link[current] = clone
        self.last = current
        self.size += 1
        state = current  # the new position is one more occurrence of every suffix of the text
        for _ in range(COUNT_STEPS):
            if state <= 0:
                break
            count[state] += 1
            state = link[state]

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(int(token))

    def walk(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """The matching walk: from (state, matched length), the longest suffix that still occurs after `token`."""
        nxt, link, length = self.next, self.link, self.length
        while state > 0 and token not in nxt[state]:
            state = link[state]
            matched = length[state]
        if token in nxt[state]:
            return nxt[state][token], matched + 1
        return 0, 0


@dataclass(frozen=True)
class Branch:
    """A continuation: its token, the chance (by counts) that it follows its parent's path, and its parent's index
    in the branches (-1: the current text's end)."""

    token: int
    parent: int
    probability: float
    match: int  # the matched length its path continues (longer: surer)

    @property
    def confidence(self) -> float:
        """What the target's acceptance of this branch is learned by (edge/acceptance.py bins it like a draft
        probability): the counts' chance, discounted by how short the match is. A continuation of a 2-token match is
        a guess, one of a 40-token match a copy, and the counts alone say 1.0 for both. The rates binned by it are
        measured, so only its order matters."""
        return self.probability * self.match / (self.match + 1)


@dataclass
class LookupTree:
    """Continuations proposed for the text's end, parents before children: what growth merges into its tree."""

    branches: list[Branch] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.branches)


def continuations(automaton: SuffixAutomaton, state: int, matched: int, budget: int,
                  min_probability: float = 0.02) -> LookupTree:
    """Up to `budget` continuations of a match (its state and length), the likeliest first (best-first on the product
    of the counts' ratios, as growth is on draft probabilities)."""
    tree = LookupTree()
    if state <= 0 or matched == 0:
        return tree
    frontier = [(-1.0, 0, state, -1, matched)]  # a heap of (-path chance, order, state, branch, match length)
    nxt, count, branches = automaton.next, automaton.count, tree.branches
    while frontier and len(branches) < budget:
        negative, _, node, parent, depth = heapq.heappop(frontier)
        children = nxt[node]
        if len(children) == 1:  # most states of a text that repeats: one follower, nothing to rank
            ranked = list(children.items())
            total = count[ranked[0][1]]
        else:
            ranked = sorted(children.items(), key=lambda item: -count[item[1]])
            total = sum(count[child] for _, child in ranked)
        if total <= 0:
            continue
        for token, child in ranked:
            if token < 0:  # a reply's end (Corpus's separator): nothing follows there
                continue
            probability = count[child] / total
            if -negative * probability < min_probability or len(branches) >= budget:
                break
            branches.append(Branch(token, parent, probability, depth))
            heapq.heappush(frontier, (negative * probability, len(branches), child, len(branches) - 1, depth + 1))
    return tree


class Lookup:
    """The lookup proposer of one conversation: an automaton over its text (the prompt and the reply so far, extended
    token by token) and, shared, one over earlier replies (a Corpus)."""

    def __init__(self, corpus: Corpus | None = None):
        self.corpus = corpus
        self.text: list[int] = []
        self._own = SuffixAutomaton()
        self._corpus_state = (0, 0)  # the matching walk's (state, matched length) over the corpus
        self._walked: SuffixAutomaton | None = None  # the corpus automaton that state belongs to
        self._copy = Copy()

    def set_text(self, tokens: Sequence[int]) -> None:
        """The text is now `tokens`: extended where it extends the last one (a decode, a chat's next turn), indexed
        again otherwise. Called every round, so the check is cheap: the first tokens and the last one known. A text
        that passed it wrongly would only propose worse continuations: the output is the target's whatever they are."""
        known = len(self.text)
        head = min(known, 8)
        if known and not (len(tokens) >= known and tokens[known - 1] == self.text[-1]
                          and list(tokens[:head]) == self.text[:head]):
            self.text, self._own, self._corpus_state, self._copy = [], SuffixAutomaton(), (0, 0), Copy()
            known = 0
        self.append(tokens[known:])

    def remember(self, reply: Sequence[int]) -> None:
        """A finished reply joins the earlier replies later texts are looked up in."""
        if self.corpus is not None:
            self.corpus.add(reply)

    def append(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            token = int(token)
            self._copy.follow(self.text, token)
            self.text.append(token)
            self._own.append(token)
            if self.corpus is not None and self._walked is self.corpus.automaton:
                self._corpus_state = self.corpus.automaton.walk(*self._corpus_state, token)

    def propose(self, budget: int) -> LookupTree:
        """Continuations of the text's end: from its own earlier occurrences first (and, where an edit has cut the
        match short, from the text being copied: Copy), then from earlier replies."""
        own = self._own
        match = own.link[own.last]
        matched = own.length[match] if match > 0 else 0
        if matched >= ANCHOR:
            self._copy.anchor(own.first[match] + 1)
        if matched < ANCHOR and self._copy.sources:  # an edit broke the match, not the copy: its continuation first
            followed = self._copy.propose(self.text, budget // 2)
            tree = merge(followed, continuations(own, match, matched, budget - len(followed)))
        else:
            tree = continuations(own, match, matched, budget)
        if self.corpus is not None and len(tree) < budget:
            if self._walked is not self.corpus.automaton:  # rebuilt (bounded) since: walk the text's end again
                self._corpus_state, self._walked = (0, 0), self.corpus.automaton
                for token in self.text[-REWALK:]:
                    self._corpus_state = self.corpus.automaton.walk(*self._corpus_state, token)
            state, matched = self._corpus_state
            if self.corpus.automaton.size and matched:
                more = continuations(self.corpus.automaton, state, matched, budget - len(tree))
                tree = merge(tree, more)
        return tree


class Copy:
    """Where the text is being copied from, followed past edits. A reply that edits code copies most of it, and each
    edit (a renamed name, an added argument) ends the suffix match: the matches find the copy again only some tokens
    later, once the suffix after the edit is long enough to be unique. Meanwhile the copy's own continuation is the
    likely one. Two hypotheses are kept for where it goes on after tokens that differ from it: the edit inserted them
    (the copy waits at the token it had next) or replaced as many (it moves on with them); a token that agrees with
    either keeps that one alone.

    `sources` are indices into the text: the token each hypothesis says comes next."""

    def __init__(self) -> None:
        self.sources: list[int] = []
        self.agreed = 0  # tokens agreeing since the last edit (or the anchor)
        self.astray = 0  # tokens since one last agreed

    def anchor(self, source: int) -> None:
        """A long match: the text goes on as it did after its first occurrence, at text[source]."""
        self.sources, self.astray = [source], 0

    def follow(self, text: Sequence[int], token: int) -> None:
        """`token` comes after `text`."""
        if not self.sources:
            return
        agreeing = [source for source in self.sources if source < len(text) and text[source] == token]
        if agreeing:
            self.sources, self.agreed, self.astray = [agreeing[0] + 1], self.agreed + 1, 0
            return
        self.agreed, self.astray = 0, self.astray + 1
        inserted, replaced = self.sources[0], self.sources[-1] + 1
        self.sources = [] if self.astray > FOLLOW else list(dict.fromkeys((inserted, replaced)))

    def propose(self, text: Sequence[int], budget: int) -> LookupTree:
        """Each hypothesis's continuation as a chain (surer the longer it has agreed since the edit), in `budget`
        branches."""
        tree = LookupTree()
        share = budget // len(self.sources)
        for source in self.sources:
            parent = -1
            for depth, token in enumerate(text[source : min(source + share, len(text))]):
                chance = 1.0 / len(self.sources) if parent < 0 else 1.0
                tree.branches.append(Branch(int(token), parent, chance, self.agreed + depth + 1))
                parent = len(tree.branches) - 1
        return tree


def merge(first: LookupTree, second: LookupTree) -> LookupTree:
    """Both trees' branches in one, a branch that both propose kept once (the first's, the surer: the text's own)."""
    merged = LookupTree(list(first.branches))
    index: dict[tuple[int, int], int] = {(b.parent, b.token): i for i, b in enumerate(first.branches)}
    remap: dict[int, int] = {-1: -1}
    for i, branch in enumerate(second.branches):
        parent = remap[branch.parent]
        key = (parent, branch.token)
        if key not in index:
            merged.branches.append(Branch(branch.token, parent, branch.probability, branch.match))
            index[key] = len(merged.branches) - 1
        remap[i] = index[key]
    return merged


class Corpus:
    """Earlier replies, indexed for lookup, bounded by MAX_CORPUS tokens (the newest replies are kept; a single reply
    longer than that keeps its end). Each reply ends with its own separator (a negative id no model emits), so no match
    spans two replies. Adding costs O(reply) amortized: past the bound the newest half is indexed again, which happens
    once per max_tokens / 2 tokens added."""

    def __init__(self, max_tokens: int = MAX_CORPUS):
        self.max_tokens = max_tokens
        self.replies: list[list[int]] = []
        self.tokens = 0  # held, separators included
        self.automaton = SuffixAutomaton()

    def add(self, reply: Sequence[int]) -> None:
        if len(reply) == 0:
            return
        self.replies.append([int(token) for token in reply[-(self.max_tokens - 1):]])
        self.tokens += len(self.replies[-1]) + 1
        if self.tokens > self.max_tokens:
            self._keep_newest(self.max_tokens // 2)
            self._rebuild()
        else:
            self._index(self.replies[-1], len(self.replies))

    def _keep_newest(self, tokens: int) -> None:
        """Drop the oldest replies until at most `tokens` are held (the newest reply stays)."""
        dropped = 0
        while dropped < len(self.replies) - 1 and self.tokens > tokens:
            self.tokens -= len(self.replies[dropped]) + 1
            dropped += 1
        del self.replies[:dropped]

    def _index(self, reply: list[int], number: int) -> None:
        self.automaton.extend(reply)
        self.automaton.append(-number)  # the separator

    def _rebuild(self) -> None:
        self.automaton = SuffixAutomaton()
        for number, reply in enumerate(self.replies, 1):
            self._index(reply, number)

    def to_array(self) -> np.ndarray:
        """The replies as one int32 array, each ended by -1 (what Corpus.from_array reads back)."""
        return np.array([token for reply in self.replies for token in (*reply, -1)], np.int32)

    @classmethod
    def from_array(cls, tokens: np.ndarray, max_tokens: int = MAX_CORPUS) -> Corpus:
        """The replies of `tokens` (each ended by a negative id; what follows the last one is not a reply): the newest
        that fit in `max_tokens`, in time linear in the array."""
        corpus = cls(max_tokens)
        tokens = np.asarray(tokens)
        ends = np.flatnonzero(tokens < 0)
        starts = np.concatenate(([0], ends[:-1] + 1))
        lengths = ends - starts + 1  # with the separator
        held = np.cumsum(lengths[::-1])[::-1]  # from each reply to the newest
        first = int(np.searchsorted(-held, -max_tokens)) if len(held) else 0  # the oldest that fits
        first = min(first, len(ends) - 1) if len(ends) else 0
        for start, end in zip(starts[first:].tolist(), ends[first:].tolist(), strict=True):
            corpus.replies.append(tokens[max(start, end - (max_tokens - 1)):end].tolist())
            corpus.tokens += len(corpus.replies[-1]) + 1
        corpus._rebuild()
        return corpus
