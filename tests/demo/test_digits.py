"""The digits-segmentation dataset: shapes, labels, determinism, disjoint splits."""

import numpy as np
import pytest

from syncbn.demo.digits import CLASS_NAMES, NUM_CLASSES, _load_source, make_split, source_pools

sklearn_datasets = pytest.importorskip("sklearn.datasets")


@pytest.fixture(scope="module")
def source():
    bunch = sklearn_datasets.load_digits()
    return bunch.images, bunch.target


def test_source_is_load_digits(source):
    images, targets = _load_source()
    np.testing.assert_array_equal(images, (source[0] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(targets, source[1])


def test_shapes_dtypes_and_ranges():
    data = make_split("train", 24, seed=3)
    assert len(data) == 24
    assert data.images.shape == (24, 1, 32, 32) and data.images.dtype == np.float32
    assert data.masks.shape == (24, 32, 32) and data.masks.dtype == np.int64
    assert data.sources.shape == (24, 4) and data.sources.dtype == np.int64
    assert 0.0 <= data.images.min() and data.images.max() <= 1.0
    assert data.masks.min() >= 0 and data.masks.max() < NUM_CLASSES
    assert NUM_CLASSES == 11 and len(CLASS_NAMES) == 11


def test_two_to_four_digits_per_canvas_and_labels_match_them(source):
    _, targets = source
    data = make_split("val", 40, seed=1)
    for image, mask, sources in zip(data.images, data.masks, data.sources):
        used = sources[sources >= 0]
        assert 2 <= len(used) <= 4
        assert (sources[len(used):] == -1).all()  # padding only at the end
        allowed = set((targets[used] + 1).tolist()) | {0}
        assert set(np.unique(mask).tolist()) <= allowed
        assert (mask > 0).any()
        # every labelled pixel is bright, and the background is mostly dark
        assert image[0][mask > 0].min() > 0.2
        assert (image[0][mask == 0] < 0.5).mean() > 0.9


def test_all_digit_classes_appear():
    data = make_split("train", 200, seed=0)
    assert set(np.unique(data.masks).tolist()) == set(range(NUM_CLASSES))


def test_deterministic_from_the_seed():
    a = make_split("train", 16, seed=7)
    b = make_split("train", 16, seed=7)
    for name in ("images", "masks", "sources"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    c = make_split("train", 16, seed=8)
    assert not np.array_equal(a.masks, c.masks)


def test_a_smaller_set_is_a_prefix_of_a_larger_one():
    small = make_split("val", 5, seed=2)
    large = make_split("val", 12, seed=2)
    np.testing.assert_array_equal(small.images, large.images[:5])
    np.testing.assert_array_equal(small.masks, large.masks[:5])


def test_pools_are_disjoint_and_cover_the_source(source):
    images, _ = source
    for seed in (0, 1, 123):
        train, val = source_pools(seed)
        assert not set(train.tolist()) & set(val.tolist())
        assert len(train) + len(val) == len(images)
        assert abs(len(val) / len(images) - 0.25) < 0.01
    assert not np.array_equal(source_pools(0)[1], source_pools(1)[1])


def test_no_source_digit_in_both_splits(source):
    images, _ = source
    seed = 5
    train = make_split("train", 300, seed=seed)
    val = make_split("val", 300, seed=seed)
    train_used = set(train.sources[train.sources >= 0].tolist())
    val_used = set(val.sources[val.sources >= 0].tolist())
    assert train_used and val_used and not train_used & val_used
    train_pool, val_pool = source_pools(seed)
    assert train_used <= set(train_pool.tolist()) and val_used <= set(val_pool.tolist())
    # and no identical 8x8 picture either (load_digits has no duplicates, check anyway)
    flat = images.reshape(len(images), -1)
    train_pics = {flat[i].tobytes() for i in train_used}
    assert not any(flat[i].tobytes() in train_pics for i in val_used)


def test_other_sizes_and_bad_arguments():
    data = make_split("train", 4, seed=0, size=48, max_digits=5)
    assert data.images.shape == (4, 1, 48, 48) and data.sources.shape == (4, 5)
    with pytest.raises(ValueError):
        make_split("test", 2)
    with pytest.raises(ValueError):
        make_split("train", 2, min_digits=3, max_digits=2)
    with pytest.raises(ValueError):
        make_split("train", 2, size=16, min_scale=20)
