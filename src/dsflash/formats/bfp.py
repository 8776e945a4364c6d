"""BFLOAT4_B / BFLOAT8_B tiles, byte-exact with ttnn 0.81.1's host packer (docs/bfp_format.md, golden vectors).

`search=True` encodes the same tile format with one more choice per face row: the shared exponent one below the
largest element's is kept when it gives the row a strictly lower squared error (the opt-in search newer tt-metal
sources describe). Any ttnn decoder reads such tiles; only the encoder's choice differs. Where the largest
element stands alone (FP4's 4 beside 0.5s and 1.5s) it roughly halves bfp4_b's weight error.
"""

from __future__ import annotations

import math
import sys
from importlib import resources
from pathlib import Path

import numba
import numpy as np

from dsflash.errors import DsflashError, StoreCorrupt
from dsflash.formats import tiles

MANTISSA_BITS = {"bfp8_b": 7, "bfp4_b": 3}  # magnitude bits of one element code
EXP_BYTES = 64  # one exponent byte per face row; already a multiple of the 16-byte L1 alignment


class BfpError(DsflashError, ValueError):
    """An unknown format, an input that is not float32/bfloat16, or a buffer whose size does not fit its shape."""


def _mbits(fmt: str) -> int:
    if fmt not in MANTISSA_BITS:
        raise BfpError(f"unknown bfp format {fmt!r} (expected one of {', '.join(MANTISSA_BITS)})")
    return MANTISSA_BITS[fmt]


def tile_bytes(fmt: str) -> int:
    """Bytes of one packed 32x32 tile: 1088 (bfp8_b) or 576 (bfp4_b)."""
    return EXP_BYTES + tiles.TILE * tiles.TILE * (_mbits(fmt) + 1) // 8


def packed_size(shape: tuple[int, ...], fmt: str) -> int:
    """Bytes that pack() produces for a tensor of shape [..., H, W]."""
    try:
        return tiles.n_tiles(tuple(shape)) * tile_bytes(fmt)
    except ValueError as e:
        if isinstance(e, BfpError):
            raise
        raise BfpError(str(e)) from None


# ---------------------------------------------------------------- inputs


def as_bits(x) -> np.ndarray:
    """float32 or bfloat16 tensor/array [..., H, W] -> fp32 bit patterns uint32 [..., H, W] (bf16 -> fp32 is exact)."""
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported; never import it just to check
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        if x.dtype != torch.float32:
            raise BfpError(_dtype_message(x.dtype))
        return x.numpy().view(np.uint32)
    x = np.asarray(x)
    if x.dtype.name == "bfloat16" and x.dtype.itemsize == 2:  # ml_dtypes
        return np.ascontiguousarray(x).view(np.uint16).astype(np.uint32) << 16
    if x.dtype.kind != "f" or x.dtype.itemsize != 4:
        raise BfpError(_dtype_message(x.dtype))
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


def _frozen(a: np.ndarray) -> np.ndarray:
    """A read-only view: numba types writable and read-only arrays apart, so inputs always go in read-only."""
    v = a.view()
    v.flags.writeable = False
    return v


def _dtype_message(dtype) -> str:
    # ttnn would silently round such tensors to bfloat16 first; make the caller choose
    return f"bfp packing takes float32 or bfloat16, got {dtype}; convert explicitly"


# ---------------------------------------------------------------- kernels (numba, one thread)
# Work goes row by row over the input: long loops over a whole row vectorize well, where loops over one
# 16-element face row do not (measured: 4096x4096 bfp4_b 18 ms row-wise vs 70 ms face-row-wise).
# Every kernel and helper lives in this file: numba's on-disk cache is keyed on this file alone, so a helper
# imported from another module could change without invalidating the compiled kernels.


@numba.njit(cache=True, inline="always")
def _row_exponents(src, ex, emax):
    """Shared exponent of each 16-group of fp32 bits src [n] -> emax [n/16], and broadcast per element ex [n]."""
    for g in range(src.shape[0] // 16):
        mx = 0
        for i in range(16):
            mx = max(mx, (src[g * 16 + i] >> 23) & 0xFF)  # Inf/NaN count as 255, zeros/denormals as 0
        emax[g] = mx
    for i in range(src.shape[0]):
        ex[i] = emax[i >> 4]


@numba.njit(cache=True, inline="always")
def _magnitude(w, x, m):
    """§4 for one element: magnitude code of fp32 bits w under shared exponent x (m magnitude bits)."""
    s, x = 24 - m, np.int64(x)
    e = np.int64((w >> 23) & 0xFF)
    sig = np.int64((w & 0x7FFFFF) | 0x800000) if e != 0 else np.int64(0)  # zeros and denormals flush to code 0
    if e > x:  # above the shared exponent (search only): saturate
        return (1 << m) - 1
    a = sig >> min(x - e, 31)  # shifted-out bits are lost: no sticky bit
    q = (a + ((1 << (s - 1)) - 1) + ((a >> s) & 1)) >> s  # round half to even on the shifted significand
    return min(q, (1 << m) - 1)  # saturate; the exponent is never bumped


@numba.njit(cache=True, inline="always")
def _row_codes(src, ex, codes, m):
    """§4 per element: fp32 bits src [n] with shared exponents ex [n] -> sign-magnitude codes [n] (m magnitude bits)."""
    for i in range(src.shape[0]):
        w = src[i]
        q = _magnitude(w, ex[i], m)
        codes[i] = ((w >> 31) << m) | q if q != 0 else 0


@numba.njit(cache=True, inline="always")
def _squared_error(src, val, g, x, m):
    """Squared error of face row g (fp32 bits src, the same as floats val) under shared exponent x, summed in
    element order in float64 (exact differences: a value and its code's value lie within 53 bits)."""
    err, x = 0.0, np.int64(x)
    step = math.ldexp(1.0, x - 127 - (m - 1))
    for i in range(16 * g, 16 * g + 16):
        d = abs(np.float64(val[i])) - _magnitude(src[i], x, m) * step
        err += d * d
    return err


@numba.njit(cache=True, inline="always")
def _search_rows(src, ex, emax, codes, m):
    """Lower each face row's exponent by one where that strictly lowers its squared error, and re-encode it."""
    val = src.view(np.float32)
    for g in range(emax.shape[0]):
        x = np.int64(emax[g])
        if x < 2 or x == 255:  # nothing below, or an Inf/NaN row
            continue
        err = _squared_error(src, val, g, x, m)
        if err > 0.0 and _squared_error(src, val, g, x - 1, m) < err:
            emax[g] = x - 1
            for i in range(16 * g, 16 * g + 16):
                ex[i] = x - 1
            _row_codes(src[16 * g : 16 * g + 16], ex[16 * g : 16 * g + 16], codes[16 * g : 16 * g + 16], m)


@numba.njit(cache=True, inline="always")
def _nibbles(codes, data):
    """4-bit codes [n] -> bytes [n/2], element 2j in the low nibble."""
    for j in range(data.shape[0]):
        data[j] = codes[2 * j] | (codes[2 * j + 1] << 4)


@numba.njit(cache=True, inline="always")
def _put_row(out, base, rt, emax, data64, rb):
    """Scatter one tiled row (rt = row in its tile row) into the tiles starting at byte base of out."""
    o64 = out.view(np.uint64)
    words = rb // 8  # data bytes of a face row, in 8-byte words
    fh, fr = rt // 16, rt % 16
    for g in range(emax.shape[0]):
        f = 2 * fh + g % 2
        t = base + (g // 2) * (64 + 64 * rb)
        out[t + 16 * f + fr] = emax[g]
        dp = (t + 64 + 16 * rb * f + rb * fr) // 8
        for k in range(words):
            o64[dp + k] = data64[g * words + k]


@numba.njit(cache=True, inline="always")
def _pack_rows(bits, out, m, search):
    """uint32 [B, H, W] -> tiles in out (uint8, batch-major, row-major tile order); padding encodes as zeros."""
    nb, h, w = bits.shape
    th, w32 = (h + 31) // 32, (w + 31) // 32 * 32
    rb = 2 * (m + 1)  # data bytes of one face row
    row = np.zeros(w32, np.uint32)  # zero-padded copy of a row when w is not a multiple of 32
    ex, emax = np.empty(w32, np.uint32), np.empty(w32 // 16, np.uint8)
    codes, data = np.empty(w32, np.uint8), np.empty(w32 // 2, np.uint8)
    for b in range(nb):
        for r in range(th * 32):
            if r >= h:
                row[:] = 0
                src = row
            elif w != w32:
                row[:w] = bits[b, r]
                src = row
            else:
                src = bits[b, r]
            _row_exponents(src, ex, emax)
            _row_codes(src, ex, codes, m)
            if search:
                _search_rows(src, ex, emax, codes, m)
            if m == 3:
                _nibbles(codes, data)
            base = (b * th + r // 32) * (w32 // 32) * (64 + 64 * rb)
            _put_row(out, base, r % 32, emax, (data if m == 3 else codes).view(np.uint64), rb)


@numba.njit(cache=True)
def _pack_kernel(bits, out, m, search):
    _pack_rows(bits, out, m, search)


@numba.njit(cache=True, inline="always")
def _get_row(buf, base, rt, emax, data64, rb):
    """Gather one tiled row (rt = row in its tile row) from the tiles at byte base of buf; the inverse of _put_row."""
    b64 = buf.view(np.uint64)
    words = rb // 8
    fh, fr = rt // 16, rt % 16
    for g in range(emax.shape[0]):
        f = 2 * fh + g % 2
        t = base + (g // 2) * (64 + 64 * rb)
        emax[g] = buf[t + 16 * f + fr]
        dp = (t + 64 + 16 * rb * f + rb * fr) // 8
        for k in range(words):
            data64[g * words + k] = b64[dp + k]


@numba.njit(cache=True, inline="always")
def _row_decode(codes, ex, dst, m, fq):
    """§5 per element: codes [n] with shared exponents ex [n] -> fp32 bits dst [n] (denormal/Inf/NaN bits as built)."""
    for i in range(dst.shape[0]):
        fq[i] = np.float32(codes[i] & ((1 << m) - 1))  # exact; its exponent is 127 + the leading-one position
    qbits = fq.view(np.uint32)
    for i in range(dst.shape[0]):
        u, c = np.int64(qbits[i]), np.int64(codes[i])
        field = (u >> 23) + np.int64(ex[i]) - (m - 1) - 127  # E - k of §5; negative when k > E
        v = ((c >> m) << 31) | (field << 23) | (u & 0x7FFFFF)  # field 0 gives a denormal bit pattern, as ttnn's
        dst[i] = ((c >> m) << 31) if u == 0 else (0 if field < 0 else v)


@numba.njit(cache=True, inline="always")
def _unpack_rows(buf, out, m):
    """Tiles in buf (uint8) -> fp32 bits out uint32 [B, H, W], cropping the padding."""
    nb, h, w = out.shape
    th, w32 = (h + 31) // 32, (w + 31) // 32 * 32
    rb = 2 * (m + 1)
    ex, emax = np.empty(w32, np.uint8), np.empty(w32 // 16, np.uint8)
    codes, data, row = np.empty(w32, np.uint8), np.empty(w32 * rb // 16, np.uint8), np.empty(w32, np.uint32)
    fq = np.empty(w32, np.float32)
    for b in range(nb):
        for r in range(h):
            base = (b * th + r // 32) * (w32 // 32) * (64 + 64 * rb)
            _get_row(buf, base, r % 32, emax, data.view(np.uint64), rb)
            for i in range(w32):
                ex[i] = emax[i >> 4]
            if m == 3:
                for j in range(w32 // 2):
                    codes[2 * j], codes[2 * j + 1] = data[j] & 0xF, data[j] >> 4
            _row_decode(codes if m == 3 else data, ex, row, m, fq)
            out[b, r] = row[:w]


@numba.njit(cache=True)
def _unpack_kernel(buf, out, m):
    _unpack_rows(buf, out, m)


# ---------------------------------------------------------------- public API


def pack(x, fmt: str, search: bool = False) -> np.ndarray:
    """float32/bfloat16 [..., H, W] (torch or numpy) -> packed tiles, uint8 [packed_size(shape, fmt)]; ttnn's bytes
    unless `search` (see the module's doc)."""
    m = _mbits(fmt)
    bits = as_bits(x)
    if bits.ndim < 2:
        raise BfpError(f"bfp packing needs a tensor [..., H, W], got shape {bits.shape}")
    out = np.empty(packed_size(bits.shape, fmt), dtype=np.uint8)
    if out.size:
        _pack_kernel(_frozen(bits.reshape(-1, *bits.shape[-2:])), out, m, bool(search))
    return out


def unpack(buf, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """Packed tiles (bytes-like or uint8 array) -> float32 [..., H, W] exactly as ttnn.to_torch decodes them."""
    m = _mbits(fmt)
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise BfpError(f"bfp unpacking needs a shape [..., H, W], got {shape}")
    data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    want = packed_size(shape, fmt)
    if data.size != want:
        raise BfpError(f"{data.size} bytes do not hold {fmt} {list(shape)}: expected {want} bytes")
    out = np.empty(shape, dtype=np.uint32)
    if out.size:
        _unpack_kernel(_frozen(np.ascontiguousarray(data)), out.reshape(-1, *shape[-2:]), m)
    return out.view(np.float32)


# ---------------------------------------------------------------- clear NumPy model (tests, benchmark baseline)


def _codes_reference(w: np.ndarray, emax: np.ndarray, m: int) -> np.ndarray:
    """§4 written out: fp32 bits int64 [N, 16] under shared exponents int64 [N, 1] -> codes [N, 16]."""
    e = (w >> 23) & 0xFF
    sig = np.where(e == 0, 0, (w & 0x7FFFFF) | 0x800000)
    d = emax - e
    a = np.where(d >= 32, 0, sig >> np.clip(d, 0, 31))
    s = 24 - m
    q, r, half = a >> s, a & ((1 << s) - 1), 1 << (s - 1)
    q = q + ((r > half) | ((r == half) & (q & 1 == 1)))
    q = np.where(d < 0, (1 << m) - 1, np.minimum(q, (1 << m) - 1))  # above the exponent (search only): saturate
    return np.where(q == 0, 0, ((w >> 31) << m) | q)


def encode_rows_reference(w: np.ndarray, m: int, search: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """§4 written out: fp32 bits uint32 [N, 16] -> (exponents uint8 [N], codes uint8 [N, 16])."""
    w = w.astype(np.int64)
    emax = ((w >> 23) & 0xFF).max(axis=1, keepdims=True)
    code = _codes_reference(w, emax, m)
    if search:
        with np.errstate(invalid="ignore", over="ignore"):  # Inf/NaN rows are never lowered
            lower = _codes_reference(w, emax - 1, m)
            lower_err, err = _error_reference(w, emax - 1, lower, m), _error_reference(w, emax, code, m)
        better = (emax >= 2) & (emax < 255) & (lower_err < err)
        emax, code = np.where(better, emax - 1, emax), np.where(better, lower, code)
    return emax[:, 0].astype(np.uint8), code.astype(np.uint8)


def _error_reference(w: np.ndarray, emax: np.ndarray, code: np.ndarray, m: int) -> np.ndarray:
    """Squared error of each row's codes [N, 16] against fp32 bits w [N, 16], summed in element order -> [N, 1]."""
    v = np.abs(w.astype(np.uint32).view(np.float32).astype(np.float64))
    q = (code & ((1 << m) - 1)) * np.ldexp(1.0, (emax - 127 - (m - 1)).astype(np.int32))
    err = np.zeros((w.shape[0], 1))
    for i in range(w.shape[1]):  # the kernel's order, so both round alike
        err[:, 0] += (v[:, i] - q[:, i]) ** 2
    return err


def decode_rows_reference(exps: np.ndarray, codes: np.ndarray, m: int) -> np.ndarray:
    """§5 written out: (exponents uint8 [N], codes uint8 [N, 16]) -> fp32 bits uint32 [N, 16]."""
    emax = exps.astype(np.int64)[:, None]
    c = codes.astype(np.int64)
    s, q = c >> m, c & ((1 << m) - 1)
    lead = np.floor(np.log2(np.maximum(q, 1))).astype(np.int64)
    k = (m - 1) - lead
    bits = (s << 31) | ((emax - k) << 23) | ((q - (1 << lead)) << (23 - lead))
    bits = np.where(k > emax, 0, bits)
    return np.where(q == 0, s << 31, bits).astype(np.uint32)


def pack_reference(x, fmt: str, search: bool = False) -> np.ndarray:
    """Same bytes as pack(), built from encode_rows_reference with whole-array NumPy (slow, obviously right)."""
    m = _mbits(fmt)
    bits = as_bits(x)
    exps, codes = encode_rows_reference(tiles.tilize(bits), m, search)
    n = exps.size // tiles.FACE_ROWS_PER_TILE
    if m == 3:  # element 2j in the low nibble
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.concatenate([exps.reshape(n, -1), codes.reshape(n, -1)], axis=1).reshape(-1)


def unpack_reference(buf, fmt: str, shape: tuple[int, ...]) -> np.ndarray:
    """Same values as unpack(), from decode_rows_reference."""
    m = _mbits(fmt)
    t = np.frombuffer(bytes(buf), dtype=np.uint8).reshape(tiles.n_tiles(shape), -1)
    exps = t[:, :EXP_BYTES].reshape(-1)
    data = t[:, EXP_BYTES:].reshape(exps.size, -1)  # one face row per line
    codes = data if m == 7 else np.stack([data & 0xF, data >> 4], axis=-1).reshape(exps.size, 16)
    return tiles.untilize(decode_rows_reference(exps, codes, m), shape).view(np.float32)


# ---------------------------------------------------------------- checkpoint FP4 (E2M1 + E8M0) -> bfp4_b
# A face row is 16 consecutive elements of one FP4 scale group of 32, so all 16 share the scale 2^(e-127) and,
# while every product is a normal fp32 (2 <= e <= 252), the bfp4 codes depend only on the FP4 codes: the row's
# shared exponent is e + (exponent of its largest FP4 magnitude), and each element's code is a table lookup.

_FP4_EXP = (0, -1, 0, 0, 1, 1, 2, 2)  # fp32 exponent (unbiased) of E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
_FP4_FRAC = (0, 0, 0, 0x400000, 0, 0x400000, 0, 0x400000)  # fp32 fraction bits of the same
_FP4_CLASS_EXP = (-1, 0, 1, 2, 1)  # row exponent (unbiased, scale 2^0) of each class of _fp4_byte_table
_SAFE_E8M0 = (2, 252)  # every product of such a scale and an E2M1 value is a normal fp32


def _fp4_byte_table() -> np.ndarray:
    """uint8 [5, 256]: class of the face row's largest magnitude (0.5 | 1-1.5 | 2-3 | 4-6, and 4 under the exponent
    of 2-3, the search's choice) x FP4 byte -> bfp4_b byte."""
    table = np.zeros((5, 256), dtype=np.uint8)
    for cls, top in enumerate(_FP4_CLASS_EXP):
        w = np.zeros((8, 16), dtype=np.int64)
        for mag in range(1, 8):
            w[mag, 0] = (127 + _FP4_EXP[mag]) << 23 | _FP4_FRAC[mag]  # scale 2^0
        mags = _codes_reference(w, np.full((8, 1), 127 + top), 3)[:, 0]
        nib = np.array([mags[c & 7] | (c >> 3) << 3 if mags[c & 7] else 0 for c in range(16)], dtype=np.uint8)
        b = np.arange(256)
        table[cls] = nib[b & 15] | (nib[b >> 4] << 4)
    return table


@numba.njit(cache=True, inline="always")
def _popcount(v):
    v = v - ((v >> np.uint64(1)) & np.uint64(0x5555555555555555))
    v = (v & np.uint64(0x3333333333333333)) + ((v >> np.uint64(2)) & np.uint64(0x3333333333333333))
    v = (v + (v >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return np.int64((v * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(cache=True, inline="always")
def _fp4_class(w, search):
    """uint64 of 16 FP4 codes -> class of the largest magnitude (-1: all zero, 0: 0.5, 1: 1-1.5, 2: 2-3, 3: 4-6;
    4: a 4-6 row that the search encodes one exponent lower)."""
    mags = w & np.uint64(0x7777777777777777)
    b2, b1 = mags & np.uint64(0x4444444444444444), mags & np.uint64(0x2222222222222222)
    six = mags & (mags << np.uint64(1)) & np.uint64(0x4444444444444444)  # bits 2 and 1 in one nibble: 6 or 7
    # branch-free: real rows mix classes unpredictably
    cls = np.int64(mags != 0) + np.int64((b2 | b1) != 0) + np.int64(b2 != 0) + np.int64(six != 0) - 1
    # one exponent lower (steps of 0.5 x scale) 0.5 and 1.5 become exact and 4 and 6 saturate at 3.5: squared
    # errors 1/4 per 0.5 or 1.5 against 1/4 per 4 and 25/4 per 6, in units of the scale squared
    ones = mags & np.uint64(0x1111111111111111)
    halves = _popcount(ones & ~(b2 >> np.uint64(2)))  # codes 1 and 3: 0.5 and 1.5
    sixes = _popcount((six >> np.uint64(2)) & ones)  # code 7: 6
    fours = _popcount(six) - sixes  # code 6: 4
    return cls + (np.int64(search) & np.int64(cls == 3) & np.int64(fours + 25 * sixes < halves))


@numba.njit(cache=True, inline="always")
def _fp4_face_row_generic(w, e, bits, ex, emax1, codes, data, search):
    """One face row at an extreme scale: build the 16 fp32 products exactly (Inf above, denormal below) and encode."""
    for i in range(16):
        c = np.int64((w >> np.uint64(4 * i)) & np.uint64(0xF))
        field = e + _FP4_EXP[c & 7]
        v = (c >> 3) << 31
        if c & 7 == 0 or field <= 0:
            bits[i] = v  # zero or fp32 denormal: exponent field 0, code 0
        elif field >= 255:
            bits[i] = v | 0x7F800000  # overflow to Inf
        else:
            bits[i] = v | (field << 23) | _FP4_FRAC[c & 7]
    _row_exponents(bits, ex, emax1)
    _row_codes(bits, ex, codes, 3)
    if search:
        _search_rows(bits, ex, emax1, codes, 3)
    _nibbles(codes, data)


@numba.njit(cache=True)
def _fp4_kernel(words, scale, table, out, search):
    """FP4 face rows uint64 [O, I/16] + E8M0 uint8 [O, I/32] -> bfp4_b tiles in out (rows padded to 32)."""
    rows, ng = words.shape
    tile_row = (ng // 2) * 576
    emax, data = np.zeros(ng, np.uint8), np.zeros(ng, np.uint64)
    bits, ex, emax1 = np.empty(16, np.uint32), np.empty(16, np.uint32), np.empty(1, np.uint8)
    codes, data16 = np.empty(16, np.uint8), np.empty(8, np.uint8)
    for r in range((rows + 31) // 32 * 32):
        for g in range(ng if r < rows else 0):
            w, e = words[r, g], np.int64(scale[r, g >> 1])
            cls = _fp4_class(w, search)
            if _SAFE_E8M0[0] <= e <= _SAFE_E8M0[1]:
                emax[g] = e + _FP4_CLASS_EXP[cls] if cls >= 0 else 0
                t = max(cls, 0)  # an all-zero row looks up zeros in any class
                v = np.uint64(0)
                for k in range(8):
                    v |= np.uint64(table[t, (w >> np.uint64(8 * k)) & np.uint64(0xFF)]) << np.uint64(8 * k)
                data[g] = v
            else:
                _fp4_face_row_generic(w, e, bits, ex, emax1, codes, data16, search)
                emax[g], data[g] = emax1[0], data16.view(np.uint64)[0]
        if r == rows:  # padding rows below the matrix
            emax[:], data[:] = 0, 0
        _put_row(out, (r // 32) * tile_row, r % 32, emax, data, 8)


_fp4_table_cache: list[np.ndarray] = []


def _as_bytes(t, what: str) -> np.ndarray:
    """int8/uint8/float8_e8m0fnu tensor or array -> C-contiguous, 8-byte aligned uint8 ndarray (no copy if possible)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.element_size() != 1:
            raise BfpError(f"{what} must hold bytes (int8/uint8/float8_e8m0fnu), got {t.dtype}")
        t = t.detach().cpu().contiguous().view(torch.uint8).numpy()
    a = np.asarray(t)
    if a.dtype.itemsize != 1:
        raise BfpError(f"{what} must hold bytes (int8/uint8), got {a.dtype}")
    a = np.ascontiguousarray(a).view(np.uint8)
    return a if a.ctypes.data % 8 == 0 else a.copy()


def fp4_to_bfp4(packed, scale, search: bool = False) -> np.ndarray:
    """FP4 I8 [O, I/2] + E8M0 [O, I/32] -> bfp4_b tiles uint8, = pack(fp4.dequant(packed, scale), search=search)
    without fp32 W."""
    p, s = _as_bytes(packed, "FP4 weight"), _as_bytes(scale, "E8M0 scale")
    if p.ndim != 2 or s.ndim != 2 or p.shape[0] != s.shape[0] or p.shape[1] != 16 * s.shape[1]:
        raise BfpError(f"FP4 weight {p.shape} and E8M0 scale {s.shape} are not [O, I/2] and [O, I/32]")
    rows, cols = p.shape[0], 2 * p.shape[1]
    out = np.empty(packed_size((rows, cols), "bfp4_b"), dtype=np.uint8)
    if not out.size:
        return out
    if not _fp4_table_cache:
        _fp4_table_cache.append(_fp4_byte_table())
    _fp4_kernel(_frozen(p.view(np.uint64)), _frozen(s), _frozen(_fp4_table_cache[0]), out, bool(search))
    _fp4_nan_scales(p, s, out, search)
    return out


def _fp4_nan_scales(p: np.ndarray, s: np.ndarray, out: np.ndarray, search: bool) -> None:
    """Redo tile rows holding an E8M0 0xFF (NaN) scale through fp4.dequant: the NaN bits come from its float math."""
    bad = np.flatnonzero((s == 0xFF).any(axis=1)) // tiles.TILE
    if not bad.size:
        return
    import torch

    from dsflash.formats import fp4

    tile_row = packed_size((tiles.TILE, 2 * p.shape[1]), "bfp4_b")
    for ti in np.unique(bad):
        rows = slice(ti * tiles.TILE, (ti + 1) * tiles.TILE)
        w = fp4.dequant(torch.from_numpy(p[rows]).view(torch.int8), torch.from_numpy(s[rows]))
        out[ti * tile_row : (ti + 1) * tile_row] = pack(w, "bfp4_b", search)


# ---------------------------------------------------------------- self-check against shipped golden bytes

SELFCHECK_CASES = ("faces", "single_element_1x1")


def self_check(path=None) -> None:
    """Reproduce the golden cases in dsflash/data/bfp_selfcheck (or path) byte for byte; raise StoreCorrupt if not."""
    path = Path(path) if path is not None else resources.files("dsflash") / "data" / "bfp_selfcheck" / "cases.npz"
    try:
        with path.open("rb") as f, np.load(f) as z:
            golden = {k: z[k] for k in z.files}
        cases = [
            (n, golden[f"{n}.input"], fmt, golden[f"{n}.{fmt}"], golden[f"{n}.{fmt}.unpacked"])
            for n in SELFCHECK_CASES
            for fmt in MANTISSA_BITS
        ]
    except (OSError, KeyError, ValueError) as e:
        raise StoreCorrupt(f"bfp self-check: cannot read the golden cases in {path}: {e}") from None
    for name, x, fmt, want, decoded in cases:
        got = pack(x, fmt)
        if got.shape != want.shape or not np.array_equal(got, want):
            raise StoreCorrupt(f"bfp self-check: {fmt} pack of '{name}' {_first_difference(got, want)}")
        if not np.array_equal(unpack(want, fmt, x.shape).view(np.uint32), decoded.view(np.uint32)):
            raise StoreCorrupt(f"bfp self-check: {fmt} unpack of '{name}' differs from ttnn's decode")


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"has {got.size} bytes, the golden vector {want.size}"
    i = int(np.flatnonzero(got != want)[0])
    return f"differs from ttnn's bytes first at byte {i} (0x{got[i]:02x}, expected 0x{want[i]:02x})"
