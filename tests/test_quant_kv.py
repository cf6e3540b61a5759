"""The QuantSpec hierarchical KV cache: reader error bounds, storage size, the FP16 window, rollback."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from edge.quant.kv import (
    QuantSpecKV,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
    value_group,
)

G = 128
SMOLLM2 = (30, 3, 64)  # (n_layers, n_kv_heads, head_dim)
GEMMA3_270M = (18, 1, 256)
SMALL = (2, 2, 16)


def kv_data(n: int, shape: tuple[int, int, int], outliers: bool = False, seed: int = 0) -> np.ndarray:
    """float16 [n, L, kvh, d]; with outliers, some channels carry a large offset and spread, as keys do."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    if outliers:
        channels = rng.choice(shape[-1], size=max(1, shape[-1] // 8), replace=False)
        x[..., channels] = x[..., channels] * 20 + 40
        x[rng.integers(0, n, 3), ..., 0] = -300  # a few single-token spikes
    return x.astype(np.float16)


def slack(scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """float32 rounding in the readers, relative to the magnitudes involved."""
    return 1e-6 * (np.abs(minimum) + 16 * scale)


def check_reader_errors(x: np.ndarray, draft: np.ndarray, full: np.ndarray, scale: np.ndarray, minimum: np.ndarray):
    draft_error = np.abs(draft - x)
    full_error = np.abs(full - x)
    assert np.all(draft_error <= scale / 2 + slack(scale, minimum))
    assert np.all(full_error <= scale / 16 + slack(scale, minimum))
    assert full_error.mean() * 10 <= draft_error.mean()


@pytest.mark.parametrize("outliers", [False, True])
def test_key_readers_error_bounds(outliers: bool) -> None:
    x = kv_data(2 * G, (4, 2, 64), outliers)
    codes, scale, minimum = quantize_keys(x, G, bits=8)
    assert codes.shape == x.shape and scale.shape == minimum.shape == (2, *x.shape[1:])
    assert scale.dtype == minimum.dtype == np.float16
    s = np.repeat(scale.astype(np.float32), G, axis=0)
    m = np.repeat(minimum.astype(np.float32), G, axis=0)
    assert np.all((m <= x) & (x <= m + 15 * s))  # the stored float16 grid covers every group
    draft = dequantize_keys(codes, scale, minimum, "draft", bits=8)
    full = dequantize_keys(codes, scale, minimum, "full", bits=8)
    check_reader_errors(x.astype(np.float32), draft, full, s, m)
    # the full reader's one multiply-add equals the hierarchical sum u*s + (l-8)*s/16 + min
    upper, lower = (codes >> 4).astype(np.float32), (codes & 15).astype(np.float32)
    np.testing.assert_allclose(full, upper * s + (lower - 8) * s / 16 + m, rtol=0, atol=1e-5 * np.abs(x).max())
    np.testing.assert_array_equal(draft, upper * s + m)


@pytest.mark.parametrize("outliers", [False, True])
def test_value_readers_error_bounds(outliers: bool) -> None:
    x = kv_data(64, (4, 3, 64), outliers, seed=1).reshape(64, 4, 3 * 64)
    group = value_group(3, 64)
    codes, scale, minimum = quantize_values(x, group, bits=8)
    assert codes.shape == x.shape and scale.shape == (64, 4, 3)
    s = np.repeat(scale.astype(np.float32), group, axis=-1)
    m = np.repeat(minimum.astype(np.float32), group, axis=-1)
    draft = dequantize_values(codes, scale, minimum, "draft", bits=8)
    full = dequantize_values(codes, scale, minimum, "full", bits=8)
    check_reader_errors(x.astype(np.float32), draft, full, s, m)


def test_constant_group_reads_back_exactly() -> None:
    x = np.full((G, 1, 1, 4), 0.3, np.float16)
    x[..., 1] = -7.25
    for bits in (4, 8):
        codes, scale, minimum = quantize_keys(x, G, bits)
        assert np.all(scale == 0) and np.all(codes == 0)
        for reader in ("draft", "full") if bits == 8 else ("draft",):
            np.testing.assert_array_equal(dequantize_keys(codes, scale, minimum, reader, bits), x.astype(np.float32))


def test_four_bit_codes_are_the_upper_nibbles_packed_even_channel_low() -> None:
    x = kv_data(G, (2, 2, 16), outliers=True)
    codes8, scale8, min8 = quantize_keys(x, G, bits=8)
    codes4, scale4, min4 = quantize_keys(x, G, bits=4)
    np.testing.assert_array_equal(scale4, scale8)
    np.testing.assert_array_equal(min4, min8)
    upper = codes8 >> 4
    np.testing.assert_array_equal(codes4, upper[..., 0::2] | (upper[..., 1::2] << 4))
    np.testing.assert_array_equal(
        dequantize_keys(codes4, scale4, min4, "draft", bits=4), dequantize_keys(codes8, scale8, min8, "draft", bits=8)
    )
    values = x.reshape(G, 2, -1)
    v8, v4 = quantize_values(values, 16, bits=8)[0], quantize_values(values, 16, bits=4)[0]
    np.testing.assert_array_equal(v4, (v8[..., 0::2] >> 4) | (v8[..., 1::2] >> 4 << 4))
    with pytest.raises(ValueError, match="bits=8"):
        dequantize_keys(codes4, scale4, min4, "full", bits=4)


def test_value_group() -> None:
    assert value_group(*SMOLLM2[1:]) == 64  # 192 channels
    assert value_group(*GEMMA3_270M[1:]) == 128
    assert value_group(8, 64) == 128


@pytest.mark.parametrize("bits, limit", [(4, 4.5), (8, 8.5)])
@pytest.mark.parametrize("shape", [SMOLLM2, GEMMA3_270M], ids=["smollm2", "gemma3-270m"])
def test_bits_per_element(shape: tuple[int, int, int], bits: int, limit: float) -> None:
    cache = QuantSpecKV(*shape, capacity=512, bits=bits)
    assert np.isnan(cache.bits_per_element())
    keys, values = kv_data(2 * G, shape), kv_data(2 * G, shape, seed=1)
    cache.append(keys, values)
    assert (cache.n_quant, cache.n_window) == (G, G)
    assert cache.bits_per_element() <= limit
    assert cache.nbytes()["window"] == G * np.prod(shape) * 2 * 2  # G tokens of K and V in float16
    read_keys, read_values = cache.dequantized("draft")
    assert read_keys.shape == read_values.shape == (2 * G, *shape)
    np.testing.assert_array_equal(read_values[G:], values[G:])  # the window is exact


def test_window_holds_g_to_2g_minus_1_tokens() -> None:
    cache = QuantSpecKV(*SMALL, capacity=0, bits=8)
    rng = np.random.default_rng(3)
    data = kv_data(2000, SMALL)
    done = 0
    while done < len(data):
        n = int(rng.integers(0, 90))
        cache.append(data[done : done + n], data[done : done + n])
        done = min(done + n, len(data))
        assert cache.n_tokens == done and cache.n_quant % G == 0
        if done >= 2 * G:
            assert G <= cache.n_window <= 2 * G - 1
        else:
            assert cache.n_quant == 0
    np.testing.assert_array_equal(cache.views()["k_win"], data[cache.n_quant :])


def snapshot(cache: QuantSpecKV) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in cache.views().items()}


@pytest.mark.parametrize("bits", [4, 8])
def test_rollback_inside_the_window_touches_only_fp16(bits: int) -> None:
    cache = QuantSpecKV(*SMALL, capacity=1024, bits=bits)
    keys, values = kv_data(3 * G + 40, SMALL), kv_data(3 * G + 40, SMALL, seed=1)
    cache.append(keys, values)
    before = snapshot(cache)
    quantized = {name: array.copy() for name, array in cache.views().items() if "_win" not in name}
    n_quant = cache.n_quant
    assert cache.truncate(n_quant + 5) == n_quant + 5
    after = snapshot(cache)
    for name in quantized:
        assert after[name] == before[name], name
    assert after["k_win"] == before["k_win"][: len(after["k_win"])]
    # a rejected tree's tokens, then the accepted ones, that quantize later groups: earlier groups stay as they were
    cache.append(keys[: 2 * G], values[: 2 * G])
    assert cache.n_quant > n_quant
    for name, array in quantized.items():
        assert cache.views()[name][: len(array)].tobytes() == array.tobytes(), name


@pytest.mark.parametrize("n", [0, 1, G - 1, G, G + 3, 2 * G + 17])
def test_truncate_into_the_quantized_region_drops_whole_groups(n: int) -> None:
    keys, values = kv_data(4 * G + 10, SMALL), kv_data(4 * G + 10, SMALL, seed=1)
    cache = QuantSpecKV(*SMALL, capacity=0, bits=8)
    cache.append(keys, values)
    assert n < cache.n_quant
    whole = snapshot(cache)
    kept = cache.truncate(n)
    assert kept == n // G * G == cache.n_tokens == cache.n_quant and cache.n_window == 0
    # re-running the dropped tokens restores the cache byte for byte
    cache.append(keys[kept:], values[kept:])
    assert snapshot(cache) == whole
    with pytest.raises(ValueError):
        cache.truncate(cache.n_tokens + 1)


@pytest.mark.parametrize("bits", [4, 8])
def test_appending_in_pieces_gives_the_same_storage(bits: int) -> None:
    n = 1400
    keys, values = kv_data(n, SMALL, outliers=True), kv_data(n, SMALL, seed=1).astype(np.float32)
    whole = QuantSpecKV(*SMALL, capacity=2048, bits=bits)
    whole.append(keys, values)
    pieces = QuantSpecKV(*SMALL, capacity=0, bits=bits)  # grows several times on the way
    done = 0
    for step in itertools.cycle([1, 7, 300]):
        if done >= n:
            break
        pieces.append(keys[done : done + step], values[done : done + step])
        done += step
    assert (pieces.n_quant, pieces.n_window) == (whole.n_quant, whole.n_window)
    assert snapshot(pieces) == snapshot(whole)
    reader = "full" if bits == 8 else "draft"
    for got, expected in zip(pieces.dequantized(reader), whole.dequantized(reader), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_grid_covers_float32_groups_far_from_zero() -> None:
    # float16 steps near 1000 are 0.5 wide: a min rounded to nearest could land above the whole group
    x = np.float32(1000.3) + np.linspace(0, 0.1, 2 * 128, dtype=np.float32).reshape(2, 1, 128)
    codes, scale, minimum = quantize_values(x, 128, bits=8)
    assert np.all(minimum.astype(np.float32) <= x.min(axis=-1))
    s = scale.astype(np.float32)  # [2, 1, 1]: one group per token
    assert np.all(np.abs(dequantize_values(codes, scale, minimum, "draft", bits=8) - x) <= s / 2 + 1e-4)
    assert np.all(np.abs(dequantize_values(codes, scale, minimum, "full", bits=8) - x) <= s / 16 + 1e-4)


@pytest.mark.parametrize("start", [0, G + 5, 2 * G - 1, 3 * G + 100])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_ahead_equals_appending(start: int, bits: int) -> None:
    """What a tree pass reads for a node past a quantization point is what the cache holds once it is there."""
    keys, values = kv_data(start + G, SMALL, outliers=True), kv_data(start + G, SMALL, seed=1)
    cache = QuantSpecKV(*SMALL, capacity=0, bits=bits)
    cache.append(keys[:start], values[:start])
    for n in range(start, start + G):
        q = int(cache.quantized_after(n))
        later = QuantSpecKV(*SMALL, capacity=0, bits=bits)
        later.append(keys[:n], values[:n])
        assert q == later.n_quant
        if q > cache.n_quant:
            ahead = cache.views_through(q)
            for name, array in later.views().items():
                if "_win" not in name:
                    assert ahead[name].tobytes() == array.tobytes(), name
    with pytest.raises(ValueError):
        cache.views_through(cache.n_quant + cache.n_window + G)
