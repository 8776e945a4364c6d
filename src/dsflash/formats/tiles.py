"""32x32 tiles of four 16x16 faces: padding, tile grid and the face-row order of tt-metal's TILED_NFACES layout."""

from __future__ import annotations

import numpy as np

TILE = 32
FACE = 16
FACE_ROWS_PER_TILE = 4 * FACE  # one shared exponent per face row


def tile_grid(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """[..., H, W] -> (batch, tile rows, tile cols); each [H, W] slice is padded to multiples of 32 on its own."""
    if len(shape) < 2:
        raise ValueError(f"tiles need a shape [..., H, W], got {tuple(shape)}")
    batch = int(np.prod(shape[:-2], dtype=np.int64))
    h, w = int(shape[-2]), int(shape[-1])
    if batch < 0 or h < 0 or w < 0:
        raise ValueError(f"negative dimension in {tuple(shape)}")
    return batch, -(-h // TILE), -(-w // TILE)


def n_tiles(shape: tuple[int, ...]) -> int:
    """Number of 32x32 tiles that hold a [..., H, W] tensor."""
    b, th, tw = tile_grid(shape)
    return b * th * tw


def tilize(x: np.ndarray) -> np.ndarray:
    """[..., H, W] -> [n_tiles * 64, 16] zero-padded face rows in order (batch, tile row, tile col, face, row)."""
    b, th, tw = tile_grid(x.shape)
    x = x.reshape(b, x.shape[-2], x.shape[-1])
    padded = np.zeros((b, th * TILE, tw * TILE), dtype=x.dtype)
    padded[:, : x.shape[1], : x.shape[2]] = x
    # [b, ti, row-half, r, tj, col-half, c] -> [b, ti, tj, row-half, col-half, r, c]: face = 2 * row-half + col-half
    t = padded.reshape(b, th, 2, FACE, tw, 2, FACE).transpose(0, 1, 4, 2, 5, 3, 6)
    return np.ascontiguousarray(t).reshape(-1, FACE)


def untilize(rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """[n_tiles * 64, 16] face rows -> [..., H, W] (the inverse of tilize, cropped to shape)."""
    b, th, tw = tile_grid(shape)
    t = rows.reshape(b, th, tw, 2, 2, FACE, FACE).transpose(0, 1, 3, 5, 2, 4, 6)
    full = t.reshape(b, th * TILE, tw * TILE)
    return np.ascontiguousarray(full[:, : shape[-2], : shape[-1]]).reshape(shape)
