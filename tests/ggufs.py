"""GGUF files for tests: tiny ones written here (write_gguf) and real ones cut down (cut_layers)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
from edge.runtimes.gguf_file import open_reader
from gguf import GGMLQuantizationType, quants


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


TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
TOKENS = ["<unk>", "<s>", "</s>", *(f"tok{i}" for i in range(61))]


def write_gguf(path: Path, q6k: bool = False, tied: bool = True, tokens: list[str] = TOKENS,
               shape: bool = False) -> Path:
    """A tiny llama GGUF: a vocabulary, a chat template, a Q4_0 embedding; `shape`: the hyperparameters too (what
    `edge-spec plan` reads)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name("tiny")
    if shape:
        writer.add_block_count(1)
        writer.add_embedding_length(64)
        writer.add_feed_forward_length(64)
        writer.add_head_count(1)
        writer.add_head_count_kv(1)
        writer.add_context_length(256)
        writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(TEMPLATE)
    embedding = rng.standard_normal((len(tokens), 64), dtype=np.float32)  # [n_vocab, n_embd]
    writer.add_tensor(
        "token_embd.weight",
        quants.quantize(embedding, GGMLQuantizationType.Q4_0),
        raw_dtype=GGMLQuantizationType.Q4_0,
    )
    if not tied:
        # F16 on purpose: a separate head counts, the embedding lookup then does not.
        writer.add_tensor("output.weight", embedding.astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    if q6k:
        # Q6_K bytes need not be meaningful here: only the type and shape are read. 2 rows x 210 bytes.
        writer.add_tensor(
            "blk.0.ffn_down.weight", np.zeros((2, 210), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q6_K
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
