"""`--budget auto`: the tree budget that gives the most tokens per second on this machine, chosen every round (the
budget part of the engine's round policy, edge/policy.py; offload/tuning.py measures the costs it starts from).

Sequoia's idea (hardware-aware trees) done online. For each candidate budget b:

    rate(b)     = tokens(b) / (grow(b) + verify(b))        rate(plain) = 1 / verify(plain)
    tokens(b)   expected tokens per target pass: measured on the trees that ran (below), a prior until then
    grow(b)     drafter passes x the drafter's measured pass time t_d(beams), scaled by what rounds took
    verify(b)   the target's measured pass time t(n) for n = b + 1 + the tokens it re-runs; from the SSD with
                readahead, the pass follows the reading that growth started: it ends when its compute on read
                weights is done, and no sooner than the reading left after growth plus the compute after the last
                byte (Costs.verify_s); scaled likewise

and the round runs the best of them, plain decoding included. Tokens per pass are kept for each acceptance rule
apart (the policy says which rule a round runs): under `--accept auto` both rules run, and sample-and-match's
trees yield fewer tokens when the target samples (at T=0.8 under a memory cap, one table for both chose trees of
6 nodes on average and yielded 2.20 tokens a pass, where the residual rule's own table chose 18 and yielded 3.65:
docs/performance.md). Every round that runs a tree of b nodes also
says what any smaller budget would have yielded, for free: best-first growth keeps the best-scoring nodes,
so the tree of budget b' < b is (nearly) the b' best nodes of this one, and the accepted path's prefix
that lies among them is what it would have accepted. Budgets above the largest tree seen are extrapolated
(tokens grow about linearly in log budget), which is optimistic, so a larger budget gets tried when it
could pay and is dropped when the measurement says it does not. A budget's running yield starts from the prior, not
from its first round (a first tree rejected at its root would otherwise say every budget yields 1 token), a larger
tree is taken to yield at least what a smaller one does (it holds it), and while trees of one budget win, the next
larger one is tried now and then (less and less often) when twice its yield would beat them: a larger tree is
measured only when it runs, and one unlucky round must not keep it off for good. While plain decoding wins, a tree round
is tried now and then (less and less often, and never for more than 1/PROBE_SHARE of the time spent
decoding plainly) when twice the tokens per pass measured so far would make it pay.

Budgets past 255 nodes (1024, 2048) are candidates only where a target pass over 256 tokens costs about what one
token's does (FLAT_RATIO: the pass reads weights, a GPU's or the SSD's, more than it computes): there measure_costs
gives the target a larger verify batch and times those passes too. On a CPU with the target in RAM they never are,
and could not pay.
"""

from __future__ import annotations

import functools
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge.grow import MAX_LEAVES, GrowConfig
from edge.speculative import RoundResult
from edge.tree import TokenTree

CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 255, 1024, 2048)
LARGE = tuple(b for b in CANDIDATES if b > MAX_LEAVES)  # measured, and chosen, only where passes are flat
FLAT_RATIO = 1.5  # a pass over 256 tokens within this factor of a one-token pass: bound by reading weights
# Tokens per pass gained per doubling of the budget before any round is seen: the slope of the
# tokens-per-pass curves in docs/drafter.md (about 5.8-6.1 at budget 64, 8.8 at 255).
PRIOR_SLOPE = 0.85
SMOOTHING = 0.25  # weight of the newest round in the running averages
PLAIN_WINDOW = 15  # plain rounds' timing: the median of this many
REVIEW_PLAIN = 8  # once plain decoding wins, rounds before comparing again (each comparison costs ~0.1 ms)
FIRST_PROBE = 16  # plain rounds before a tree is tried again; doubles after each try that does not pay
MAX_PROBE = 1024
PROBE_SHARE = 20  # a tree tried while plain decoding wins costs at most 1/20 of the plain time before it


@dataclass(frozen=True)
class Costs:
    """Measured times on this machine and placement: target passes over n tokens, drafter passes over n nodes."""

    target_ms: dict[int, float]
    drafter_ms: dict[int, float]
    read_ahead_ms: float = 0.0  # SSD with readahead: reading the weights, which drafting can hide
    warm_ms: dict[int, float] | None = None  # SSD with readahead: passes once the weights are read ahead
    overlap_ms: dict[int, float] | None = None  # SSD with readahead: passes started with the reading
    window_ms: float | None = None  # a windowed readahead (offload/window.py): the reading its window holds

    def verify_s(self, tokens: float, grow_s: float) -> float:
        """A pass over `tokens` after `grow_s` of drafting. Without readahead: the pass as measured back to back.
        With it, the pass follows the reading's front: it ends once its compute is done (warm), and no sooner than
        the reading that growth left undone plus the compute that follows the last byte (the tail: what a pass
        started together with the reading takes beyond the reading)."""
        if self.warm_ms is None:
            return self.target_s(tokens)
        warm = _interpolate(self.warm_ms, tokens) / 1000
        ahead = grow_s if self.window_ms is None else min(grow_s, self.window_ms / 1000)  # read during growth
        left = max(self.read_ahead_ms / 1000 - ahead, 0.0)
        if self.overlap_ms is None:  # costs cached before the tail was measured: no overlap at all
            return warm + left
        tail = min(max(_interpolate(self.overlap_ms, tokens) - self.read_ahead_ms, 0.0) / 1000, warm)
        return max(warm, left + tail)

    def to_json(self) -> dict:
        def optional(table):
            return None if table is None else json_table(table)

        return {"target_ms": json_table(self.target_ms), "drafter_ms": json_table(self.drafter_ms),
                "read_ahead_ms": self.read_ahead_ms, "warm_ms": optional(self.warm_ms),
                "overlap_ms": optional(self.overlap_ms), "window_ms": self.window_ms}

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        """Costs as to_json wrote them; ValueError for anything it could not have written (a damaged cache)."""
        def table(d: dict | None, empty: bool = False) -> dict[int, float] | None:
            if d is None:
                return None
            if not isinstance(d, dict) or (not d and not empty):
                raise ValueError(f"a table of pass times is {d!r:.60}")
            parsed = {int(k): float(v) for k, v in d.items()}
            if any(k < 1 or not math.isfinite(v) or v <= 0 for k, v in parsed.items()):
                raise ValueError("a pass time is not a positive time for a positive size")
            return parsed

        if not isinstance(data.get("target_ms"), dict) or not isinstance(data.get("drafter_ms"), dict):
            raise ValueError("the target's and the drafter's pass times are not tables")
        read_ahead = float(data.get("read_ahead_ms", 0.0))
        if not math.isfinite(read_ahead) or read_ahead < 0:
            raise ValueError(f"read_ahead_ms is {read_ahead}")
        window = data.get("window_ms")
        if window is not None and (not isinstance(window, int | float) or not math.isfinite(window) or window < 0):
            raise ValueError(f"window_ms is {window!r:.40}")
        return cls(table(data["target_ms"]), table(data["drafter_ms"], empty=True), read_ahead,
                   table(data.get("warm_ms")), table(data.get("overlap_ms")), None if window is None else float(window))

    def target_s(self, n: float) -> float:
        return _interpolate(self.target_ms, n) / 1000

    def pass_size(self, n: int) -> int:
        """The smallest measured target pass of at least n tokens (n itself past the largest)."""
        return min((size for size in self.target_ms if size >= n), default=n)

    def drafter_s(self, nodes: float) -> float:
        return _interpolate(self.drafter_ms, nodes) / 1000


def json_table(table: dict) -> dict[str, float]:
    """A measured table with string keys, as JSON has them."""
    return {str(k): v for k, v in table.items()}


def _interpolate(table: dict[int, float], x: float) -> float:
    """Piecewise linear through the measured points, extended linearly past the last two (plain Python: it
    runs a few dozen times per round, where numpy's call overhead would show next to a 7 ms plain pass)."""
    points = sorted(table.items())
    if len(points) == 1 or x <= points[0][0]:
        return float(points[0][1])
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + max(y1 - y0, 0.0) * (x - x1) / (x1 - x0)  # a noisy last point must not make larger passes cheaper


#ISFLAT


def is_flat(costs: Costs) -> bool:
    """Whether a target pass over 256 tokens costs at most FLAT_RATIO one token's (with readahead, once the weights
    are read: what a pass after growth costs): then it is bound by reading weights, and trees past 255 nodes, which
    cost 4-8x the compute, may still pay."""
    table = costs.warm_ms or costs.target_ms
    return 1 in table and 256 in table and table[256] <= FLAT_RATIO * table[1]


#FIT


def budget_limit(costs: Costs) -> int:
    """The largest budget --budget auto may choose: 255, or a LARGE one where the passes were measured that large
    (measure_costs does only where they are flat)."""
    measured = max(costs.target_ms)
    return max([MAX_LEAVES, *(b for b in LARGE if b <= measured)])


#TOKENS


def tokens_by_budget(tree: TokenTree, path: list[int], budgets: tuple[int, ...]) -> dict[int, int]:
    """Tokens a pass would have yielded with only the best b nodes of `tree`, for each b <= its size."""
    nodes = np.arange(1, len(tree))
    order = nodes[np.lexsort((nodes, tree.depth[nodes], -tree.score[nodes]))]  # growth's own ranking
    rank = np.empty(len(tree), np.int64)
    rank[order] = np.arange(len(order))
    path_ranks = rank[np.asarray(path[1:], np.int64)]
    result = {}
    for b in budgets:
        if b > len(tree) - 1:
            break
        inside = path_ranks < b
        accepted = len(inside) if inside.all() else int(np.argmin(inside))  # the path's prefix within the b best
        result[b] = accepted + 1
    return result


def prior_tokens(budget: int) -> float:
    return min(budget + 1.0, 1 + PRIOR_SLOPE * math.log2(1 + budget))


#AUTO
@dataclass
class AutoBudget:
    """The BudgetPolicy behind `--budget auto` (see the module's docstring)."""

    costs: Costs
    max_budget: int = 0  # 0: budget_limit(costs)
    # acceptance rule -> budget -> running tokens per pass (rounds of one rule say nothing of the other's yield)
    tokens: dict[str, dict[int, float]] = field(default_factory=dict)
    passes: dict[int, float] = field(default_factory=dict)  # budget -> running drafter passes per round
    grow_scale: float = 1.0  # measured / predicted growth time
    verify_scale: float = 1.0  # measured / predicted verify time with a tree (SSD: readahead overlaps growth)
    plain_ratios: deque = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))  # the same for plain rounds
    plain_streak: int = 0
    plain_for: int = 0  # plain rounds left before the next full comparison
    probe_every: int = FIRST_PROBE
    tree_streak: int = 0  # tree rounds since a larger budget was last tried
    explore_every: int = FIRST_PROBE  # tree rounds between tries of a larger budget; doubles after each
    chosen: list[int] = field(default_factory=list)  # budget per round, 0 = plain (for reports and tests)
    timing_held: bool = False  # hold_timing(): predictions from `costs` alone, no measured scale

    def __post_init__(self) -> None:
        self.max_budget = self.max_budget or budget_limit(self.costs)
        self._pass_ms: dict[int, float] = {}  # pass_s's measured times by size (seconds)
        self._plain_scale = 1.0  # plain_scale(): the median is taken once per plain round, asked for many times
        self._plain_rule = "match"  # the rule whose trees plain decoding last beat (plain_for counts down for it)

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None:
        """The next round's tree (None: plain decoding), for a round verified by `rule`."""
        if self.plain_for > 0 and rule == self._plain_rule:  # plain decoding won a moment ago, against trees of
            self.plain_for -= 1  # this rule: only plain rounds' timing has changed since
            best = self._probe([b for b in CANDIDATES if b <= min(self.max_budget, max_nodes - 1)], None, rule)
        else:
            best = self._best(max_nodes, rule)
        self.chosen.append(best or 0)
        return None if best is None else _config(best)

    def _best(self, max_nodes: int, rule: str) -> int | None:
        budgets = [b for b in CANDIDATES if b <= min(self.max_budget, max_nodes - 1)]
        rates = {b: self.expected_tokens(b, rule) / self.round_s(b, rule) for b in budgets}
        plain_rate = 1 / self.round_s(0)
        best = max(rates, key=rates.get) if rates else None
        if best is None or rates[best] <= plain_rate:
            self.plain_for, self._plain_rule = REVIEW_PLAIN, rule
            return self._probe(budgets, plain_rate, rule)
        self.probe_every = FIRST_PROBE  # trees pay (again)
        return self._explore(best, budgets, rates[best], rule)

    def _explore(self, best: int, budgets: list[int], best_rate: float, rule: str) -> int:
        """Trees of `best` nodes pay: every explore_every tree rounds (doubling), the next larger budget instead, if
        twice the tokens a pass expected of it would beat `best`."""
        larger = [b for b in budgets if b > best]
        self.tree_streak += 1
        if not larger or self.tree_streak < self.explore_every:
            return best
        self.tree_streak = 0
        self.explore_every = min(2 * self.explore_every, MAX_PROBE)
        return larger[0] if self._optimistic_rate(larger[0], rule) > best_rate else best

    def _probe(self, budgets: list[int], plain_rate: float | None, rule: str) -> int | None:
        """Plain decoding pays: try a tree now and then (backing off), if it could pay with twice the tokens per
        pass measured so far, and if the try costs at most 1/PROBE_SHARE of the plain decoding before it. The try
        includes the drafter catching up on the tokens decoded plainly meanwhile (one batched pass, but on a CPU
        with a small target in RAM it alone costs more than that share: there a tree is never tried again)."""
        self.plain_streak += 1
        if self.plain_streak < self.probe_every or (self.plain_streak - self.probe_every) % FIRST_PROBE:
            return None  # not yet; and a try that could not pay is asked again FIRST_PROBE rounds later, not each
        plain_s = self.round_s(0)
        catch_up = self.costs.drafter_s(self.plain_streak)
        hopeful = {b: rate for b in budgets if (rate := self._optimistic_rate(b, rule)) > (plain_rate or 1 / plain_s)
                   and self.plain_streak * plain_s >= PROBE_SHARE * (self.round_s(b, rule) + catch_up)}
        if not hopeful:
            return None
        self.plain_streak = 0
        self.probe_every = min(2 * self.probe_every, MAX_PROBE)
        return max(hopeful, key=hopeful.get)

    def _optimistic_rate(self, budget: int, rule: str = "match") -> float:
        return min(budget + 1.0, 2 * self.expected_tokens(budget, rule)) / self.round_s(budget, rule)

    def hold_timing(self, held: bool) -> None:
        """Held: rounds are predicted from the pass times the pair loaded with (cached per machine) and what rounds
        yielded, never from how long they took, so a seeded reply's trees, and so its draws, repeat run to run."""
        self.timing_held = held

    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None:
        """What a round verified by `rule` took and yielded (config None: it decoded plainly); with timing held, only
        what it yielded."""
        if self.timing_held:
            if config is not None:
                self._observe_yield(config, result, rule)
            return
        if config is None:
            predicted = self.costs.target_s(self.pass_tokens(len(result.tokens)))
            self.plain_ratios.append(result.verify_s / predicted)
            self._plain_scale = statistics.median(self.plain_ratios)
            return
        self.grow_scale = _blend(self.grow_scale, result.grow_s / self._grow_s(config, result.drafter_passes))
        verified = result.tree_size + len(result.tokens) - 1  # about: the previous round's accepted tokens ran too
        self.verify_scale = _blend(self.verify_scale,
                                   result.verify_s / self._verify_s(self.pass_tokens(verified), result.grow_s))
        self._observe_yield(config, result, rule)

    def _observe_yield(self, config: GrowConfig, result: RoundResult, rule: str) -> None:
        self.plain_streak = 0
        budget = config.budget
        self.passes[budget] = _blend(self.passes.get(budget), result.drafter_passes)
        if result.tree is not None and result.path is not None:
            table = self.tokens.setdefault(rule, {})
            for b, tokens in tokens_by_budget(result.tree, result.path, CANDIDATES).items():
                table[b] = _blend(table.get(b, prior_tokens(b)), tokens)

    def expected_tokens(self, budget: int, rule: str = "match") -> float:
        table = self.tokens.get(rule, {})
        held = max((table[b] for b in table if b < budget), default=1.0)  # a larger tree holds the smaller ones
        if budget in table:
            return max(table[budget], held)
        seen = [b for b in table if b < budget]
        if not seen:
            return prior_tokens(budget)
        base = max(seen)  # extrapolate from the largest budget seen, at the slope the acceptance so far gives
        yielded = max(table[base], held)
        slope = PRIOR_SLOPE * max(yielded - 1, 0.1) / (prior_tokens(base) - 1)
        return min(budget + 1.0, yielded + slope * math.log2((1 + budget) / (1 + base)))

    def pass_s(self, tokens: int) -> float:
        """A target pass over `tokens` tokens, as plain passes have lately run against the measured costs: the time of
        the smallest measured size that holds them. Between measured sizes the time is not a line: CPU kernels take
        tokens in groups (llama.cpp's repacked Q4_0 kernels here: 146 / 167 / 210 ms for 8 / 9 / 11 tokens, where the
        line through 8 and 16 says 174 for 11; docs/performance.md), so a lookup tree sized to a measured pass pays
        what was measured."""
        measured = self._pass_ms.get(tokens)
        if measured is None:
            measured = self._pass_ms[tokens] = self.costs.target_s(self.costs.pass_size(tokens))
        return (1.0 if self.timing_held else self._plain_scale) * measured

    def round_s(self, budget: int, rule: str = "match") -> float:
        """Predicted seconds of one round: growth plus the target pass (plain: the pass alone)."""
        if budget == 0:
            return self.plain_scale() * self.costs.target_s(self.pass_tokens(1))
        config = _config(budget)
        steps = self.passes.get(budget, config.max_steps)
        rerun = self.expected_tokens(budget, rule) - 1  # the previous round's accepted tokens run again
        grow_scale, verify_scale = (1.0, 1.0) if self.timing_held else (self.grow_scale, self.verify_scale)
        grow = grow_scale * self._grow_s(config, steps)
        return grow + verify_scale * self._verify_s(self.pass_tokens(budget + 1 + rerun), grow)

    def pass_tokens(self, tokens: float) -> float:
        """The tokens of a target pass that carries a round of `tokens`: those alone (LaneBudget: every lane's)."""
        return tokens

    def plain_scale(self) -> float:
        """Measured / predicted plain pass time: the median of the last PLAIN_WINDOW plain rounds (one stalled
        pass on a shared machine must not make trees look good); kept up to date by observe(). 1 with timing held."""
        return 1.0 if self.timing_held else self._plain_scale

    def _verify_s(self, tokens: float, grow_s: float) -> float:
        return self.costs.verify_s(tokens, grow_s)

    def _grow_s(self, config: GrowConfig, steps: float) -> float:
        return max(steps, 1) * self.costs.drafter_s(config.beams)


@functools.cache
def _config(budget: int) -> GrowConfig:
    return GrowConfig.for_budget(budget)


def _blend(old: float | None, new: float) -> float:
    return float(new) if old is None else (1 - SMOOTHING) * old + SMOOTHING * float(new)


@dataclass
class LaneBudget(AutoBudget):
    """`--budget auto` for a request whose target passes carry the other running requests' rounds too (serve
    --parallel N with a drafter, runtimes/llama_cpp/tree_lanes.py): AutoBudget's choice, with each pass priced for the
    `sharers()` requests that run now, each taken to grow a tree the size of this one's. Where a pass is bound by
    reading the weights (streamed from the drive), four requests' trees cost about what one's does and each keeps
    the tree it would grow alone; where the pass computes (in RAM on a CPU), each tree shrinks as more requests share
    it, down to plain decoding. The times it learns from are its own rounds', which ran beside the others.

    With timing held (a seeded reply) it prices a pass for this request alone, so that its trees, and the draws
    that depend on them, do not depend on who else is being served."""

    sharers: Callable[[], int] = lambda: 1
    # the most nodes a pass may verify, root included, where the plan bounds one request's (their logits, under a
    # memory limit; 0: no bound): its draft nodes are shared out among the requests (with timing held, among
    # `lanes`, so that the bound does not vary with the load either)
    pass_room: int = 0
    lanes: int = 1

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None:
        if self.pass_room:
            sharing = self.lanes if self.timing_held else max(1, self.sharers())
            max_nodes = min(max_nodes, max(1, (self.pass_room - 1) // sharing) + 1)
        return super().choose(max_nodes, rule)

    def pass_tokens(self, tokens: float) -> float:
        return tokens if self.timing_held else tokens * max(1, self.sharers())


class SharedBudget:
    """Trees for requests that share their target passes (serve --parallel N with a drafter): `total` nodes a pass,
    shared out among the `sharers()` requests that run now, so that a request's tree shrinks as more ride in the
    pass, and the pass stays about the size one request's tree would have had."""

    def __init__(self, total: int, sharers: Callable[[], int]):
        self.total, self.sharers = total, sharers

    def choose(self, max_nodes: int, rule: str = "match") -> GrowConfig | None:
        return _config(max(1, min(self.total // max(1, self.sharers()), max_nodes - 1)))

    def observe(self, config: GrowConfig | None, result: RoundResult, rule: str = "match") -> None:
        pass

    def pass_s(self, tokens: int) -> float | None:
        return None  # not measured: a shared pass takes every lookup branch it has room for

    def hold_timing(self, held: bool) -> None:
        pass  # no time chooses the trees
