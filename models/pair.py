"""A loaded pair: a target and a drafter ready to decode (models/loading.py loads one), its prompts rendered with
the chat template, its decoders and tree budgets, --budget auto's pass times (measured once, kept: models/kept.py),
and its drafter swapped for another (benchmarks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from edge.models import mapped
from edge.models.cache import file_stamp
from edge.models.kept import (
    keep_pass_times,
    keep_plain_pass,
    keep_rule_yields,
    keep_streamed_pass,
    pass_times,
    pass_times_key,
    rule_yields,
    rule_yields_key,
    save_corpus,
)
from edge.models.opening import drafter_model, head_ids, open_drafter, phase
from edge.models.registry import PairSpec
from edge.models.sources import model_path

from edge.chat import Prompt, prompt_tokens
from edge.chat_template import ChatTemplate
from edge.errors import ModelFault, UserError
from edge.generate import Decoder
from edge.grow import MAX_LEAVES, GrowConfig
from edge.lookup import Corpus, Lookup
from edge.options import LoadOptions
from edge.policy import Measured
from edge.protocols import Drafter, Target
from edge.sampling import LLAMA_DEFAULTS, SamplingConfig

if TYPE_CHECKING:
    from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

    from edge.budget import AutoBudget, Costs

Report = Callable[[str], None]

NESTED = "· "  # load_seconds keys of phases that ran inside the one before (their times overlap)
# Timing passes for --budget auto needs some context; what it says does not matter.
MAX_PRINCIPALS = 64  # decoders kept for as many principals (a server's API keys); the longest idle goes first
CALIBRATION_TEXT = "The committee met on Tuesday to review the budget, and after a long discussion it agreed to"


def _quiet(_message: str) -> None:
    pass


@dataclass(eq=False)
class Pair:
    """A loaded target and drafter, ready to decode. Close it (or use `with`) to free their native memory."""

    name: str
    target: Target
    drafter: Drafter | None
    template: ChatTemplate | None  # None: a base model, prompts are completed as they are
    budget: int | str  # draft nodes per tree, or "auto"
    lossless_warning: str | None  # why this target's output may differ from plain decoding, if it may
    spec: PairSpec
    options: LoadOptions
    models_file: Path | None = None  # the models.toml the pair came from
    drafter_threads: int | None = None  # None: all cores
    sampling: SamplingConfig = LLAMA_DEFAULTS  # the model's recommended, else llama.cpp's (the server's defaults)
    recommended: tuple[str, ...] = ()  # the fields of `sampling` the model's file recommends (chat adds a penalty)
    costs: Costs | None = None  # measured pass times for --budget auto, once per load
    load_seconds: dict[str, float] = field(default_factory=dict)  # where loading took its time, by phase
    report: Report = field(default=_quiet, repr=False)
    streamed: bool = False  # the plan put the target on the drive (larger than RAM): the kernel streams it
    corpus: Corpus | None = None  # earlier replies lookup drafts from (None: lookup off); every decoder shares it
    max_tree: int | None = None  # auto's largest tree where the plan bounds it (a memory limit); None: as measured
    plan_note: str | None = None  # the use of the memory the plan chose and why (speculate auto), in one line
    plan_use: str = "drafter"  # that use: "drafter" (the pair as named), "plain" or "lookup" (the target alone)
    plan_rates: dict[str, float] = field(default_factory=dict)  # where the plan chose: tokens/s it predicted, by use
    # each acceptance rule's measured tokens a pass, by sampling and budget: every decoder of the pair adds to it, and
    # --accept auto chooses by it (edge.rules.RuleChoice); kept between runs (models/kept.py)
    rule_choices: Measured = field(default_factory=Measured, repr=False)
    # Principals (a server's API keys): each has its own decoder (so its own acceptance tables and rule measurements,
    # and no prompt cache reuse across principals) and its own earlier replies for lookup, unless shared_replies.
    shared_replies: bool = False
    closed: bool = False
    _decoders: dict[str | None, tuple[tuple, Decoder]] = field(default_factory=dict, repr=False)  # by principal
    _corpora: dict[str, Corpus] = field(default_factory=dict, repr=False)  # named principals' earlier replies
    _choices: dict[str, Measured] = field(default_factory=dict, repr=False)  # named principals' rule measurements
    # One generation at a time (generating) and no model closed under a running step (stepping, close).
    _turn: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _turn_thread: int | None = field(default=None, repr=False)
    _state: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _busy: bool = field(default=False, repr=False)
    _stamps: dict[Path, tuple[int, ...]] = field(default_factory=dict, repr=False)  # the model files as loaded

    def __post_init__(self) -> None:
        for model in (self.target, self.drafter):
            if model is not None and model.path.is_file():
                self._stamps[model.path] = file_stamp(model.path)[:3]
                mapped.watch(model.path)
        self.rule_choices = self._measured()

    def _yields_key(self) -> str | None:
        """Where this pair's rule yields are kept (models.kept.rule_yields_key); None without a drafter file."""
        if self.drafter is None or not self.target.path.exists() or not self.drafter.path.exists():
            return None
        kind = f"{type(self.drafter).__name__}:{self.drafter.vocab}"
        return rule_yields_key(self.target.path, self.drafter.path, kind)

    def _keep_rule_yields(self) -> None:
        """Keep what the drafter's rules yielded for the next run (on closing, and before the drafter is swapped)."""
        if (key := self._yields_key()) is not None:
            keep_rule_yields(key, self.rule_choices.to_json())

    def _measured(self) -> Measured:
        """What the pair's decoders measure, starting from what an earlier run kept for this pair."""
        key = self._yields_key()
        if key is None:
            return Measured()
        kept = rule_yields(key)
        return Measured(kept.get)

    @property
    def placement(self) -> str:
        """"ssd" where the target is read from its file every pass: larger than RAM (the kernel evicts it), or
        --placement ssd (edge-spec evicts it after each pass); else "ram"."""
        return "ssd" if self.streamed else self.options.placement

    def residency(self) -> tuple[int, int] | None:
        """A target the plan streams in a window (offload/window.py): the bytes of it that stay in RAM, and those a
        pass reads from the drive; None for the rest."""
        from edge.offload.window import WindowedTarget

        if not isinstance(self.target, WindowedTarget):
            return None
        return self.target.streamer.resident_bytes, self.target.streamer.streamed_bytes

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the models' native memory (llama.cpp contexts and weights, onnxruntime sessions); with lookup keep,
        save the replies lookup drafts from for the next run. A step running on another thread ends first; a
        generation resumed afterwards raises UserError. Closing twice does nothing."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            while self._busy:
                self._state.wait()
        if self.corpus is not None and self.options.lookup == "keep":
            save_corpus(self.corpus, self.target.path, self.report)
        self._keep_plain_pass()
        self._keep_streamed_pass()
        self._keep_rule_yields()
        for model in (self.drafter, self.target):
            if model is not None:
                model.close()
        for path in self._stamps:
            mapped.forget(path)
        self.drafter = None
        self._decoders.clear()

    def _keep_plain_pass(self) -> None:
        """A target that decoded plainly in RAM on llama.cpp's own kernels leaves its one-token pass time for the
        next plan (models.kept.keep_plain_pass): the plan's RAM rate is otherwise assumed."""
        if self.placement != "ram" or self.options.gpu_layers:
            return
        from edge.runtimes.llama_cpp.models import PlainTarget

        if isinstance(self.target, PlainTarget):
            keep_plain_pass(self.target.path, self.target.one_token_s, self.target.one_token_passes)

    def _keep_streamed_pass(self) -> None:
        """A target streamed in a window leaves its one-token passes' times for the next plan
        (models.kept.keep_streamed_pass): the mapped rate and the drive's rate during passes are otherwise assumed."""
        from edge.offload.window import WindowedTarget

        if isinstance(self.target, WindowedTarget):
            keep_streamed_pass(self.target.path, asdict(self.target.timing), self.target.threads)

    def check_open(self) -> None:
        """Refuse a closed pair, and one whose model files changed on disk since they loaded (their weights are
        mapped from the file: `cp new.gguf live.gguf` changes what a running model computes, or truncates it)."""
        self._refuse_closed()
        for path, stamp in self._stamps.items():
            try:
                now = file_stamp(path)[:3]
            except OSError:
                now = None
            if now != stamp:
                raise ModelFault(f"{path} changed on disk since {self.name} loaded it (replaced, edited or removed): "
                                 "load it again (restart the command or the server)")

    def _refuse_closed(self) -> None:
        if self.closed:
            raise UserError(f"the pair {self.name} is closed: load it again (edge.load) to generate")

    @contextmanager
    def generating(self) -> Iterator[None]:
        """This pair's turn for one generation: another thread's waits until it ends; a second generation on the
        same thread (a stream_generate not run to its end, then another) is refused, as waiting would never end.
        The turn ends with the generation: run to its end, closed, or dropped (a generator's close)."""
        self.check_open()
        if self._turn_thread == threading.get_ident():
            raise UserError(f"the pair {self.name} is already generating on this thread (a stream_generate not run to "
                            "its end): finish it or close() it first; a pair runs one generation at a time")
        with self._turn:
            self._turn_thread = threading.get_ident()
            try:
                self.check_open()  # closed while this waited
                yield
            finally:
                self._turn_thread = None

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """The models at work (a prompt read, a token decoded): close() waits for it to end; refused once closed."""
        with self._state:  # only the closed flag here: the files are checked once a generation (generating)
            self._refuse_closed()
            self._busy = True
        try:
            yield
        finally:
            with self._state:
                self._busy = False
                self._state.notify_all()

    def prompt_tokens(self, prompt: Prompt, raw: bool | None = None) -> list[int]:
        """Token ids for a prompt: chat messages rendered with the pair's template; text in the template too, unless
        `raw` (completed as it is; None: raw only for a base model, which has no template); token ids as they are."""
        tokenizer = self.target.tokenizer
        if isinstance(prompt, bytes | bytearray | memoryview):  # its items are ints: it would pass for token ids
            raise UserError("a prompt is text, chat messages or token ids, not bytes: decode the bytes to text first",
                            "prompt")
        if not isinstance(prompt, str) and all(isinstance(token, Integral) for token in prompt):
            ids = [int(token) for token in prompt]  # type: ignore[arg-type]
            if (wrong := next((token for token in ids if not 0 <= token < self.target.n_vocab), None)) is not None:
                raise UserError(f"token id {wrong} is not in {self.name}'s vocabulary (ids 0 to "
                                f"{self.target.n_vocab - 1})", "prompt")
            return ids
        if isinstance(prompt, str):
            if raw or (raw is None and self.template is None):
                return tokenizer.tokenize(prompt, add_special=True, parse_special=True)
            messages: list[Mapping[str, str]] = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)  # type: ignore[arg-type]
            if raw:
                raise UserError("chat messages are rendered with the pair's chat template; give text to complete raw")
        if self.template is None:
            raise UserError(f"{self.name} has no chat template (a base model): complete the prompt as-is instead "
                            "(raw)", "raw")
        return prompt_tokens(tokenizer, self.template.render(_messages(messages)), self.template.bos_token)

    def decoder(self, sampling: SamplingConfig, speculate: bool = True, budget: int | str | None = None,
                principal: str | None = None) -> Decoder:
        """A new Decoder for this pair: plain without `speculate`, a fixed budget, or --budget auto's policy; its trees
        take lookup's branches too (over the earlier replies of `principal`, or of everyone with shared_replies),
        unless lookup is off."""
        self.check_open()
        budget = self.budget if budget is None else budget
        corpus = self.corpus_of(principal)
        proposer = None if corpus is None else Lookup(corpus)
        choices = self.rule_choices if principal is None else self._choices.setdefault(principal, Measured())
        if not speculate or (self.drafter is None and proposer is None):
            # the rule still says how a sampled reply draws (coupled: as the pair's trees would)
            return Decoder(self.target, None, None, sampling, accept=self.options.accept, choices=choices)
        policy = self.auto_budget() if budget == "auto" else None
        if policy is None:
            self.fit_budget(int(budget))
            policy = GrowConfig.for_budget(int(budget))
        return Decoder(self.target, self.drafter, policy, sampling, accept=self.options.accept, lookup=proposer,
                       overlap=self.overlaps, choices=choices)

    def corpus_of(self, principal: str | None) -> Corpus | None:
        """The earlier replies `principal`'s trees draft from: the pair's own for None (one principal: everyone) or
        with shared_replies, else the principal's own (None with lookup off)."""
        if self.corpus is None or principal is None or self.shared_replies:
            return self.corpus
        if principal not in self._corpora:
            self._corpora[principal] = Corpus(self.corpus.max_tokens)
        return self._corpora[principal]

    @property
    def overlaps(self) -> bool:
        """Whether the drafter grows during the target's passes (edge/overlap.py): --overlap on, or auto where the
        target's pass leaves the cores to the drafter (layers on a GPU). A target computing on the CPU's cores shares
        them with the drafter: from the SSD here, with no read-ahead, overlap slowed its passes from 1.0 to 1.6-1.9 s
        (docs/performance-log.md, "Overlapped drafting")."""
        mode = self.options.overlap
        if mode != "auto":
            return mode == "on"
        return bool(self.options.gpu_layers)

    def reused_decoder(self, sampling: SamplingConfig, speculate: bool = True, budget: int | str | None = None,
                       principal: str | None = None) -> Decoder:
        """`principal`'s decoder, kept from call to call while the tree policy stays the same: while no other
        principal's ran since, the KV caches still hold its last prompt and reply, so a prompt that extends them (a
        chat's next turn) runs only its new tokens. Another principal's decoder starts its caches over (Decoder.load):
        a prompt cache shared across principals would tell one what another asked."""
        key = (speculate, self.budget if budget is None else budget, self.drafter is not None)
        kept = self._decoders.pop(principal, None)
        if kept is None or kept[0] != key:
            kept = key, self.decoder(sampling, speculate, budget, principal)
        else:
            kept[1].set_sampling(sampling)
        self._decoders[principal] = kept  # the newest last: past MAX_PRINCIPALS the longest idle is dropped
        while len(self._decoders) > MAX_PRINCIPALS:
            del self._decoders[next(iter(self._decoders))]
        return kept[1]

    def lanes(self, n: int, trees: bool = False) -> TreeLanes:
        """`n` lanes over the target's weights (runtimes/llama_cpp/tree_lanes.py): requests that decode together, one
        pass for all, each in its seqs of one KV cache of n contexts of the pair's; with `trees`, each request's tree
        in that pass (lane_drafter gives each lane its drafter), else its one token. Refused where the target
        cannot: another runtime, or one loaded on llama.cpp's own kernels for plain decoding alone, whose rounding
        changes with the batch (a lane's reply would then depend on the others')."""
        from edge.runtimes.llama_cpp.models import LlamaTarget, PlainTarget
        from edge.runtimes.llama_cpp.tree_lanes import TreeLanes

        from edge.protocols import TargetWrapper

        self.check_open()
        inner = self.target
        while isinstance(inner, TargetWrapper):  # a streamed target's read-ahead around the llama.cpp one
            inner = inner.inner
        if not isinstance(inner, LlamaTarget) or isinstance(inner, PlainTarget):
            raise UserError(f"{self.name}'s target cannot decode several requests in one pass (it runs on "
                            f"{self.target.runtime}{' stock kernels' if isinstance(inner, PlainTarget) else ''}): "
                            "set `parallel` to 1", "parallel")
        from edge.offload.ssd import SsdTarget

        # One KV cache for every lane (TreeLanes, plain or not), not a stream each: llama.cpp splits a pass over
        # streams into micro-batches, one for each run of consecutive seq ids that the batch lists in order (lanes 0
        # and 2 busy: two), and each micro-batch computes every layer again: for a streamed target it reads the
        # streamed weights again (Qwen2.5-Coder-1.5B under 1049 MiB: a pass of 4 lanes' tokens computed its first
        # layer 2-4 times, 668 ms against a lone lane's 182). A padded pass (kernels.lane_padding) holds only so too.
        streamed = self.target if isinstance(self.target, SsdTarget) else None
        if streamed is None:
            return TreeLanes(inner, n, self.target.n_ctx, trees=trees)
        ssd = streamed.ssd

        def before(tokens: np.ndarray) -> None:  # as SsdTarget.verify does around its own passes
            ssd.wait_evicted()
            ssd.fetch_rows(tokens)

        return TreeLanes(inner, n, self.target.n_ctx, before, ssd.after_pass, trees=trees)

    def lane_drafter(self) -> Drafter:
        """A drafter of the lane's own over the pair's drafter's weights (its own KV cache): for TreeLanes."""
        forked = None if self.drafter is None else self.drafter.fork()
        if forked is None:
            raise UserError(f"{self.name}'s drafter cannot draft for several requests at once (it runs on "
                            f"{self.drafter.runtime if self.drafter else 'no runtime'}): set `parallel` to 1 or "
                            "leave the drafter out", "parallel")
        return forked

    def forget_replies(self) -> None:
        """Lookup drafts from no earlier reply, as a load with lookup on starts (lookup stays on)."""
        if self.corpus is not None and (self.corpus.replies or self._corpora):
            self.corpus = Corpus(self.corpus.max_tokens)
            self._corpora.clear()
            self._decoders.clear()  # their lookups hold the old corpora

    def fit_budget(self, budget: int) -> None:
        """Room for trees of `budget` draft nodes: a llama.cpp target and drafter get a larger batch and KV room over
        the same weights (their caches start empty), sized for what is asked, not for every run (a 2049-node batch
        over Gemma's 262144-token vocabulary holds 2 GB of logits). An onnx target verifies 256 nodes at most."""
        from edge.offload.tuning import fit_trees

        before = self.target.max_tree
        if budget + 1 <= before and (self.drafter is None or budget <= self.drafter.expand_capacity):
            return
        if not fit_trees(self.target, self.drafter, budget + 1):
            raise budget_refused(self.name, budget, before)
        self._decoders.clear()  # the caches were emptied

    def auto_budget(self) -> AutoBudget:
        """--budget auto's policy; its pass times are measured once per machine, placement and pair (cached)."""
        from edge.budget import AutoBudget, budget_limit

        costs = self.pass_costs()
        limit = budget_limit(costs)  # the larger trees its measured flat passes allow, within the plan's bound
        self.fit_budget(limit if self.max_tree is None else min(limit, self.max_tree - 1))
        return AutoBudget(costs)

    def pass_costs(self, large: bool = True) -> Costs:
        """The target's and the drafter's measured pass times (edge.budget.Costs), once per machine, placement and
        pair (cached). `large`: where the passes are flat, also passes of 1024 and 2048 tokens, for which the target
        and the drafter are enlarged (not for lanes, whose trees are bounded by their seq ids)."""
        from edge.offload.tuning import measure_costs

        from edge.budget import Costs

        if self.costs is None:
            with phase(self.load_seconds, "pass times (--budget auto)"):
                key = self._costs_key()
                known = pass_times()
                if key is not None and not large and key not in known:  # lanes' costs: the large ones do as well
                    key += " without large passes"
                if key is not None and key in known:
                    try:
                        self.costs = Costs.from_json(known[key])
                    except (KeyError, TypeError, ValueError, AttributeError) as problem:
                        self.report(f"the cached pass times for this pair are damaged ({problem}): timing them again")
                if self.costs is None:
                    self.report("timing the target's and the drafter's passes for --budget auto (once for this "
                                "machine and pair; kept in the cache)")
                    prefix = self.target.tokenizer.tokenize(CALIBRATION_TEXT, add_special=True, parse_special=False)
                    started = time.perf_counter()
                    self.costs = measure_costs(self.target, self.drafter, prefix, self.target.max_tree, large)
                    self.report(f"timed the passes in {time.perf_counter() - started:.1f} s")
                    if key is not None:
                        keep_pass_times(key, self.costs.to_json())
        return self.costs

    def swap_drafter(self, runtime_name: str | None = None, vocab: int | None = None, quantize: str | None = None,
                     report: Report = _quiet) -> Drafter:
        """Close the pair's drafter and open the same file as another drafter: on another runtime, with a
        `vocab`-token head (onnx; 0: the full head), or requantized. One drafter at a time: idle llama.cpp thread
        pools slow the others down. Benchmarks compare drafters this way."""
        from edge.runtimes import traits

        if traits(self.spec.target.runtime).shared_cache:
            raise UserError("another drafter needs a pair whose target keeps its own KV cache (a QuantSpec pair's "
                            "target shares one with its drafter)")
        model = drafter_model(self.spec.drafter, runtime_name, vocab, quantize)
        head_ids(self.spec, model)  # a missing vocabulary fails before the pair's drafter is closed
        self.drop_drafter()
        self.drafter = open_drafter(self.spec, model, self.target.path, self.drafter_threads, 0, report,
                                    max_tree=self.target.max_tree)
        self.rule_choices = self._measured()
        return self.drafter

    def drop_drafter(self) -> None:
        """Close the drafter: the target decodes alone, or drafts by lookup (benchmarks compare the two)."""
        if self.drafter is not None:
            self._keep_rule_yields()
            self.drafter.close()
            self.drafter = None
        self._decoders.clear()
        self.costs = None
        self.rule_choices = Measured()  # what the rules yielded was the old drafter's
        self._choices.clear()

    def _costs_key(self) -> str | None:
        path = model_path(self.spec.target)
        if path is None or not path.is_file():
            return None
        drafter = "lookup" if self.drafter is None else f"{type(self.drafter).__name__}:{self.drafter.vocab}"
        streamer = self.target.streamer
        readahead = None if streamer is None else streamer.readahead
        if streamer is not None and streamer.window is not None:  # offload/window.py: read ahead within a window
            readahead = f"{readahead} window {streamer.window >> 20} MiB"
        return pass_times_key(path, drafter, self.placement, str(readahead), self.drafter_threads, self.max_tree)


def tree_nodes(budget: int | str) -> int:
    """Nodes a verify pass must hold for `budget`: 256 for auto (it enlarges the target where larger trees can pay,
    Pair.auto_budget) and any budget within llama.cpp's sequence ids; the budget and the root past that."""
    return int(budget) + 1 if budget != "auto" and int(budget) > MAX_LEAVES else MAX_LEAVES + 1


def budget_refused(name: str, budget: int, max_tree: int) -> UserError:
    return UserError(f"budget {budget}: {name} verifies at most {max_tree} nodes a pass (an onnx target, QuantSpec); "
                     f"use {max_tree - 1} or less, or auto", "budget")


def _messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as the template expects them: role and content strings."""
    checked = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise UserError("a chat message is a {\"role\": ..., \"content\": ...} mapping of strings "
                            f"(got {message!r:.80})")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked
