"""A small semantic-segmentation dataset built from scikit-learn's bundled digits.

``sklearn.datasets.load_digits`` ships 1797 handwritten digits of 8x8 pixels inside the
scikit-learn package, so nothing is downloaded. Each canvas here (32x32 by default) holds
2 to 4 of them, each upscaled to a random size and put at a random place, and every pixel
is labelled:

    0          background
    1 .. 10    a stroke of digit 0 .. 9 (label = digit + 1)

so there are :data:`NUM_CLASSES` = 11 classes.

The source digits are first split, by the seed, into two disjoint pools: training
canvases draw only from the training pool and validation canvases only from the
validation pool, so no source image appears in both splits. Canvas ``i`` of a split
depends only on ``(seed, split, i)``: a smaller set is a prefix of a larger one, and
the same seed gives the same arrays on every process and machine.

Only numpy and scikit-learn are needed (no torch), so other frameworks can use it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

import numpy as np

__all__ = [
    "NUM_CLASSES",
    "CLASS_NAMES",
    "DigitsSegmentation",
    "source_pools",
    "make_split",
]

NUM_CLASSES = 11
CLASS_NAMES = ("background",) + tuple(str(d) for d in range(10))

_SPLITS = {"train": 0, "val": 1}
_POOL_STREAM = 2  # the random stream that splits the source digits into pools
_STROKE = 0.25  # a pixel brighter than this (on a 0..1 scale) belongs to the digit


@dataclass(frozen=True)
class DigitsSegmentation:
    """One split: ``images`` float32 (n, 1, S, S) in [0, 1]; ``masks`` int64 (n, S, S)
    in 0..10; ``sources`` int64 (n, max(4, max_digits)), the indices into
    ``load_digits()`` of the digits drawn on each canvas, padded with -1."""

    images: np.ndarray
    masks: np.ndarray
    sources: np.ndarray

    def __len__(self) -> int:
        return len(self.images)


def _read_bundled_csv():
    """The (1797, 65) table behind ``load_digits`` (8x8 pixels, then the class), read
    straight from the file scikit-learn ships, without importing scikit-learn (which
    costs seconds in each worker process). None if the file is not where expected."""
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, "rt") as fh:
                table = np.loadtxt(fh, delimiter=",")
            if table.shape == (1797, 65):
                return table
    return None


@lru_cache(maxsize=1)
def _load_source() -> Tuple[np.ndarray, np.ndarray]:
    """The source digits as float32 (1797, 8, 8) in [0, 1] and their classes."""
    table = _read_bundled_csv()
    if table is None:  # another layout: ask scikit-learn
        from sklearn.datasets import load_digits

        bunch = load_digits()
        table = np.concatenate([bunch.data, bunch.target[:, None]], axis=1)
    images = (table[:, :64].reshape(-1, 8, 8) / 16.0).astype(np.float32)  # 0..16 in the file
    return images, table[:, 64].astype(np.int64)


def source_pools(seed: int, val_fraction: float = 0.25) -> Tuple[np.ndarray, np.ndarray]:
    """Disjoint index arrays (train pool, val pool) into the 1797 source digits."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    total = len(_load_source()[0])
    order = np.random.default_rng([seed, _POOL_STREAM]).permutation(total)
    n_val = int(round(total * val_fraction))
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def _resize(image: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of a square image to ``size`` x ``size`` (corner pixels aligned)."""
    src = image.shape[0]
    # row i of ``weights`` linearly interpolates output position i from the source pixels
    coords = np.linspace(0.0, src - 1.0, size)
    weights = np.maximum(0.0, 1.0 - np.abs(coords[:, None] - np.arange(src)[None, :]))
    return (weights @ image @ weights.T).astype(np.float32)


def _overlaps(box, boxes) -> bool:
    top, left, size = box
    for t, l, s in boxes:
        if top < t + s and t < top + size and left < l + s and l < left + size:
            return True
    return False


def _canvas(rng, pool, size, min_digits, max_digits, min_scale, max_scale):
    digits, targets = _load_source()
    image = np.zeros((size, size), np.float32)
    mask = np.zeros((size, size), np.int64)
    sources = np.full(max(4, max_digits), -1, np.int64)
    boxes = []
    for k in range(int(rng.integers(min_digits, max_digits + 1))):
        index = int(pool[rng.integers(len(pool))])
        side = int(rng.integers(min_scale, max_scale + 1))
        # a few tries at a free spot; if the canvas is crowded, allow an overlap
        for _ in range(20):
            box = (int(rng.integers(0, size - side + 1)), int(rng.integers(0, size - side + 1)), side)
            if not _overlaps(box, boxes):
                break
        boxes.append(box)
        top, left, _ = box
        glyph = _resize(digits[index], side)
        window = (slice(top, top + side), slice(left, left + side))
        np.maximum(image[window], glyph, out=image[window])
        mask[window][glyph > _STROKE] = targets[index] + 1  # the later digit is on top
        sources[k] = index
    return image, mask, sources


def make_split(
    split: str,
    n: int,
    seed: int = 0,
    size: int = 32,
    min_digits: int = 2,
    max_digits: int = 4,
    min_scale: int = 8,
    max_scale: int | None = None,
    val_fraction: float = 0.25,
) -> DigitsSegmentation:
    """``n`` canvases of the ``"train"`` or ``"val"`` split.

    Each canvas has ``min_digits..max_digits`` digits, each resized to a square side
    drawn from ``min_scale..max_scale`` pixels (default: up to half the canvas).
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    max_scale = size // 2 if max_scale is None else max_scale
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not 2 <= min_scale <= max_scale <= size:
        raise ValueError(f"need 2 <= min_scale <= max_scale <= size, got {min_scale}, {max_scale}, {size}")
    pool = source_pools(seed, val_fraction)[_SPLITS[split]]
    images = np.zeros((n, 1, size, size), np.float32)
    masks = np.zeros((n, size, size), np.int64)
    sources = np.full((n, max(4, max_digits)), -1, np.int64)
    for i in range(n):
        rng = np.random.default_rng([seed, _SPLITS[split], i])
        images[i, 0], masks[i], sources[i] = _canvas(
            rng, pool, size, min_digits, max_digits, min_scale, max_scale
        )
    return DigitsSegmentation(images, masks, sources)
