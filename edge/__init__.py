"""edge-spec: run models larger than your memory at interactive speed, with lossless tree speculative decoding.

The library's calls (edge/api.py):

    import edge
    with edge.load("smollm2-135m") as pair:                      # or edge.load(target="big.gguf", drafter="small.gguf")
        reply = edge.generate(pair, "Name three colors.", max_tokens=32)
        print(reply.text, reply.stats.tokens_per_pass)

The package is also the engine: token trees, SpecExec growth, lossless acceptance, sampling, the generation loop and
chat sessions, in pure Python and numpy. It reaches models only through the protocols in `edge.protocols`; loading
them is library code above it (models/), imported when `edge.load` first runs.

`edge` is edge-spec's one import name: the rest ships inside it (edge.models, edge.runtimes, edge.quant, edge.offload,
edge.cli, edge.serve), so an application's own `models` or `serve` module never meets ours. The repository keeps
those as top-level folders (the design's layout); in a checkout they are found through this package's path, in a
wheel they are its subfolders (pyproject.toml).
"""

from pathlib import Path as _Path

_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "runtimes").is_dir():  # a checkout, not a wheel
    __path__.append(str(_checkout))

from edge.api import Generation, generate, load, stream_generate
from edge.errors import UserError
from edge.generate import Stats, Step
from edge.options import LoadOptions
from edge.sampling import SamplingConfig

__all__ = ["Generation", "LoadOptions", "SamplingConfig", "Stats", "Step", "UserError", "generate", "load",
           "stream_generate"]
