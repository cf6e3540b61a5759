"""The generation loop: a generator of steps that chat, generate and bench all consume."""

from __future__ import annotations

import codecs
import dataclasses
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from edge.acceptance import Acceptance
from edge.coupled import Noise
from edge.errors import ContextFull, Interrupted, UserError
from edge.grow import GrowConfig
from edge.lookup import Lookup
from edge.overlap import Overlap
from edge.policy import LOOKUP_BRANCHES, BudgetPolicy, FixedBudget, Measured, RoundPolicy
from edge.protocols import Drafter, Target
from edge.rules import Reply
from edge.sampling import SamplingConfig
from edge.speculative import RoundPlan, RoundResult, run_round

PLAIN = RoundPlan(None)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the KV caches already held (a chat's earlier turns): not run again
    new_tokens: int = 0
    rounds: int = 0
    target_passes: int = 0  # counted by the runtime: forward passes the rounds ran
    prefill_passes: int = 0  # the target's passes over the prompt before the first round (a plain target has none:
    # its first round's pass runs the prompt too)
    drafter_passes: int = 0
    tree_nodes: int = 0
    prefill_s: float = 0.0
    grow_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    decode_s: float = 0.0  # wall time of the rounds, prefill excluded
    plain_rounds: int = 0  # rounds a budget policy ran without a tree (speculation did not pay)
    lookup_rounds: int = 0  # rounds whose tree was lookup branches alone (no drafter pass)
    rule_rounds: dict[str, int] = dataclasses.field(default_factory=dict)  # tree rounds by acceptance rule
    rule_tokens: dict[str, int] = dataclasses.field(default_factory=dict)  # ... and the tokens they yielded
    budget_sum: int = 0  # draft nodes asked for, summed over rounds (mean budget = budget_sum / rounds)
    hidden_s: float = 0.0  # drafting done while target passes ran (edge/overlap.py): in verify_s, not in draft_s
    pregrown_rounds: int = 0  # rounds whose tree was grown during the previous round's pass

    @property
    def residual_rounds(self) -> int:
        """Tree rounds the residual rule verified."""
        return self.rule_rounds.get("residual", 0)

    def rule_tokens_per_pass(self) -> dict[str, float]:
        """Each rule's tree rounds' tokens a pass (a round's tokens before a stop cut the reply short): what --accept
        auto chose between, as it turned out."""
        return {rule: round(self.rule_tokens[rule] / rounds, 3) for rule, rounds in sorted(self.rule_rounds.items())}

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0

    def count(self, plan: RoundPlan, result: RoundResult, passes: int, seconds: float) -> None:
        """One round: its plan, what it did, the target passes it ran and its wall time."""
        self.rounds += 1
        self.pregrown_rounds += result.pregrown
        self.hidden_s += result.seconds.get("hidden", 0.0)
        self.plain_rounds += plan.grow is None
        self.lookup_rounds += plan.grow is not None and not plan.drafting
        if plan.grow is not None:  # a new dict: the steps' copies of the figures keep theirs
            rule = plan.rule.name
            self.rule_rounds = {**self.rule_rounds, rule: self.rule_rounds.get(rule, 0) + 1}
            self.rule_tokens = {**self.rule_tokens, rule: self.rule_tokens.get(rule, 0) + len(result.tokens)}
        self.budget_sum += 0 if plan.grow is None else plan.grow.budget
        self.target_passes += passes
        self.drafter_passes += result.drafter_passes
        self.tree_nodes += result.tree_size
        self.grow_s += result.grow_s
        self.draft_s += result.draft_s
        self.verify_s += result.verify_s
        self.decode_s += seconds

    def add(self, other: Stats) -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, dict):
                setattr(self, field.name, {key: mine.get(key, 0) + theirs.get(key, 0) for key in {*mine, *theirs}})
            else:
                setattr(self, field.name, mine + theirs)

    def as_dict(self) -> dict[str, float | int]:
        """Every figure of a run, totals and per round: what --json prints and each bench row is made of."""
        rounds = max(self.rounds, 1)
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "target_passes": self.target_passes,
            "prefill_passes": self.prefill_passes,
            "tokens_per_pass": round(self.tokens_per_pass, 3),
            "drafter_passes_per_round": round(self.drafter_passes / rounds, 3),
            "tree_nodes_per_round": round(self.tree_nodes / rounds, 1),
            "prefill_s": round(self.prefill_s, 4),
            "grow_s": round(self.grow_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "grow_s_per_round": round(self.grow_s / rounds, 5),
            "draft_s_per_round": round(self.draft_s / rounds, 5),
            "verify_s_per_round": round(self.verify_s / rounds, 5),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "plain_rounds": self.plain_rounds,
            "lookup_rounds": self.lookup_rounds,
            "residual_rounds": self.residual_rounds,
            "rule_rounds": dict(sorted(self.rule_rounds.items())),
            "rule_tokens_per_pass": self.rule_tokens_per_pass(),
            "mean_budget": round(self.budget_sum / rounds, 1),
            "hidden_s_per_round": round(self.hidden_s / rounds, 5),
            "pregrown_rounds": self.pregrown_rounds,
        }


@dataclass
class Step:
    token: int | None  # None on the final step, which only carries finish_reason
    text: str  # printable text this step adds (UTF-8 sequences split across tokens are held back)
    finish_reason: str | None  # "stop", "length", "context" or "interrupted" on the final step
    stats: Stats  # the reply's figures as of this step (a copy: later steps do not change it)


# Which decoder last loaded a prompt into a target's KV cache (and its drafter's), by the target: several decoders may
# share one pair's models (the benchmark rows, the library's calls, a test's plain reference beside the pair's own
# decoder), and a decoder reuses what the caches hold only if it loaded them last. Weak: a decoder dropped leaves no
# entry, and while one lives its target does, so no other target can take its id.
_HOLDERS: weakref.WeakValueDictionary[int, Decoder] = weakref.WeakValueDictionary()


PREFILL_CHUNK = 256  # prompt tokens per prefill pass: a Ctrl-C waits for one such pass at most


class Decoder:
    """Owns a target (and optionally a drafter) and the committed context; both KV caches hold context[:-1].

    Each round does what its round policy (edge.policy.RoundPolicy) plans: a tree of some shape, or none (plain
    decoding), and its acceptance rule. `rounds` is that policy, or what it is made from: a GrowConfig (that tree
    every round), a budget policy (`--budget auto`'s, choosing round by round), or None (plain decoding every
    round); `accept` is then the rule when sampling ("match", "residual", "coupled" or "auto": the one of the residual
    rule and coupled sampling that has yielded more, round by round), and `choices` the pair's measured yields by
    rule, shared by its decoders (edge.policy.RoundPolicy).
    """

    def __init__(self, target: Target, drafter: Drafter | None = None,
                 rounds: RoundPolicy | BudgetPolicy | GrowConfig | None = None, sampling: SamplingConfig | None = None,
                 accept: str = "match", *, lookup: Lookup | None = None, overlap: bool = False,
                 choices: Measured | None = None):
        self.target = target
        speculates = rounds is not None
        self.drafter = drafter if speculates else None  # not run at all when every round is plain
        self.lookup = lookup if speculates else None  # continuations from the text so far (edge/lookup.py)
        if not isinstance(rounds, RoundPolicy):
            fixed = rounds is None or isinstance(rounds, GrowConfig)
            budget = FixedBudget(rounds) if fixed else rounds
            rounds = RoundPolicy(budget, accept, drafts=self.drafter is not None, lookup=self.lookup is not None,
                                 max_lookup=rounds.budget if isinstance(rounds, GrowConfig) else None,
                                 choices=choices)
        self.rounds = rounds
        # drafting during the target's passes (edge/overlap.py)
        self.overlap = Overlap() if overlap and self.drafter is not None else None
        self.context: list[int] = []
        self.cached_tokens = 0  # of the last prompt loaded, how many the caches already held
        self.set_sampling(sampling or SamplingConfig())

    def set_sampling(self, sampling: SamplingConfig) -> None:
        """Restarts the seed's random numbers (the round policy keeps its measured rates while only the seed
        changes)."""
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.draft_rng = np.random.default_rng(np.random.SeedSequence(sampling.seed).spawn(1)[0])  # residual draws
        self.rounds.set_sampling(sampling)

    @property
    def acceptances(self) -> dict[str, Acceptance]:
        return self.rounds.acceptances

    @property
    def acceptance(self) -> Acceptance:
        """The measured rates of the rule that runs now (sample-and-match's while greedy)."""
        return self.rounds.acceptance

    def load(self, tokens: Sequence[int], should_stop: Callable[[], bool] | None = None) -> float:
        """Make `tokens` the context, running only what the KV caches do not already hold. Returns seconds.

        The new tokens run PREFILL_CHUNK at a time, so that `should_stop` (Ctrl-C) is heard within one chunk's pass:
        then Interrupted is raised, the caches keep what was read, and loading the same prompt again goes on from
        there."""
        check_fits(tokens, self.target.n_ctx)
        start = time.perf_counter()
        if _HOLDERS.get(id(self.target)) is not self:  # another decoder has used the caches since: start over
            self.context = []
        _HOLDERS[id(self.target)] = self
        keep = min(common_prefix(self.context, tokens), len(tokens) - 1, max(len(self.context) - 1, 0))
        self.cached_tokens = keep
        self._forget_pregrown()
        for model in self._models():
            model.truncate(keep)
        for done in range(keep, len(tokens) - 1, PREFILL_CHUNK) or [keep]:  # an empty prefill still runs (flushes)
            if should_stop is not None and should_stop():
                self.context = list(tokens[: done + 1])  # the caches hold tokens[:done]
                raise Interrupted(f"stopped after reading {done} of the prompt's {len(tokens)} tokens")
            for model in self._models():
                model.prefill(tokens[done : min(done + PREFILL_CHUNK, len(tokens) - 1)])
        self.context = list(tokens)
        if self.lookup is not None:
            self.lookup.set_text(self.context)
        return time.perf_counter() - start

    def adopt(self, context: Sequence[int]) -> None:
        """The target's cache was given context[:-1] from outside (a saved state put back): this decoder holds it, as
        if it had loaded it. Only without a drafter, whose cache would not hold it."""
        if self.drafter is not None:
            raise ValueError("a decoder with a drafter loads its context through both caches")
        self._forget_pregrown()
        self.context = list(context)
        _HOLDERS[id(self.target)] = self

    def reset(self) -> None:
        self._forget_pregrown()
        for model in self._models():
            model.truncate(0)
        self.context = []

    def reply(self, tokens: Sequence[int], max_tokens: int,
              should_stop: Callable[[], bool] | None = None) -> Iterator[Step]:
        """load(tokens), then generate: one Step per new token and a final one whose stats include the prefill. A
        stop asked for while the prompt is read ends it at once, with the finish reason "interrupted" and no tokens
        (the caches keep what was read)."""
        passes = self.target.passes
        try:
            prefill_s = self.load(tokens, should_stop)
        except Interrupted:
            yield Step(None, "", "interrupted", Stats(prompt_tokens=len(tokens)))
            return
        prefill_passes = self.target.passes - passes
        for step in self.generate(max_tokens, should_stop=should_stop):
            if step.finish_reason is not None:
                step.stats.prefill_s, step.stats.cached_tokens = prefill_s + step.stats.prefill_s, self.cached_tokens
                step.stats.prefill_passes += prefill_passes
                if self.lookup is not None:
                    self.lookup.remember(self.context[len(tokens):])  # later replies may repeat this one
            yield step

    def generate(self, max_tokens: int, stop_tokens: frozenset[int] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> Iterator[Step]:
        """Yield one Step per new token, then a final Step with the finish reason. `should_stop` is asked before each
        round and after each token yielded: when it says so, the reply ends there ("interrupted")."""
        stop_tokens = self.target.special.stop if stop_tokens is None else stop_tokens
        stats = Stats(prompt_tokens=len(self.context))
        # a coupled reply's key: drawn from the seeded generator, so a seed gives the same reply with or without a tree
        noise = Noise(int(self.rng.integers(1 << 63))) if self.rounds.coupled else None
        reply = Reply(self.sampling, self.rng, self.draft_rng, noise, stop_tokens)
        text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        finish = None
        deferred = getattr(self.target, "deferred", 0) > 0  # its first pass runs the prompt (a plain target)
        while finish is None:
            if should_stop is not None and should_stop():
                finish = "interrupted"
                break
            room = min(self.target.n_ctx - len(self.context), self.target.max_tree)  # KV cells left, one pass
            if room < 1:
                finish = "context"
                break
            started, passes = time.perf_counter(), self.target.passes
            plan = PLAIN
            if self.drafter is not None or self.lookup is not None:
                proposed = None if self.lookup is None else self.lookup.propose(min(LOOKUP_BRANCHES, room - 1))
                plan = self.rounds.plan(room, max_tokens - stats.new_tokens, proposed)
            if not (plan.drafting and plan.rule.overlaps):
                self._forget_pregrown()  # a tree grown during the last pass is for a round like this one only
            drawn = reply
            if plan.rule.coupled and self.rounds.chooses:  # noise no earlier round ranked a tree by (edge/rules.py)
                drawn = dataclasses.replace(reply, noise=Noise(int(self.rng.integers(1 << 63))))
            result = run_round(self.target, self.drafter, self.context, plan, drawn, self.overlap)
            if self.drafter is not None and not plan.drafting:  # it catches up on the tokens at its next tree
                self.drafter.commit(result.tree, result.path)
            self.rounds.observe(plan, result)
            elapsed = time.perf_counter() - started
            stats.count(plan, result, self.target.passes - passes, elapsed)
            if deferred:  # the round ran the prompt too, as llama.cpp runs one: reading it, not decoding
                stats.decode_s -= elapsed
                stats.prefill_s += elapsed
                deferred = False
            for token in result.tokens:
                self.context.append(token)
                stats.new_tokens += 1
                if token in stop_tokens:
                    finish = "stop"
                    break
                piece = text.decode(self.target.tokenizer.token_bytes(token))
                if stats.new_tokens >= max_tokens:
                    finish = "length"
                yield Step(token, piece, None, dataclasses.replace(stats))
                if finish:
                    break
                if should_stop is not None and should_stop():  # heard after each token, not only between rounds:
                    finish = "interrupted"  # a stop string ends the reply on the token that completed it
                    break
            if self.lookup is not None:
                self.lookup.set_text(self.context)
        self._sync()
        yield Step(None, text.decode(b"", final=True), finish, stats)

    def _sync(self) -> None:
        """Drop accepted tokens past the stop point, so the caches hold exactly context[:-1]."""
        self._forget_pregrown()
        for model in self._models():
            model.truncate(len(self.context) - 1)

    def _forget_pregrown(self) -> None:
        if self.overlap is not None:
            self.overlap.forget()

    def _models(self) -> list[Target | Drafter]:
        return [m for m in (self.target, self.drafter) if m is not None]


def check_fits(tokens: Sequence[int], n_ctx: int) -> None:
    """A prompt must leave room in the context for at least one new token."""
    if not tokens:
        raise UserError("the prompt is empty")
    if len(tokens) >= n_ctx:
        raise ContextFull(len(tokens), n_ctx)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n
