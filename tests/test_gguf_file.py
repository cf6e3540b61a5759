"""check_gguf on tiny GGUF files written here: metadata, and one clear error per kind of bad file."""

import hashlib
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from edge.runtimes.gguf_file import GGUFInfo, check_gguf, check_same_vocab, vocab_tokens

from edge.errors import UserError
from tests.ggufs import TEMPLATE, TOKENS, write_gguf


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


def test_reads_metadata(tiny: Path) -> None:
    info = check_gguf(tiny)
    assert info == GGUFInfo(
        path=tiny.resolve(),
        architecture="llama",
        name="tiny",
        n_vocab=len(TOKENS),
        chat_template=TEMPLATE,
        bos_token_id=1,
        eos_token_id=2,
        add_bos=True,
        weight_types=frozenset({"Q4_0"}),
        file_type="MOSTLY_Q4_0",
        n_params=len(TOKENS) * 64 + 64,
        file_size=tiny.stat().st_size,
        vocab_digest=hashlib.sha256(b"".join(len(t).to_bytes(8, "little") + t.encode() for t in TOKENS)).hexdigest(),
    )
    assert vocab_tokens(tiny) == [token.encode() for token in TOKENS]


def test_a_drafter_must_share_the_targets_vocabulary(tmp_path: Path) -> None:
    target = write_gguf(tmp_path / "target.gguf")
    check_same_vocab(target, write_gguf(tmp_path / "same.gguf", q6k=True))  # other weights, the same vocabulary
    check_same_vocab(target, write_gguf(tmp_path / "padded.gguf", tokens=[*TOKENS, "[PAD0]", "[PAD1]"]))
    other = write_gguf(tmp_path / "other.gguf", tokens=[*TOKENS[:5], "other", *TOKENS[6:]])
    with pytest.raises(UserError, match=r"other.gguf does not share the target's vocabulary \(1 tokens differ, "
                                        r"first 5 \(b'tok2' vs b'other'\)\)"):
        check_same_vocab(target, other)
    longer = write_gguf(tmp_path / "longer.gguf", tokens=[*TOKENS, "more"])
    with pytest.raises(UserError, match="sizes differ"):
        check_same_vocab(target, longer)


def test_untied_embedding_is_a_lookup_not_a_matmul(tmp_path: Path) -> None:
    info = check_gguf(write_gguf(tmp_path / "untied.gguf", tied=False))
    assert info.weight_types == frozenset({"F16"})


def test_file_replaced_on_disk_is_read_again(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf")
    assert check_gguf(path).weight_types == {"Q4_0"}
    write_gguf(path, q6k=True)
    assert check_gguf(path).weight_types == {"Q4_0", "Q6_K"}


def _cut(source: Path, n_bytes: int, tmp_path: Path) -> Path:
    cut = tmp_path / f"cut{n_bytes}.gguf"
    cut.write_bytes(source.read_bytes()[:n_bytes])
    return cut


def test_cut_in_tensor_data_is_truncated(tiny: Path, tmp_path: Path) -> None:
    size = tiny.stat().st_size
    message = rf"is truncated: {size - 100} bytes, the header says at least {size};"
    with pytest.raises(UserError, match=message):
        check_gguf(_cut(tiny, size - 100, tmp_path))


@pytest.mark.parametrize("n_bytes", [3, 10, 30, 200, 700])
def test_cut_in_header_is_truncated(tiny: Path, tmp_path: Path, n_bytes: int) -> None:
    # 10: inside the counts; 30: a key; 200: the token list; 700: the chat template or tensor infos.
    with pytest.raises(UserError, match="is truncated"):
        check_gguf(_cut(tiny, n_bytes, tmp_path))


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00{}")
    with pytest.raises(UserError, match=r"is not a GGUF file \(starts with b'\\x08\\x00\\x00\\x00'\)"):
        check_gguf(path)


def test_empty_file_is_said_to_be_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.touch()
    with pytest.raises(UserError, match=r"empty.gguf is empty \(0 bytes\)"):
        check_gguf(path)


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"model file .*nope\.gguf not found"):
        check_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="is a directory"):
        check_gguf(tmp_path)


def test_lossless_guarantee(monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.runtimes.llama_cpp.kernels import FORCE_TILED, TILED, lossless_guarantee

    monkeypatch.setenv(TILED, "0")  # as edge-spec sets it (kernels.prefer_invariant_kernels), whatever loaded before
    monkeypatch.delenv(FORCE_TILED, raising=False)
    fix = "--target-dtype q8_0"
    assert lossless_guarantee(frozenset({"Q4_0", "Q4_1", "Q8_0"}), "bf16", fix) is None
    assert lossless_guarantee(frozenset({"Q4_K", "Q6_K", "Q5_0"}), "bf16", fix) is None  # every batch on one kernel
    message = lossless_guarantee(frozenset({"Q4_0", "F16"}), "q8_0", fix)
    assert message is not None and message.startswith("weights of type F16 are not batch-invariant")
    assert "Q4_0," not in message and message.endswith(f"rewrite the target as q8_0: {fix})")
    kv_message = lossless_guarantee(frozenset({"Q4_0"}), "f16", fix)
    assert kv_message is not None and "f16 KV cache" in kv_message
    monkeypatch.delenv(TILED, raising=False)  # the user chose stock llama.cpp: the tiled kernel from 8 tokens
    monkeypatch.setenv(FORCE_TILED, "0")
    message = lossless_guarantee(frozenset({"Q4_K", "Q6_K"}), "bf16", fix)
    assert message is not None and "Q4_K, Q6_K are not" in message and f"{FORCE_TILED}=1" in message
    monkeypatch.setenv(FORCE_TILED, "1")  # the tiled kernel at every batch size
    assert lossless_guarantee(frozenset({"Q4_K", "Q6_K"}), "bf16", fix) is None
    monkeypatch.setenv(TILED, "0")  # no tiled kernel: the dot-product kernels run every batch
    monkeypatch.delenv(FORCE_TILED)
    assert lossless_guarantee(frozenset({"Q4_K", "Q6_K"}), "bf16", fix) is None


def test_repacked_buffers_are_kept_where_they_are_batch_invariant() -> None:
    from edge.runtimes.llama_cpp.kernels import keeps_repacking

    assert keeps_repacking(frozenset({"Q4_0", "Q8_0"}))
    assert not keeps_repacking(frozenset({"Q4_K", "Q6_K"}))


def test_lossless_guarantee_of_a_real_tiny_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edge.runtimes.llama_cpp.kernels import FORCE_TILED, TILED, lossless_guarantee

    q4, q6 = (check_gguf(write_gguf(tmp_path / name, q6k=name == "q6.gguf")).weight_types
              for name in ("q4.gguf", "q6.gguf"))
    monkeypatch.setenv(TILED, "0")  # as edge-spec sets it, whatever loaded before (a plain target restores stock)
    monkeypatch.delenv(FORCE_TILED, raising=False)
    assert lossless_guarantee(q4, "bf16", "") is None and lossless_guarantee(q6, "bf16", "") is None
    monkeypatch.delenv(TILED, raising=False)
    monkeypatch.delenv(FORCE_TILED, raising=False)
    assert "Q6_K" in (lossless_guarantee(q6, "bf16", "") or "")


def test_unreadable(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # chmod cannot stop root, which CI often is: fail the open itself.
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(UserError, match="permission denied"):
        check_gguf(tiny)


def test_a_misaligned_tensor_is_refused_as_invalid_not_truncated(tiny: Path, tmp_path: Path) -> None:
    reader = gguf.GGUFReader(tiny)
    field = reader.tensors[0].field  # name length, name, n_dims, dims, type, then the data offset (uint64)
    at = field.offset + sum(part.nbytes for part in field.parts) - 8
    blob = bytearray(tiny.read_bytes())
    blob[at:at + 8] = (int.from_bytes(blob[at:at + 8], "little") + 1).to_bytes(8, "little")
    hostile = tmp_path / "misaligned.gguf"
    hostile.write_bytes(bytes(blob))
    with pytest.raises(UserError, match=r"not a valid GGUF file .*not a multiple of the file's alignment 32") as info:
        check_gguf(hostile)
    assert "truncated" not in str(info.value)


def test_recommended_sampling_is_read_from_the_header(tmp_path: Path) -> None:
    """general.sampling.* (llama.cpp's keys) over llama.cpp's defaults; a value edge-spec cannot use is said once
    and the defaults stay."""
    from edge.models.loading import model_sampling

    from edge.sampling import LLAMA_DEFAULTS

    def written(name: str, **values: float) -> Path:
        path = tmp_path / name
        writer = gguf.GGUFWriter(path, arch="llama")
        writer.add_token_list(TOKENS)
        for key, value in values.items():
            if isinstance(value, int):
                writer.add_int32(f"general.sampling.{key}", value)
            else:
                writer.add_float32(f"general.sampling.{key}", value)
        writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    assert model_sampling(written("none.gguf")) == (LLAMA_DEFAULTS, ())
    recommended, fields = model_sampling(written("qwen-like.gguf", temp=0.7, top_k=20, top_p=0.8, min_p=0.0))
    assert (recommended.temperature, recommended.top_k, recommended.top_p, recommended.min_p) == \
        (pytest.approx(0.7), 20, pytest.approx(0.8), 0.0)
    assert fields == ("min_p", "temperature", "top_k", "top_p") and recommended.repeat_penalty == 1.0
    said: list[str] = []
    assert model_sampling(written("bad.gguf", top_p=5.0), said.append) == (LLAMA_DEFAULTS, ())
    assert len(said) == 1 and "top_p" in said[0]


def test_a_parsed_header_is_kept_for_the_next_run_until_the_file_changes(tiny: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A start reads both models' headers for the plan: a later run reads the header it kept (in the cache), not the
    file, as long as the file's path, size, mtime and inode are the same."""
    from edge.runtimes import gguf_file

    parsed = gguf_file.gguf_header(tiny)
    gguf_file._read_header.cache_clear()  # as a new process starts
    monkeypatch.setattr(gguf_file, "_parse_header", lambda path: pytest.fail("parsed the header again"))
    assert gguf_file.gguf_header(tiny) == parsed
    gguf_file._read_header.cache_clear()
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the same bytes, written again
    with pytest.raises(pytest.fail.Exception, match="parsed the header again"):
        gguf_file.gguf_header(tiny)
