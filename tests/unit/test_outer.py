"""The outer step and its checks, against numbers computed by hand."""

import pytest
import torch

from p2p_diloco.errors import PseudoGradError
from p2p_diloco.protocol import outer


def state(values, momentum=None, round_=0):
    p = torch.tensor(values, dtype=torch.float32)
    m = torch.zeros_like(p) if momentum is None else torch.tensor(momentum, dtype=torch.float32)
    return outer.GlobalState(round_, {"w": p}, {"w": m})


def test_weighted_mean_of_one_two_three_with_equal_weights_is_two():
    deltas = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([3.0])}]
    assert outer.weighted_mean(deltas, [1, 1, 1])["w"].item() == 2.0


def test_weighted_mean_weights_by_tokens():
    deltas = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([2.0])}, {"w": torch.tensor([3.0])}]
    # (1*100 + 2*100 + 3*200) / 400 = 900 / 400
    assert outer.weighted_mean(deltas, [100, 100, 200])["w"].item() == pytest.approx(2.25)


def test_weighted_mean_rejects_zero_weights():
    with pytest.raises(ValueError, match="sum to > 0"):
        outer.weighted_mean([{"w": torch.tensor([1.0])}], [0])


def test_pseudo_gradient_is_global_minus_inner():
    delta = outer.pseudo_gradient({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 3.0])})
    assert delta["w"].tolist() == [0.5, -1.0]


def test_nesterov_outer_step_by_hand_over_two_rounds():
    # θ = [10, 10, 10], Δ = [1, 2, 3] both rounds, lr 0.7, μ 0.9.
    # round 1: buf = Δ;            step = Δ + 0.9 Δ = 1.9 Δ;    θ = 10 − 1.33 Δ
    # round 2: buf = 0.9 Δ + Δ = 1.9 Δ; step = Δ + 0.9·1.9 Δ = 2.71 Δ; θ = 10 − 1.33 Δ − 1.897 Δ = 10 − 3.227 Δ
    delta = {"w": torch.tensor([1.0, 2.0, 3.0])}
    s1 = outer.outer_step(state([10.0, 10.0, 10.0]), delta, lr=0.7, momentum=0.9, nesterov=True)
    assert s1.round == 1
    assert s1.params["w"].tolist() == pytest.approx([10 - 1.33, 10 - 2.66, 10 - 3.99])
    assert s1.momentum["w"].tolist() == pytest.approx([1.0, 2.0, 3.0])
    s2 = outer.outer_step(s1, delta, lr=0.7, momentum=0.9, nesterov=True)
    assert s2.params["w"].tolist() == pytest.approx([10 - 3.227, 10 - 6.454, 10 - 9.681], rel=1e-5)  # fp32
    assert s2.momentum["w"].tolist() == pytest.approx([1.9, 3.8, 5.7])


def test_plain_momentum_step_by_hand():
    # without Nesterov the step is the buffer: round 2 step = 1.9 Δ, θ = 10 − 0.7 (1 + 1.9) Δ
    delta = {"w": torch.tensor([1.0])}
    s = state([10.0])
    for _ in range(2):
        s = outer.outer_step(s, delta, lr=0.7, momentum=0.9, nesterov=False)
    assert s.params["w"].item() == pytest.approx(10 - 0.7 * 2.9)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov):
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen)
    deltas = [torch.randn(5, generator=gen) for _ in range(3)]
    ref = torch.nn.Parameter(theta.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
    s = outer.GlobalState(0, {"w": theta.clone()}, {"w": torch.zeros(5)})
    for d in deltas:
        ref.grad = d.clone()
        sgd.step()
        s = outer.outer_step(s, {"w": d}, lr=0.7, momentum=0.9, nesterov=nesterov)
    torch.testing.assert_close(s.params["w"], ref.detach(), rtol=1e-6, atol=1e-6)


def test_outer_step_leaves_its_inputs_untouched():
    s = state([1.0, 2.0], momentum=[0.5, 0.5])
    before = s.digest()
    outer.outer_step(s, {"w": torch.tensor([1.0, 1.0])}, lr=0.7, momentum=0.9, nesterov=True)
    assert s.digest() == before


def test_digest_sees_the_last_bit_and_the_round():
    s = state([1.0, 2.0])
    flipped = s.params["w"].clone()
    flipped.view(torch.int32)[0] ^= 1
    assert outer.digest(0, {"w": flipped}, s.momentum) != s.digest()
    assert outer.digest(1, s.params, s.momentum) != s.digest()
    assert outer.digest(0, {"w": s.params["w"].clone()}, s.momentum) == s.digest()


def test_check_rejects_nan_and_implausible_norm():
    with pytest.raises(PseudoGradError, match="not finite"):
        outer.check_pseudo_gradient({"w": torch.tensor([1.0, float("nan")])}, lr_sum=1.0)
    # RMS 100 against 10 x lr_sum 0.5 = 5
    with pytest.raises(PseudoGradError, match="exceeds"):
        outer.check_pseudo_gradient({"w": torch.full((4,), 100.0)}, lr_sum=0.5)
    assert outer.check_pseudo_gradient({"w": torch.tensor([3.0, 4.0])}, lr_sum=1.0) == pytest.approx(5.0)


def test_initial_state_copies_to_cpu_fp32_with_zero_momentum():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    s = outer.initial_state({"w": p})
    assert s.round == 0 and s.params["w"].dtype == torch.float32
    assert s.momentum["w"].tolist() == [0.0, 0.0, 0.0]
    with torch.no_grad():
        p.add_(1)
    assert s.params["w"].tolist() == [1.0, 1.0, 1.0]


def test_flatten_round_trip_and_size_check():
    like = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    flat = torch.arange(10, dtype=torch.float32)
    back = outer.unflatten(flat, like)
    assert back["a"].tolist() == [[0, 1, 2], [3, 4, 5]] and back["b"].tolist() == [6, 7, 8, 9]
    assert torch.equal(outer.flatten(back), flat)
    with pytest.raises(ValueError, match="does not hold the 10 values"):
        outer.unflatten(torch.zeros(9), like)


def test_dropped_pseudo_gradients_follow_the_rate_and_are_reproducible():
    draws = [outer.is_dropped(0.5, 0, f"peer{p}", r) for p in range(20) for r in range(100)]
    assert 0.45 < sum(draws) / len(draws) < 0.55
    assert draws == [outer.is_dropped(0.5, 0, f"peer{p}", r) for p in range(20) for r in range(100)]
    assert draws != [outer.is_dropped(0.5, 1, f"peer{p}", r) for p in range(20) for r in range(100)]
    assert not any(outer.is_dropped(0.0, 0, f"peer{p}", r) for p in range(20) for r in range(100))


def test_the_average_another_group_applied_is_recovered_from_the_momentum_buffers():
    # One tensor, lr 0.7, μ 0.9, Nesterov. From a state with momentum m, the group applied Δ_b and
    # this peer Δ_a: their momentum is 0.9·m + Δ_b, ours 0.9·m + Δ_a.
    m, delta_a, delta_b = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([-3.0, 1.0])
    start = outer.GlobalState(4, {"w": torch.tensor([10.0, 10.0])}, {"w": m})
    mine = outer.outer_step(start, {"w": delta_a}, 0.7, 0.9, True)
    theirs = outer.outer_step(start, {"w": delta_b}, 0.7, 0.9, True)
    torch.testing.assert_close(outer.implied_average(theirs, start, 0.9, None)["w"], delta_b)  # from the start
    torch.testing.assert_close(outer.implied_average(theirs, mine, 0.9, {"w": delta_a})["w"], delta_b)  # from ours
    assert outer.implied_average(theirs, mine, 0.9, None) is None  # ours without what we applied: unknown
    assert outer.implied_average(outer.outer_step(theirs, {"w": delta_b}, 0.7, 0.9, True), start, 0.9, None) is None
    # cosine by hand: (0.5·-3 + 0.5·1) / (|(0.5, 0.5)|·|(-3, 1)|) = -1 / (0.7071·3.1623) = -0.4472
    assert abs(outer.cosine({"w": delta_a}, {"w": delta_b}) - (-1 / (0.5**0.5 * 10**0.5))) < 1e-9
    assert outer.cosine({"w": delta_a}, {"w": torch.zeros(2)}) == 0.0


def test_one_rule_says_when_an_average_points_against_a_peer_s_own_delta():
    own = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0])}
    assert outer.against_own({"w": torch.tensor([-2.0, 0.0]), "b": torch.tensor([0.0])}, own) == pytest.approx(-1.0)
    # cos = -0.1 / sqrt(1.01): -0.0995, just above AGAINST_COSINE (-0.1): not against
    assert outer.against_own({"w": torch.tensor([-0.1, 1.0]), "b": torch.tensor([0.0])}, own) is None
    assert outer.against_own({"w": torch.tensor([-0.2, 1.0]), "b": torch.tensor([0.0])}, own) == pytest.approx(
        -0.2 / 1.04**0.5
    )
    zero = {"w": torch.zeros(2), "b": torch.zeros(1)}
    assert outer.against_own({"w": torch.tensor([-1.0, 0.0]), "b": torch.tensor([0.0])}, zero) is None
