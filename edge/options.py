"""How a pair is loaded: one dataclass of every load option, shared by the library, the CLI, the benchmarks and
the tests. Checked as it is made, so a bad value is one clear line before anything loads."""

from __future__ import annotations

import os
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

from edge.errors import UserError
from edge.grow import MAX_BUDGET

# sample-and-match, multi-candidate speculative sampling, sample-and-match on noise the drafter shares
# (edge/coupled.py), and auto: the one of residual and coupled that yields more, measured round by round
ACCEPT_RULES = ("match", "residual", "coupled", "auto")

PLACEMENTS = ("ram", "ssd")
TARGET_DTYPES = ("f16", "f32", "bf16", "q8_0", "q4_0", "as-is")
PROVIDERS = ("cpu", "cuda", "directml", "openvino", "openvino-gpu", "openvino-npu", "qnn")
OVERLAP_MODES = ("auto", "on", "off")  # drafting during the target's passes (edge/overlap.py); auto: where they wait
LOOKUP_MODES = ("on", "off", "keep")  # keep: earlier runs' replies too, kept in the cache (edge/lookup.py)
SPECULATE_MODES = ("on", "auto")  # the pair's drafter as named, or the plan's choice of a use (offload/choice.py)
NO_DRAFTER = ("lookup", "none")  # drafter values that load no drafter model: lookup drafting alone (or plain decoding)
MAX_THREADS = 4 * (os.cpu_count() or 1)  # more than this only waits on each other (a million would never start)
MAX_PARALLEL = 64  # lanes of one pass (llama.cpp's sequences allow 256; each lane holds a context of KV cells)
MIN_CTX = 256  # llama.cpp sizes a context in steps of 256 tokens: a smaller one would silently hold 256


@dataclass(frozen=True)
class LoadOptions:
    pair: str | None = None  # a pair of models.toml, a GGUF file or a Hugging Face user/repo:QUANT; None: the default
    target: Path | str | None = None  # a target GGUF file (or Hugging Face reference) instead of a pair
    drafter: Path | str | None = None  # with a model that is not a pair: its drafter (default: itself); "lookup" or
    # "none" (NO_DRAFTER), with any model: no drafter model, lookup drafting alone
    lookup: str = "on"  # drafting by lookup beside the drafter: on, off, or keep (earlier runs' replies too)
    models_file: Path | None = None  # models.toml to read pairs from (default: the packaged one)
    ctx: int | None = None  # context size in tokens (default: the pair's)
    budget: int | str | None = None  # draft nodes per tree, or "auto" (default: the pair's, auto unless it says)
    accept: str = "auto"  # acceptance rule when sampling: "match", "residual", "coupled" or "auto" (measured)
    threads: int | None = None  # CPU threads (default: all; the drafter one fewer while an SSD target reads ahead)
    gpu_layers: int | None = None  # target layers on a GPU (default: the plan's where a GPU is visible, else 0)
    provider: str | None = None  # onnxruntime execution provider for ONNX models (default: models.toml's)
    placement: str = "ram"  # "ram", or "ssd": the target read from its file every pass, as for one larger than RAM
    readahead: bool = True  # ssd: read the next pass's weights while the drafter works
    overlap: str = "auto"  # the drafter grows during the target's passes: on, off, or auto (on where the target's
    # layers are on a GPU, which leaves the CPU's cores to the drafter)
    mlock: bool = False  # lock the target's weights in RAM
    target_dtype: str | None = None  # rewrite the target with llama.cpp's quantizer first (cached); "as-is": the source
    drafter_runtime: str | None = None  # run the pair's drafter file on this runtime (default: models.toml's)
    drafter_vocab: int | None = None  # an onnx drafter's head of this many frequency-ranked tokens (0: the full head)
    drafter_quantize: str | None = None  # the drafter's file requantized first (a llama.cpp ftype, cached)
    # "auto": with budget auto, the plan weighs keeping the drafter against giving its memory to the target, and may
    # load the target alone, decoding plainly (on llama.cpp's own kernels where it is wholly in RAM) or by lookup;
    # "on": the pair's drafter, as named
    speculate: str = "on"
    # requests decoded together in lanes of one pass (a server's --parallel; Pair.lanes): each with its tree where the
    # pair keeps its drafter (a drafter each, the trees verified together), else plainly; the plan keeps room for
    # the lanes' KV caches
    parallel: int = 1

    def __post_init__(self) -> None:
        if self.models_file is not None and not isinstance(self.models_file, Path):
            object.__setattr__(self, "models_file", Path(self.models_file))
        if self.lookup not in LOOKUP_MODES:
            raise UserError(f"lookup must be one of {', '.join(LOOKUP_MODES)} (got {self.lookup!r})", "lookup")
        if self.drafter == "lookup" and self.lookup == "off":
            raise UserError("drafter lookup drafts by lookup alone: not with lookup off (use drafter none to decode "
                            "with the target alone)", "drafter")
        if self.pair is not None and self.target is not None:
            raise UserError("name one model: a pair or model file, or a target file, not both", "target")
        if self.ctx is not None and self.ctx < MIN_CTX:
            raise UserError(f"ctx must be at least {MIN_CTX} tokens (got {self.ctx})", "ctx")
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if self.accept not in ACCEPT_RULES:
            raise UserError(f"accept must be one of {', '.join(ACCEPT_RULES)} (got {self.accept!r})", "accept")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads must be at least 1 (got {self.threads})", "threads")
        if self.threads is not None and self.threads > MAX_THREADS:
            raise UserError(f"threads must be at most {MAX_THREADS} (got {self.threads}); this machine has "
                            f"{os.cpu_count()} cores", "threads")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise UserError(f"gpu_layers must be 0 or more (got {self.gpu_layers})", "gpu_layers")
        if self.provider is not None:
            if self.provider.lower() not in PROVIDERS:
                raise UserError(f"provider must be one of {', '.join(PROVIDERS)} (got {self.provider!r})", "provider")
            object.__setattr__(self, "provider", self.provider.lower())
        if self.speculate not in SPECULATE_MODES:
            raise UserError(f"speculate must be one of {', '.join(SPECULATE_MODES)} (got {self.speculate!r})",
                            "speculate")
        if self.overlap not in OVERLAP_MODES:
            raise UserError(f"overlap must be one of {', '.join(OVERLAP_MODES)} (got {self.overlap!r})", "overlap")
        if self.placement not in PLACEMENTS:
            raise UserError(f"placement must be ram or ssd (got {self.placement!r})", "placement")
        if self.placement == "ssd" and self.mlock:
            raise UserError("placement ssd streams the target from its file: not with mlock (weights locked in RAM)",
                            "placement")
        if self.target_dtype is not None and self.target_dtype not in TARGET_DTYPES:
            raise UserError(f"target_dtype must be one of {', '.join(TARGET_DTYPES)} (got {self.target_dtype!r})",
                            "target_dtype")
        if not 1 <= self.parallel <= MAX_PARALLEL:
            raise UserError(f"parallel must be 1 to {MAX_PARALLEL} (got {self.parallel})", "parallel")
        if self.parallel > 1 and self.drafter in NO_DRAFTER:  # lanes decode plainly: nor lookup trees
            object.__setattr__(self, "lookup", "off")
        if self.drafter_vocab is not None and self.drafter_vocab < 0:
            raise UserError(f"the drafter's vocabulary must be 0 (the full head) or more (got {self.drafter_vocab})")


    @property
    def drafter_model(self) -> bool:
        """Whether a drafter model loads (not with drafter lookup or none)."""
        return str(self.drafter) not in NO_DRAFTER

    @property
    def lookup_drafts(self) -> bool:
        return self.lookup != "off"


def check_max_tokens(value: int) -> int:
    """A reply's length limit: at least one token."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise UserError(f"max_tokens must be a whole number of tokens (got {value!r})", "max_tokens")
    if value < 1:
        raise UserError(f"max_tokens must be at least 1 (got {value})", "max_tokens")
    return value


def parse_budget(value: int | str | None) -> int | str | None:
    """None (the pair's), "auto", or draft nodes per tree in 1..MAX_BUDGET; a string of digits counts as a number."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        if not value.isdigit():
            raise UserError(f"budget takes a number of draft nodes or auto (got {value!r})", "budget")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"budget takes a number of draft nodes or auto (got {value!r})", "budget")
    if value < 1:
        raise UserError(f"budget must be at least 1 draft node (got {value}); plain decoding drafts none", "budget")
    if value > MAX_BUDGET:
        raise UserError(f"budget can be at most {MAX_BUDGET} draft nodes (got {value})", "budget")
    return value
