"""AveragingStep._wait_for: a step still in matchmaking ends once the swarm finished the round."""

from concurrent.futures import TimeoutError as FuturesTimeout

import pytest

from p2p_diloco.swarm.step import AveragingStep, Overtook


class Control:
    """hivemind's StepControl as the wait sees it: a result that never comes (a group that never forms)."""

    def __init__(self, began_allreduce: bool):
        self.began_allreduce = began_allreduce
        self.cancelled = False
        self.waits = 0

    def result(self, timeout):
        self.waits += 1
        raise FuturesTimeout()

    def done(self):
        return self.cancelled

    def cancel(self):
        self.cancelled = True


def a_step():
    step = AveragingStep.__new__(AveragingStep)  # the wait needs no averager: its liveness check is replaced
    step.check_averager = lambda: None
    return step


def test_a_step_in_matchmaking_is_cancelled_at_the_first_check_after_the_swarm_moved_on():
    control, checks = Control(began_allreduce=False), iter([False, False, True])
    with pytest.raises(Overtook):
        a_step()._wait_for(control, deadline=60.0, overtaken=lambda: next(checks))
    assert control.cancelled and control.waits == 3


def test_an_allreduce_that_began_is_never_cut_by_the_swarm_moving_on():
    # its members completed it or will fail it together: cancelling it would fail the others
    control = Control(began_allreduce=True)
    with pytest.raises(FuturesTimeout):
        a_step()._wait_for(control, deadline=0.05, overtaken=lambda: True)
    assert not control.cancelled
