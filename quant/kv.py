"""The QuantSpec hierarchical KV cache: one 8-bit code per element that a draft reader reads as INT4 and a full
reader reads as ~INT8.

Per group (keys: one channel over G tokens; values: one token over VG channels), with s and min stored as float16:
    s = (max - min) / 15,  u = clip(round((x - min) / s), 0, 15)            upper nibble
    r = clip(round((x - (u*s + min)) / (s/16)), -8, 7),  l = r + 8          lower nibble
    draft reader  u*s + min                                                 |error| <= s/2
    full reader   u*s + (l-8)*s/16 + min = byte*(s/16) + (min - s/2)        |error| <= s/16 (s/32 unless r clips)
with byte = u << 4 | l. bits=4 stores only u, two channels per byte (low nibble = even channel).

min is rounded down and s up to float16, and u and l are computed from those stored values, so every reader
(numpy here, the ONNX graph) sees the same grid and the grid covers the whole group. A constant group has s == 0,
codes 0, and reads back as min exactly.

The newest G..2G-1 committed tokens stay in an FP16 window; when 2G have built up, the oldest G are quantized.
Rolling back a rejected tree therefore only ever shortens the window. Storage is token-major, so every prefix
`[:n]` is one contiguous block an ONNX session can read without a copy.
"""

from __future__ import annotations

import numpy as np

GROUP = 128
READERS = ("draft", "full")


def value_group(n_kv_heads: int, head_dim: int, preferred: int = 128) -> int:
    """Channels per value group: `preferred` when it tiles the token's n_kv_heads * head_dim channels, else one head."""
    return preferred if (n_kv_heads * head_dim) % preferred == 0 else head_dim


_value_group = value_group  # QuantSpecKV's argument of the same name shadows it


def _fp16_grid(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 (scale, min) with min <= lo and min + 15 * scale >= hi, so the grid covers [lo, hi]."""
    minimum = lo.astype(np.float16)
    above = minimum.astype(np.float32) > lo
    minimum[above] = np.nextafter(minimum[above], np.float16(-np.inf))
    wanted = (hi - minimum.astype(np.float32)) / np.float32(15)
    scale = wanted.astype(np.float16)
    below = scale.astype(np.float32) < wanted
    scale[below] = np.nextafter(scale[below], np.float16(np.inf))
    return scale, minimum


def _nibbles(x: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Upper and lower nibbles (u, l) of x on the grid (scale, minimum), which broadcast against x."""
    s = scale.astype(np.float32)
    m = minimum.astype(np.float32)
    flat = s == 0
    safe = np.where(flat, np.float32(1), s)
    upper = np.clip(np.rint((x - m) / safe), 0, 15)
    residual = np.clip(np.rint((x - (upper * s + m)) * np.float32(16) / safe), -8, 7)
    upper = np.where(flat, 0, upper).astype(np.uint8)
    lower = np.where(flat, 0, residual + 8).astype(np.uint8)
    return upper, lower


def _pack(upper: np.ndarray, lower: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return (upper << 4) | lower
    return upper[..., 0::2] | (upper[..., 1::2] << 4)


def _upper(codes: np.ndarray, bits: int) -> np.ndarray:
    """u as uint8, one per element (bits=4 codes unpacked along the last axis)."""
    if bits == 8:
        return codes >> 4
    return np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def _read(codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, reader: str, bits: int) -> np.ndarray:
    """float32 values of codes; scale and minimum already broadcast against the unpacked codes."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, not {reader!r}")
    s = scale.astype(np.float32)
    m = minimum.astype(np.float32)
    if reader == "draft":
        return _upper(codes, bits).astype(np.float32) * s + m
    if bits != 8:
        raise ValueError("the full reader needs the hierarchical cache (bits=8); bits=4 stores the upper nibble only")
    # the ONNX graph computes the full reader this way: one multiply-add per byte
    return codes.astype(np.float32) * (s / np.float32(16)) + (m - s / np.float32(2))


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, not {bits}")


def quantize_keys(x: np.ndarray, group: int = GROUP, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys per channel over `group` tokens: x [n*group, L, kvh, d] -> codes [n*group, L, kvh, d] (bits=8) or
    [n*group, L, kvh, d//2] (bits=4) uint8, scale and min float16 [n, L, kvh, d]."""
    _check_bits(bits)
    x = np.asarray(x, np.float32)
    if len(x) % group:
        raise ValueError(f"{len(x)} tokens are not whole groups of {group}")
    grouped = x.reshape(len(x) // group, group, *x.shape[1:])
    scale, minimum = _fp16_grid(grouped.min(axis=1), grouped.max(axis=1))
    upper, lower = _nibbles(grouped, scale[:, None], minimum[:, None])
    return _pack(upper.reshape(x.shape), lower.reshape(x.shape), bits), scale, minimum


def dequantize_keys(
    codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, reader: str = "draft", bits: int = 8
) -> np.ndarray:
    """codes [nG, L, kvh, d or d//2], scale/min [n, L, kvh, d] float16 -> float32 [nG, L, kvh, d]."""
    _check_bits(bits)
    group = len(codes) // max(len(scale), 1)
    s = np.repeat(scale, group, axis=0)
    m = np.repeat(minimum, group, axis=0)
    return _read(codes, s, m, reader, bits)


def quantize_values(x: np.ndarray, group: int = GROUP, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Values per token: x [n, L, C] (C = kvh*d) -> codes [n, L, C] (bits=8) or [n, L, C//2] (bits=4) uint8,
    scale and min float16 [n, L, C//group] (per token over `group` channels)."""
    _check_bits(bits)
    x = np.asarray(x, np.float32)
    n, layers, channels = x.shape
    if channels % group:
        raise ValueError(f"value group {group} does not divide {channels} channels")
    grouped = x.reshape(n, layers, channels // group, group)
    scale, minimum = _fp16_grid(grouped.min(axis=-1), grouped.max(axis=-1))
    upper, lower = _nibbles(grouped, scale[..., None], minimum[..., None])
    return _pack(upper.reshape(x.shape), lower.reshape(x.shape), bits), scale, minimum


def dequantize_values(
    codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray, reader: str = "draft", bits: int = 8
) -> np.ndarray:
    """codes [n, L, C or C//2], scale/min [n, L, C//group] float16 -> float32 [n, L, C]."""
    _check_bits(bits)
    channels = codes.shape[-1] * (8 // bits)
    group = channels // scale.shape[-1]
    s = np.repeat(scale, group, axis=-1)
    m = np.repeat(minimum, group, axis=-1)
    return _read(codes, s, m, reader, bits)


class QuantSpecKV:
    """Committed K/V of one sequence: quantized groups of G tokens, then an FP16 window of the newest tokens.

    Arrays (capQ grows by doubling; capW = 2G):
        k_codes  uint8   [capQ, L, kvh, d//2] (bits=4) or [capQ, L, kvh, d] (bits=8)
        k_scale  float16 [capQ//G, L, kvh, d];  k_min the same
        v_codes  uint8   [capQ, L, kvh*d//2] or [capQ, L, kvh*d]
        v_scale  float16 [capQ, L, kvh*d//VG];  v_min the same
        k_win, v_win float16 [capW, L, kvh, d]
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        bits: int = 4,
        group: int = GROUP,
        value_group: int | None = None,
    ) -> None:
        _check_bits(bits)
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.bits = bits
        self.group = group
        channels = n_kv_heads * head_dim
        self.value_group = value_group if value_group is not None else _value_group(n_kv_heads, head_dim)
        if channels % self.value_group:
            raise ValueError(f"value group {self.value_group} does not divide {channels} channels")
        if bits == 4 and (head_dim % 2 or self.value_group % 2):
            raise ValueError("bits=4 packs two channels per byte: head_dim and the value group must be even")
        self.n_quant = 0
        self.n_window = 0
        shape = (2 * group, n_layers, n_kv_heads, head_dim)
        self.k_win = np.zeros(shape, np.float16)
        self.v_win = np.zeros(shape, np.float16)
        self._allocate(-(-max(capacity, 0) // group) * group)

    @property
    def n_tokens(self) -> int:
        return self.n_quant + self.n_window

    @property
    def capacity(self) -> int:
        """Tokens the quantized storage holds before it grows."""
        return self.k_codes.shape[0]

    def _allocate(self, cap: int) -> None:
        layers, heads, dim = self.n_layers, self.n_kv_heads, self.head_dim
        per_byte = 8 // self.bits
        channels = heads * dim
        arrays = {
            "k_codes": np.zeros((cap, layers, heads, dim // per_byte), np.uint8),
            "k_scale": np.zeros((cap // self.group, layers, heads, dim), np.float16),
            "k_min": np.zeros((cap // self.group, layers, heads, dim), np.float16),
            "v_codes": np.zeros((cap, layers, channels // per_byte), np.uint8),
            "v_scale": np.zeros((cap, layers, channels // self.value_group), np.float16),
            "v_min": np.zeros((cap, layers, channels // self.value_group), np.float16),
        }
        for name, array in arrays.items():
            old = getattr(self, name, None)
            if old is not None:
                array[: len(old)] = old
            setattr(self, name, array)

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Commit n tokens: k, v [n, L, kvh, d]. Quantizes the oldest G of the window whenever it reaches 2G."""
        expected = (self.n_layers, self.n_kv_heads, self.head_dim)
        if k.shape != v.shape or k.shape[1:] != expected:
            raise ValueError(f"k and v must both be [n, {', '.join(map(str, expected))}], got {k.shape} and {v.shape}")
        done, g = 0, self.group
        while done < len(k):
            take = min(len(k) - done, 2 * g - self.n_window)
            end = self.n_window + take
            self.k_win[self.n_window : end] = k[done : done + take]
            self.v_win[self.n_window : end] = v[done : done + take]
            self.n_window = end
            done += take
            if self.n_window == 2 * g:
                self._quantize_oldest_group()

    def _quantize_oldest_group(self) -> None:
        g, q = self.group, self.n_quant
        if q + g > self.capacity:
            self._allocate(max(2 * self.capacity, q + g))
        k_codes, k_scale, k_min = quantize_keys(self.k_win[:g], g, self.bits)
        v_codes, v_scale, v_min = quantize_values(
            self.v_win[:g].reshape(g, self.n_layers, -1), self.value_group, self.bits
        )
        self.k_codes[q : q + g] = k_codes
        self.k_scale[q // g : q // g + 1] = k_scale
        self.k_min[q // g : q // g + 1] = k_min
        self.v_codes[q : q + g] = v_codes
        self.v_scale[q : q + g] = v_scale
        self.v_min[q : q + g] = v_min
        self.n_quant = q + g
        # the window keeps its newest tokens at the front so that k_win[:n_window] stays one prefix
        self.k_win[: self.n_window - g] = self.k_win[g : self.n_window]
        self.v_win[: self.n_window - g] = self.v_win[g : self.n_window]
        self.n_window -= g

    def truncate(self, n: int) -> int:
        """Keep the first n tokens; returns how many were kept. Inside the window only the window shrinks; below
        n_quant whole groups are dropped back to floor(n / G) * G and the caller re-runs the tokens after that."""
        if not 0 <= n <= self.n_tokens:
            raise ValueError(f"cannot truncate {self.n_tokens} tokens to {n}")
        if n >= self.n_quant:
            self.n_window = n - self.n_quant
        else:
            self.n_quant = n // self.group * self.group
            self.n_window = 0
        return self.n_tokens

    def views(self) -> dict[str, np.ndarray]:
        """Contiguous prefix views of everything a reader needs (no copies)."""
        q, w = self.n_quant, self.n_window
        return {
            "k_codes": self.k_codes[:q],
            "k_scale": self.k_scale[: q // self.group],
            "k_min": self.k_min[: q // self.group],
            "v_codes": self.v_codes[:q],
            "v_scale": self.v_scale[:q],
            "v_min": self.v_min[:q],
            "k_win": self.k_win[:w],
            "v_win": self.v_win[:w],
        }

    def quantized_after(self, n: int | np.ndarray) -> int | np.ndarray:
        """How many tokens are quantized once appends from this state have committed n >= n_tokens tokens."""
        steps = np.maximum(0, (np.asarray(n) - self.n_quant) // self.group - 1)
        return self.n_quant + self.group * steps

    def views_through(self, q: int) -> dict[str, np.ndarray]:
        """views() with the quantized part reaching token q (> n_quant): the window's oldest groups quantized
        now, as append will quantize them, into copies; the window itself is left whole. A reader whose tokens
        lie on both sides of a quantization point sees each committed token as plain decoding would."""
        views = self.views()
        extra, g = q - self.n_quant, self.group
        if extra == 0:
            return views
        if extra % g or extra > self.n_window:
            raise ValueError(f"can quantize ahead only whole groups of the window ({self.n_window} tokens), "
                             f"not {extra}")
        k_parts = [quantize_keys(self.k_win[i : i + g], g, self.bits) for i in range(0, extra, g)]
        v_parts = [quantize_values(self.v_win[i : i + g].reshape(g, self.n_layers, -1), self.value_group, self.bits)
                   for i in range(0, extra, g)]
        for name, index, parts in (("k_codes", 0, k_parts), ("k_scale", 1, k_parts), ("k_min", 2, k_parts),
                                   ("v_codes", 0, v_parts), ("v_scale", 1, v_parts), ("v_min", 2, v_parts)):
            views[name] = np.concatenate([views[name], *(part[index] for part in parts)])
        return views

    def dequantized(self, reader: str = "draft") -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V [n_tokens, L, kvh, d] as `reader` sees them: quantized part, then the window."""
        views = self.views()
        keys = dequantize_keys(views["k_codes"], views["k_scale"], views["k_min"], reader, self.bits)
        values = dequantize_values(views["v_codes"], views["v_scale"], views["v_min"], reader, self.bits)
        values = values.reshape(keys.shape)
        return (
            np.concatenate([keys, views["k_win"].astype(np.float32)]),
            np.concatenate([values, views["v_win"].astype(np.float32)]),
        )

    def nbytes(self) -> dict[str, int]:
        """Bytes in use: the quantized part (codes, scales, mins), the FP16 window, and all storage allocated."""
        views = self.views()
        window = views.pop("k_win").nbytes + views.pop("v_win").nbytes
        allocated = sum(
            getattr(self, name).nbytes
            for name in ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "k_win", "v_win")
        )
        return {"quantized": sum(a.nbytes for a in views.values()), "window": window, "allocated": allocated}

    def bits_per_element(self) -> float:
        """Bits per K or V element of the quantized part, scales and mins included; nan while it is empty."""
        if self.n_quant == 0:
            return float("nan")
        elements = self.n_quant * self.n_layers * self.n_kv_heads * self.head_dim * 2
        return 8 * self.nbytes()["quantized"] / elements
