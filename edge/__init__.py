"""edge-spec's engine: token trees, SpecExec growth, lossless acceptance, the generation loop, chat, the
model registry. Pure Python + numpy; models are reached only through the protocols in `edge.protocols`."""
