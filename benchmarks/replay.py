"""A target that answers from a known reply: the real round loop with the real drafter, and no target pass.

With greedy decoding the target's answer at every node of a tree is its plain greedy text, so decoding a prompt
plainly once tells what any tree would yield: acceptance walks the tree along that text, and the next token of the
text is the one the target draws. Sampling with a seed works the same way: acceptance draws each token with the same
random number plain sampling used for it (one uniform per emitted token), so a tree yields the plain text too.

    replies = plain_replies(pair.target, prompts, 64, sampling)        # the real target, plainly, once
    decoder = Decoder(ReplayTarget.like(pair.target), pair.drafter, GrowConfig.for_budget(64), sampling)
    stats = replay(decoder, prompts[0], replies[0])                      # growth, acceptance learning, stop tokens

The figures are what a run of the real target measures as long as its tree passes give the same tokens as its plain
passes (a batch-invariant target, docs/lossless.md).

The residual rule (edge/residual.py) does not emit plain sampling's text: its token at a node depends on the
candidates the drafter drew there, so it reaches contexts the reply never did, where the target's distribution is
unknown. (Weighting each replayed round by the rule's chance of emitting the reply over the target's is exact in
expectation, but on sampled chat text a handful of rounds carry all the weight: an effective sample size of 4.5
of 219 rounds at budget 16 on the default pair, whose estimate was 3.09 tokens per pass against 8.83 measured.)
PathTarget answers it exactly instead: acceptance reads only the rows of one path, so it runs the real target on
those nodes alone, one token a pass as it goes down the path, and never the tree pass. That is plain decoding's
cost, whatever the tree's size, and with a batch-invariant target the rows are the tree pass's, bit for bit:

    decoder = Decoder(PathTarget(pair.target), pair.drafter, GrowConfig.for_budget(1024), sampling, accept="residual")
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge.generate import Decoder, Stats
from edge.grow import MAX_BUDGET
from edge.protocols import ModelDefaults, SpecialTokens, Target, TargetWrapper, Tokenizer
from edge.sampling import SamplingConfig
from edge.tree import TokenTree

# A replay holds no batch: it takes the largest tree any budget grows (MAX_BUDGET nodes and the root), whatever the
# target it stands for is loaded to verify, so budgets past 255 nodes can be compared without sizing a real one.
DEFAULT_MAX_TREE = MAX_BUDGET + 1
NO_SPECIAL = SpecialTokens()
REPLAYED = Path("replay")  # the model file a replay stands for, where it was made without one


class ReplyRows:
    """verify's answer, one [n_vocab] float32 row per node, built when read: 0 at the token the reply has after the
    node, -inf elsewhere, so greedy argmax and seeded sampling (edge.sampling.draw) both pick it, the latter still
    consuming one uniform. Acceptance reads only the rows of one path; the whole block would be [n_nodes, n_vocab]
    (256 MB for a 256-node tree over Gemma's 262144 tokens)."""

    def __init__(self, answers: np.ndarray, n_vocab: int):
        self.answers = answers  # [n_nodes] int64: the reply's token after each node
        self.n_vocab = n_vocab

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.answers), self.n_vocab

    def __getitem__(self, node: int) -> np.ndarray:
        row = np.full(self.n_vocab, -np.inf, np.float32)
        row[self.answers[node]] = 0.0
        return row


class ReplayTarget(ModelDefaults):
    """A Target (edge.protocols) that replays `prompt + reply` (set with `expect`) instead of running a model.

    Its "KV cache" is a count: it holds text[:n_past], and every tree it verifies must be rooted at text[n_past]
    (a Decoder's context that strays from the text is a bug, and raises). Past the reply's end there is no known
    answer: those rows put everything on `end_token` (the smallest stop token, or 0 without any), so a decoder asked
    for more than the reply ends there rather than inventing text. It counts passes as a real target does: one per
    verify, and one per `max_tree` tokens of prefill.
    """

    runtime = "replay"

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, special: SpecialTokens = NO_SPECIAL,
                 n_ctx: int = 1 << 20, max_tree: int = DEFAULT_MAX_TREE, path: Path = REPLAYED):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.special = special
        self.n_ctx = n_ctx
        self.max_tree = max_tree
        self.path = path  # the model file whose reply it replays
        self.end_token = min(special.stop, default=0)
        self.n_past = 0
        self.passes = 0
        self.text = np.zeros(0, np.int64)  # the prompt, then the reply

    @classmethod
    def like(cls, target: Target) -> ReplayTarget:
        """A replay with `target`'s vocabulary, tokenizer, special tokens and context (and DEFAULT_MAX_TREE)."""
        return cls(target.tokenizer, target.n_vocab, target.special, target.n_ctx, path=target.path)

    def expect(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        """Replay `reply` (the target's own tokens after `prompt`) from now on; the cache starts empty."""
        self.text = np.asarray([*prompt, *reply], np.int64)
        self.n_past = 0

    @property
    def root(self) -> int:
        """The token the next tree grows from: the newest committed one, which the cache does not hold yet."""
        return int(self.text[self.n_past])

    @property
    def tokens_left(self) -> int:
        """Reply tokens after the root: the most a round from here can still emit."""
        return max(len(self.text) - self.n_past - 1, 0)

    def accepted_path(self, tree: TokenTree) -> list[int]:
        """The nodes from the root along the reply, as far as the tree and the reply go: what a pass would accept."""
        self._check_root(tree)
        path, ahead = [0], self.text[self.n_past + 1:]
        while len(path) <= len(ahead):
            child = tree.child(path[-1], int(ahead[len(path) - 1]))
            if child is None:
                break
            path.append(child)
        return path

    def prefill(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        known = self.text[self.n_past: self.n_past + len(tokens)]
        if len(known) != len(tokens) or (known != np.asarray(tokens)).any():
            raise ValueError(f"prefill of tokens {self.n_past}.. is not the text this target replays (expect first)")
        self.n_past += len(tokens)
        self.passes += -(-len(tokens) // self.max_tree)

    def verify(self, tree: TokenTree) -> ReplyRows:
        """One pass: node v's row answers with the text's token at position n_past + depth(v) + 1. Only nodes on
        the reply's path are ever read (acceptance leaves the tree at the first token off it), so depth suffices.
        Rows, not an ndarray: `logits[v]` is all edge.speculative.accept reads."""
        if len(tree) > self.max_tree:
            raise ValueError(f"tree of {len(tree)} nodes exceeds the verify batch of {self.max_tree}")
        self._check_root(tree)
        self.passes += 1
        positions = self.n_past + tree.depth.astype(np.int64) + 1
        known = positions < len(self.text)
        answers = np.where(known, self.text[np.where(known, positions, 0)], self.end_token)
        return ReplyRows(answers, self.n_vocab)

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        self.n_past += len(path)  # the root and the accepted nodes

    def truncate(self, n: int) -> None:
        self.n_past = min(self.n_past, n)

    def close(self) -> None:
        self.text, self.n_past = np.zeros(0, np.int64), 0

    def _check_root(self, tree: TokenTree) -> None:
        if self.n_past >= len(self.text) or int(tree.tokens[0]) != self.text[self.n_past]:
            raise ValueError(f"a tree rooted at token {int(tree.tokens[0])} where the replayed text has "
                             f"{self.text[self.n_past] if self.n_past < len(self.text) else 'ended'}")


class PathRows:
    """verify's answer from a PathTarget: row v is computed when read, by one pass of the real target over v's token,
    which acceptance reads root first and then down one path (each node read is a child of the one read before)."""

    def __init__(self, owner: PathTarget, tree: TokenTree):
        self.owner, self.tree = owner, tree
        self.path: list[int] = []  # the nodes run so far, root first
        self.shape = (len(tree), owner.n_vocab)

    def __getitem__(self, node: int) -> np.ndarray:
        expected_parent = self.path[-1] if self.path else -1
        if int(self.tree.parents[node]) != expected_parent:
            raise ValueError(f"PathTarget rows are read down one path: node {node} is not a child of {expected_parent}")
        inner = self.owner.inner
        one = TokenTree.root(int(self.tree.tokens[node]))
        row = np.array(inner.verify(one)[0], dtype=np.float32)  # [n_vocab], a copy: the next pass overwrites it
        inner.commit(one, [0])  # the node's cell stays: the next row's pass reads it
        self.path.append(node)
        return row


class PathTarget(TargetWrapper):
    """A Target (edge.protocols) over a real one that verifies a tree by running only the nodes acceptance reads
    (PathRows): exact for any acceptance rule on a batch-invariant target, at one one-token pass per emitted token.
    `passes` counts one per verify, as a tree pass would be; the inner target's own count says what really ran."""

    def __init__(self, inner: Target, max_tree: int = DEFAULT_MAX_TREE):
        super().__init__(inner)
        self.tree_room = max_tree
        self.path_passes = 0
        self._rows: PathRows | None = None

    @property
    def max_tree(self) -> int:
        return self.tree_room

    @property
    def passes(self) -> int:
        return self.path_passes

    def prefill(self, tokens: Sequence[int]) -> None:
        before = self.inner.passes
        self.inner.prefill(tokens)
        self.path_passes += self.inner.passes - before

    def verify(self, tree: TokenTree) -> PathRows:  # type: ignore[override]
        self.path_passes += 1
        self._rows = PathRows(self, tree)
        return self._rows

    def commit(self, tree: TokenTree, path: list[int]) -> None:
        """The path's nodes already ran (and stayed) as acceptance read them."""
        if self._rows is None or self._rows.path != list(path):
            raise ValueError("commit of a path acceptance did not read")
        self._rows = None

    def resize(self, size: int) -> bool:
        self.tree_room = max(self.tree_room, size)  # it holds no batch
        return True

    def close(self) -> None:
        """The inner target is the caller's to close."""


def plain_replies(target: Target, prompts: Sequence[Sequence[int]], max_tokens: int,
                  sampling: SamplingConfig) -> list[list[int]]:
    """The target's plain reply to each prompt, up to `max_tokens` tokens, each sampled from the same seed (as
    edge-spec bench does); a stop token that ends a reply is part of it, as it is a new token in a run."""
    plain, replies = Decoder(target, sampling=sampling), []
    for prompt in prompts:
        plain.set_sampling(sampling)
        plain.reset()
        plain.load(prompt)
        for _ in plain.generate(max_tokens):
            pass
        replies.append(plain.context[len(prompt):])
    plain.reset()
    return replies


def replay(decoder: Decoder, prompt: Sequence[int], reply: Sequence[int]) -> Stats:
    """Decode `prompt` with `decoder`, whose target is a ReplayTarget, answering with `reply` (plain_replies'), from
    empty caches and the sampling seed, as plain_replies decoded it. Returns the run's stats."""
    target = decoder.target
    if not isinstance(target, ReplayTarget):
        raise TypeError(f"replay needs a decoder over a ReplayTarget, not {type(target).__name__}")
    target.expect(prompt, reply)
    decoder.set_sampling(decoder.sampling)  # restart the seed's random numbers, as plain_replies did
    decoder.reset()
    decoder.load(prompt)
    *_, last = decoder.generate(len(reply))
    if decoder.context[len(prompt):] != list(reply):  # acceptance is lossless: a bug if this ever happens
        raise RuntimeError("the replayed decoding strayed from the reply")
    return last.stats
