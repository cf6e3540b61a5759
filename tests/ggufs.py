"""GGUF files for tests, made from real ones."""

from __future__ import annotations

import struct
from pathlib import Path

from runtimes.gguf_file import open_reader


def cut_layers(source: Path, out: Path, layers: int, drop: tuple[str, ...] = ()) -> Path:
    """A GGUF copy of `source` with its first `layers` layers and without the tensors `drop`: its header keys byte
    for byte but the block count, its tensors' blocks as they are (written raw: gguf's reader would take seconds to
    parse the 151936-token vocabulary that a raw copy carries over untouched)."""
    reader = open_reader(source)
    arch = reader.fields["general.architecture"].contents()
    kept = [t for t in reader.tensors if t.name not in drop
            and not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers)]
    keys = bytearray(reader.data[24 : reader.tensors[0].field.offset])  # after magic, version and the two counts
    count = reader.fields[f"{arch}.block_count"]
    at = count.offset - 24 + 8 + len(count.name) + 4  # the value: after the key's length, the key and the type
    struct.pack_into("<I", keys, at, layers)
    align = reader.alignment
    infos, offset = bytearray(), 0
    for tensor in kept:
        name = tensor.name.encode()
        infos += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(tensor.shape))
        infos += struct.pack(f"<{len(tensor.shape)}Q", *map(int, tensor.shape))
        infos += struct.pack("<IQ", int(tensor.tensor_type), offset)
        offset += -(-tensor.n_bytes // align) * align
    with out.open("wb") as file:
        version, n_keys = (int(reader.fields[key].contents()) for key in ("GGUF.version", "GGUF.kv_count"))
        file.write(b"GGUF" + struct.pack("<IQQ", version, len(kept), n_keys))
        file.write(keys + infos)
        file.write(bytes(-file.tell() % align))
        for tensor in kept:
            file.write(reader.data[tensor.data_offset : tensor.data_offset + tensor.n_bytes])
            file.write(bytes(-tensor.n_bytes % align))
    return out
