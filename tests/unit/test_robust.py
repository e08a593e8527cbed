"""The reducer's combinations of a span's parts (trust/robust.py), against values computed by hand."""

import pytest
import torch

from p2p_diloco.trust import robust


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_lower_median_is_an_element():
    assert robust.lower_median([3.0, 1.0, 2.0, 4.0]) == 2.0
    assert robust.lower_median([5.0]) == 5.0


def test_weights_are_capped_at_a_multiple_of_the_median_claim():
    assert robust.cap_weights([1, 1, 1, 1000], 2.0) == [1, 1, 1, 2]
    assert robust.cap_weights([0, 3, 1000, 3], 2.0) == [0, 3, 6, 3]  # lower median of 3, 3, 1000: 3
    assert robust.cap_weights([0, 0], 2.0) == [0, 0]


def test_the_mean_is_the_weighted_mean_and_zero_weights_give_zeros():
    assert torch.equal(robust.aggregate([t(1, 2), t(3, 6)], [1, 3], "mean", 1, 2), t(2.5, 5))
    assert torch.equal(robust.aggregate([t(1, 2), t(3, 6)], [0, 0], "clip", 1, 2), t(0, 0))


def test_clip_scales_an_outsized_part_down_to_the_median_norm():
    # norms 1, 1, 5 -> lower median 1: the third part becomes (0.6, 0.8), then the mean of three
    got = robust.aggregate([t(1, 0), t(0, 1), t(3, 4)], [1, 1, 1], "clip", 1.0, 2.0)
    torch.testing.assert_close(got, t(1.6 / 3, 1.8 / 3))
    # x 1e4 and weight x 1000 from one sender of four: its pull is bounded by an honest part's size
    honest = [t(1, 1), t(1.1, 0.9), t(0.9, 1.1)]
    attacked = robust.aggregate([*honest, t(-1e4, -1e4)], [1, 1, 1, 1000], "clip", 1.0, 2.0)
    assert float((attacked - t(1, 1)).norm()) < 2 * float(t(1, 1).norm())
    assert float(robust.aggregate([*honest, t(-1e4, -1e4)], [1, 1, 1, 1000], "mean", 1.0, 2.0)[0]) < -9000


def test_trimmed_mean_drops_the_extremes_per_coordinate():
    # k = 4: one value dropped at each end -> the mean of the middle two
    got = robust.aggregate([t(1, 40), t(2, 10), t(100, 20), t(3, -5)], [1, 1, 1, 1], "trimmed-mean", 1, 2)
    torch.testing.assert_close(got, t(2.5, 15))
    # a zero-weight sender does not take part; k = 3 left -> the coordinate-wise median
    got = robust.aggregate([t(1), t(2), t(9), t(-50)], [1, 1, 1, 0], "trimmed-mean", 1, 2)
    torch.testing.assert_close(got, t(2))


def test_centered_clip_ignores_a_far_outlier_among_agreeing_parts():
    # three equal honest parts: the median is theirs, their distances are 0, so tau = 0 and the
    # outlier cannot pull at all
    got = robust.aggregate([t(1, 1), t(1, 1), t(1, 1), t(-100, -100)], [1, 1, 1, 1], "centered-clip", 1, 2)
    torch.testing.assert_close(got, t(1, 1))
    # two parts, no outlier: the result stays between them
    got = robust.aggregate([t(0, 0), t(2, 2)], [1, 1], "centered-clip", 1.0, 2.0)
    assert 0 <= float(got[0]) <= 2


def test_an_unknown_aggregator_is_a_clear_error():
    with pytest.raises(ValueError, match="choose one of mean, clip, aligned-clip, centered-clip, trimmed-mean"):
        robust.aggregate([t(1)], [1], "median", 1, 2)


def test_aligned_clip_drops_parts_that_point_against_the_coordinate_wise_median():
    # Three honest parts and two colluders sending -10 x their own. Coordinate-wise lower median of
    # (1, 2), (2, 1), (1, 1), (-10, -20), (-20, -10): (1, 1). Dot products with it: 3, 3, 2, -30, -30:
    # the colluders count for nothing, and the rest is clip's mean of the honest three: (4/3, 4/3).
    honest = [t(1, 2), t(2, 1), t(1, 1)]
    parts = [*honest, t(-10, -20), t(-20, -10)]
    assert robust.aligned(parts, [1, 1, 1, 1, 1]) == [1, 1, 1, 0, 0]
    got = robust.aggregate(parts, [1, 1, 1, 1, 1], "aligned-clip", 1.0, 2.0)
    torch.testing.assert_close(got, t(4 / 3, 4 / 3))
    # clip alone lets them pull back: each is scaled to the median norm sqrt(5), not dropped
    assert float(robust.aggregate(parts, [1] * 5, "clip", 1.0, 2.0).sum()) < 0.5
    # A zero update with a large weight points nowhere: dropped too; zero weights stay zero.
    assert robust.aligned([*honest, t(0, 0)], [1, 1, 0, 1000]) == [1, 1, 0, 0]
    # Without an attacker nothing is dropped: the same bytes as clip.
    assert torch.equal(
        robust.aggregate(honest, [1, 1, 1], "aligned-clip", 1.0, 2.0),
        robust.aggregate(honest, [1, 1, 1], "clip", 1.0, 2.0),
    )
