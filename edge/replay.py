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

The residual rule (edge/residual.py) does not yield plain sampling's text: its token at a node depends on the
candidates drawn there, so a replay cannot make it emit the reply. It replays by importance weighting instead. Each
round walks the tree along the reply as sample-and-match would, and weighs itself by

    W = prod over the nodes v it visits of P(y_v | p_v, candidates_v) / p_v(y_v)    (edge.residual.residual_law)

where y_v is the reply's token after v, drawn by plain sampling from the target's p_v, and P is the rule's law
given the candidates (1 where none were drawn). Then E[W f] over replays is E[f] over real rounds from the same
state, for any figure f of a round. The replay needs each p_v, recorded by plain_replies_with_distributions;
WeightedStats gives tokens per pass as sum(W tokens) / sum(W) over rounds and the effective sample size
(sum W)^2 / sum W^2, which says how far to trust it: the rule nearly always emits a drafted candidate x, which the
reply holds only with chance p(x), so even one node's factor is large now and then, and deep trees multiply them.
Growth learns acceptance rates from what the rule would have done, drawn along the reply where its p is known
(ReplayTarget.accept_round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edge.acceptance import Acceptance
from edge.generate import Decoder, Stats
from edge.grow import MAX_BUDGET
from edge.protocols import Target, Tokenizer
from edge.residual import Proposer, residual_law
from edge.sampling import SamplingConfig, distribution
from edge.speculative import accept
from edge.tree import TokenTree

Distribution = tuple[np.ndarray, np.ndarray]  # (token ids ascending, probabilities): edge.sampling.distribution's
KEPT_PROB = 1e-9  # a recorded distribution keeps the tokens this likely (and the one drawn): Gemma has 262144

# A replay holds no batch: it takes the largest tree any budget grows (MAX_BUDGET nodes and the root), whatever the
# target it stands for is loaded to verify, so budgets past 255 nodes can be compared without sizing a real one.
DEFAULT_MAX_TREE = MAX_BUDGET + 1


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


class ReplayTarget:
    """A Target (edge.protocols) that replays `prompt + reply` (set with `expect`) instead of running a model.

    Its "KV cache" is a count: it holds text[:n_past], and every tree it verifies must be rooted at text[n_past]
    (a Decoder's context that strays from the text is a bug, and raises). Past the reply's end there is no known
    answer: those rows put everything on `end_token` (the smallest stop token, or 0 without any), so a decoder asked
    for more than the reply ends there rather than inventing text. It counts passes as a real target does: one per
    verify, and one per `max_tree` tokens of prefill.
    """

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, stop_tokens: frozenset[int] = frozenset(),
                 n_ctx: int = 1 << 20, max_tree: int = DEFAULT_MAX_TREE):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.stop_tokens = frozenset(stop_tokens)
        self.n_ctx = n_ctx
        self.max_tree = max_tree
        self.end_token = min(self.stop_tokens, default=0)
        self.n_past = 0
        self.passes = 0
        self.text = np.zeros(0, np.int64)  # the prompt, then the reply
        self.reply_start = 0  # where the reply starts in text
        self.distributions: Sequence[Distribution] | None = None  # the target's p at each reply token
        self.rounds: list[tuple[float, int]] = []  # each round since `expect`: its weight and the tokens it emitted

    @classmethod
    def like(cls, target: Target) -> ReplayTarget:
        """A replay with `target`'s vocabulary, tokenizer, stop tokens and context (and DEFAULT_MAX_TREE)."""
        return cls(target.tokenizer, target.n_vocab, target.stop_tokens, target.n_ctx)

    def expect(self, prompt: Sequence[int], reply: Sequence[int],
               distributions: Sequence[Distribution] | None = None) -> None:
        """Replay `reply` (the target's own tokens after `prompt`) from now on; the cache starts empty. With
        `distributions`, the target's p at each reply token (plain_replies_with_distributions'), rounds under the
        residual rule are replayed, weighted."""
        if distributions is not None and len(distributions) != len(reply):
            raise ValueError(f"{len(distributions)} distributions for a reply of {len(reply)} tokens")
        self.text = np.asarray([*prompt, *reply], np.int64)
        self.reply_start, self.distributions = len(prompt), distributions
        self.n_past = 0
        self.rounds = []

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

    def accept_round(self, tree: TokenTree, logits: ReplyRows, sampling: SamplingConfig, history: Sequence[int],
                     rng: np.random.Generator, proposer: Proposer | None,
                     acceptance: Acceptance | None) -> tuple[list[int], int]:
        """edge.speculative.accept for this target, which speculative_round calls instead when a target has it, and
        what `acceptance` learns from the round. Sample-and-match runs edge.speculative.accept itself, which walks
        the reply by its rows. The residual rule (a `proposer`) walks along the reply too, and the round is weighed
        (the module's docstring); acceptance then learns what the rule would have done: at each node of the walk
        the rule's token is drawn from its law, coupled to the reply's token so that it agrees where it can, and
        the round is observed as far as they agree (past there, the rule's path leaves the text whose p is known).
        Records (weight, tokens emitted) in `rounds`."""
        if proposer is None:
            path, token = accept(tree, logits, sampling, history, rng)
            weight, observed = 1.0, (path, token)
        else:
            path, token, weight, observed = self._residual_round(tree, proposer, rng)
        if acceptance is not None:
            acceptance.observe(tree, *observed)
        self.rounds.append((weight, min(len(path), self.tokens_left)))  # a run stops at the reply's end too
        return path, token

    def _residual_round(self, tree: TokenTree, proposer: Proposer,
                        rng: np.random.Generator) -> tuple[list[int], int, float, tuple[list[int], int]]:
        """(path along the reply, the reply's token after it, the round's weight, the path and token to observe)."""
        if self.distributions is None:
            raise ValueError("a residual round needs the target's distributions: expect(..., distributions) from "
                             "plain_replies_with_distributions")
        path = self.accepted_path(tree)
        end = self.n_past + len(path)  # the text's position of the token the round ends with
        token = int(self.text[end]) if end < len(self.text) else self.end_token
        weight, observed = 1.0, None
        for depth in range(len(path)):  # path[depth] is at that depth
            position = self.n_past + depth + 1
            if position >= len(self.text):  # the reply ended at this node (a stop token): a run stops here too
                break
            reply_token = int(self.text[position])
            p_ids, p = self.distributions[position - self.reply_start]
            proposal = proposer.at(tree.path_tokens(path[: depth + 1]))
            law_ids, law = (p_ids, p) if proposal is None else residual_law(p_ids, p, proposal)
            p_reply, law_reply = _probability(p_ids, p, reply_token), _probability(law_ids, law, reply_token)
            weight *= law_reply / p_reply
            if observed is None:
                drawn = _coupled_draw(reply_token, p_reply, law_reply, p_ids, p, law_ids, law, rng)
                if drawn != reply_token:
                    observed = (path[: depth + 1], drawn)
        return path, token, weight, observed or (path, token)

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


def plain_replies(target: Target, prompts: Sequence[Sequence[int]], max_tokens: int,
                  sampling: SamplingConfig) -> list[list[int]]:
    """The target's plain reply to each prompt, up to `max_tokens` tokens, each sampled from the same seed (as
    edge-spec bench does); a stop token that ends a reply is part of it, as it is a new token in a run."""
    return _decode_plainly(target, prompts, max_tokens, sampling, record=False)[0]


def plain_replies_with_distributions(target: Target, prompts: Sequence[Sequence[int]], max_tokens: int,
                                     sampling: SamplingConfig) -> tuple[list[list[int]], list[list[Distribution]]]:
    """plain_replies' replies (the same passes, the same tokens), and for each reply token the distribution it was
    drawn from (edge.sampling.distribution of that pass's logits): a residual replay's p. Each keeps the tokens of
    probability KEPT_PROB or more and the one drawn, unnormalized: without top-k a row is most of the vocabulary."""
    return _decode_plainly(target, prompts, max_tokens, sampling, record=True)


def _decode_plainly(target: Target, prompts: Sequence[Sequence[int]], max_tokens: int, sampling: SamplingConfig,
                    record: bool) -> tuple[list[list[int]], list[list[Distribution]]]:
    plain, replies, distributions = Decoder(target, sampling=sampling), [], []
    for prompt in prompts:
        plain.set_sampling(sampling)
        plain.reset()
        plain.load(prompt)
        recorder = _Recorder(target, plain) if record else None
        if recorder is not None:  # after load, which must name the target itself as the one its caches serve
            plain.target = recorder
        try:
            for _ in plain.generate(max_tokens):
                pass
        finally:
            plain.target = target
        replies.append(plain.context[len(prompt):])
        distributions.append([] if recorder is None else recorder.finish(replies[-1]))
    plain.reset()
    return replies, distributions


class _Recorder:
    """The target, whose verify also keeps the sampling distribution of each pass (plain decoding: one node, its
    history the decoder's context), as draw computes it."""

    def __init__(self, target: Target, decoder: Decoder):
        self._target, self._decoder = target, decoder
        self.distributions: list[Distribution] = []

    def verify(self, tree: TokenTree) -> np.ndarray:
        logits = self._target.verify(tree)  # [1, n_vocab]
        if self.distributions:  # the root is the token drawn from the last one
            self.distributions[-1] = _kept(*self.distributions[-1], int(tree.tokens[0]))
        self.distributions.append(distribution(logits[0], self._decoder.sampling, self._decoder.context))
        return logits

    def finish(self, reply: Sequence[int]) -> list[Distribution]:
        if self.distributions:
            self.distributions[-1] = _kept(*self.distributions[-1], reply[-1])
        return self.distributions

    def __getattr__(self, name: str):  # everything else is the target's
        return getattr(self._target, name)


def _kept(ids: np.ndarray, probs: np.ndarray, drawn: int) -> Distribution:
    keep = (probs >= KEPT_PROB) | (ids == drawn)
    return ids[keep].astype(np.int32), probs[keep]


def _probability(ids: np.ndarray, probs: np.ndarray, token: int) -> float:
    at = int(np.searchsorted(ids, token))
    return float(probs[at]) if at < len(ids) and ids[at] == token else 0.0


def _coupled_draw(reply_token: int, p_reply: float, law_reply: float, p_ids: np.ndarray, p: np.ndarray,
                  law_ids: np.ndarray, law: np.ndarray, rng: np.random.Generator) -> int:
    """A token from `law` that is the reply's token (itself a draw from p) as often as can be: kept with chance
    min(1, law/p) there, else drawn from the law's excess over p. Its distribution is exactly `law`."""
    if rng.random() * p_reply < law_reply:
        return reply_token
    p_on_law = np.zeros(len(law_ids))  # law's support holds p's
    p_on_law[np.searchsorted(law_ids, p_ids)] = p
    excess = np.maximum(law - p_on_law, 0.0)
    if excess.sum() <= 0:
        return reply_token
    index = int(np.searchsorted(np.cumsum(excess), rng.random() * excess.sum(), side="right"))
    return int(law_ids[min(index, len(law_ids) - 1)])


@dataclass
class WeightedStats(Stats):
    """A replay's Stats and each of its rounds' weight and tokens (the module's docstring). Under sample-and-match
    every weight is 1 and the weighted figure is the plain one."""

    round_weights: list[float] = field(default_factory=list)
    round_tokens: list[int] = field(default_factory=list)

    @property
    def weighted_tokens_per_pass(self) -> float:
        """sum(W tokens) / sum(W) over rounds (one target pass each): the self-normalized estimate of a real run's
        tokens per pass. Unweighted, the same sum is the replay's own walk along the reply (tokens_per_pass)."""
        weights = np.asarray(self.round_weights)
        return float(weights @ np.asarray(self.round_tokens) / weights.sum()) if weights.sum() > 0 else 0.0

    @property
    def effective_rounds(self) -> float:
        """(sum W)^2 / sum W^2: about how many real rounds the weighted figure is worth (rounds, when all are 1)."""
        weights = np.asarray(self.round_weights)
        return float(weights.sum() ** 2 / (weights**2).sum()) if weights.any() else 0.0


def replay(decoder: Decoder, prompt: Sequence[int], reply: Sequence[int],
           distributions: Sequence[Distribution] | None = None) -> WeightedStats:
    """Decode `prompt` with `decoder`, whose target is a ReplayTarget, answering with `reply` (plain_replies'), from
    empty caches and the sampling seed, as plain_replies decoded it. Returns the run's stats with each round's
    weight; a decoder with the residual rule needs the reply's `distributions` (plain_replies_with_distributions')."""
    target = decoder.target
    if not isinstance(target, ReplayTarget):
        raise TypeError(f"replay needs a decoder over a ReplayTarget, not {type(target).__name__}")
    if decoder.accept == "auto" and not decoder.sampling.greedy:
        raise ValueError("--accept auto is not replayed: it would choose between rules by the reply's walk")
    target.expect(prompt, reply, distributions)
    decoder.set_sampling(decoder.sampling)  # restart the seed's random numbers, as plain_replies did
    decoder.reset()
    decoder.load(prompt)
    *_, last = decoder.generate(len(reply))
    if decoder.context[len(prompt):] != list(reply):  # acceptance is lossless: a bug if this ever happens
        raise RuntimeError("the replayed decoding strayed from the reply")
    weights, tokens = zip(*target.rounds, strict=True) if target.rounds else ((), ())
    if sum(tokens) != last.stats.new_tokens:
        raise RuntimeError(f"the replay's rounds hold {sum(tokens)} tokens, its run {last.stats.new_tokens}")
    return WeightedStats(**vars(last.stats), round_weights=list(weights), round_tokens=list(tokens))
