"""AveragingStep._wait_for: a step still in matchmaking ends once the swarm finished the round."""

from concurrent.futures import TimeoutError as FuturesTimeout
from types import SimpleNamespace

import pytest
from hivemind.averaging.control import AveragingStage

from p2p_diloco.swarm.averaging.step import AveragingStep, Overtook


class Control:
    """hivemind's StepControl as the wait sees it: a result that never comes (a group that never forms)."""

    def __init__(self, began_allreduce: bool, ends_after_reads: int = 0):
        self.began_allreduce = began_allreduce
        self.cancelled = False
        self.waits = 0
        self.reads_left = ends_after_reads  # the averager process ends a cancelled step a little later

    @property
    def stage(self):
        if self.cancelled and self.reads_left == 0:
            return AveragingStage.FINISHED
        self.reads_left -= self.cancelled
        return AveragingStage.LOOKING_FOR_GROUP

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
    step.sc = SimpleNamespace(matchmaking_time_s=4.0)
    step.idle = iter([False, True])  # the averager's look for a group lingers a moment after the step ended
    step.averager = SimpleNamespace(matchmaking_idle=lambda timeout: next(step.idle))
    return step


def test_a_step_in_matchmaking_is_cancelled_at_the_first_check_after_the_swarm_moved_on_and_ended_first():
    # Ended in the averager process before the peer goes on: a step still matchmaking there formed
    # a group with the next round's members once the next step changed the group key (seen under a hog).
    control, checks, step = Control(began_allreduce=False, ends_after_reads=3), iter([False, False, True]), a_step()
    with pytest.raises(Overtook):
        step._wait_for(control, deadline=60.0, overtaken=lambda: next(checks))
    assert control.cancelled and control.waits == 3 and control.stage == AveragingStage.FINISHED
    assert control.reads_left == 0
    assert next(step.idle, None) is None, "it returned before the averager's look for a group ended"


def test_an_allreduce_that_began_is_never_cut_by_the_swarm_moving_on():
    # its members completed it or will fail it together: cancelling it would fail the others
    control = Control(began_allreduce=True)
    with pytest.raises(FuturesTimeout):
        a_step()._wait_for(control, deadline=0.05, overtaken=lambda: True)
    assert not control.cancelled


def test_the_next_rounds_key_waits_until_the_last_steps_look_for_a_group_ended():
    """hivemind's look for a group re-declares itself under the averager's *current* key every few
    seconds. A cancelled step whose look had not ended yet (hivemind ends it in its clean-up) was
    moved by the next step's key into the next round's group: "group members [...] averaged another
    round; result dropped", a round lost (hog run A9, test_peer_hangs_between_its_allreduce_and_the_audit).
    DiLoCoAverager._set_group_bits, the averager-process side of set_round_key, takes the
    matchmaking lock first, so the key changes only once no look runs."""
    import asyncio
    from types import SimpleNamespace

    from hivemind.utils.mpfuture import MPFuture

    from p2p_diloco.swarm.averaging.averager import DiLoCoAverager

    async def scenario():
        keys = SimpleNamespace(group_bits="0100")
        matchmaking = SimpleNamespace(lock_looking_for_group=asyncio.Lock(), group_key_manager=keys)
        averager, future, seen = SimpleNamespace(_matchmaking=matchmaking), MPFuture(), []
        async with matchmaking.lock_looking_for_group:  # the cancelled step's look, still running
            task = asyncio.create_task(DiLoCoAverager._set_group_bits(averager, "0101", future))
            for _ in range(5):  # the look re-declares meanwhile: under the key it started with
                await asyncio.sleep(0)
                seen.append(keys.group_bits)
        await asyncio.wait_for(task, 1.0)
        return seen, keys.group_bits, future.result(timeout=1.0)

    seen, after, answer = asyncio.run(scenario())
    assert seen == ["0100"] * 5 and after == "0101" and answer is None


def test_a_step_that_found_no_group_is_told_from_a_failed_all_reduce_by_hiveminds_text():
    """hivemind's own `_step`, given a matchmaking that found nobody by the step's deadline, sets
    the AllreduceException an all-reduce that failed raises too: only its text says no group
    formed (step.found_no_group). A hivemind that words it otherwise fails here, not in a swarm
    where every lonely round would become a failed one."""
    import asyncio

    from hivemind.averaging.allreduce import AllreduceException
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.control import StepControl
    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.utils import get_dht_time
    from hivemind.utils.mpfuture import MPFuture

    from p2p_diloco.swarm.averaging.step import found_no_group

    class NobodyCame:  # hivemind's Matchmaking when its look ends at the deadline with no group
        async def look_for_group(self, step):
            step.allow_allreduce()  # as start_step does: no trigger to wait for
            return None

    async def step_without_a_group():
        init = MPFuture()  # the first future made in a process starts hivemind's backend (not a subclass)
        averager = SimpleNamespace(_matchmaking=NobodyCame(), _pending_groups_registered=asyncio.Event())
        step = StepControl(get_dht_time(), get_dht_time() + 5.0, allow_retries=False, weight=1.0, data_for_gather=b"")
        await asyncio.wait_for(DecentralizedAverager._step(averager, step=step, future_for_init=init), 5.0)
        return step

    error = asyncio.run(step_without_a_group()).exception(timeout=1.0)
    assert type(error) is AllreduceException and found_no_group(error), repr(error)
    failed = AllreduceException("QmPeer sent AVERAGED_DATA_WRONG_SIZE")  # hivemind's runner: a group that failed
    assert not found_no_group(failed)
    assert not found_no_group(MatchmakingException("Unable to run All-Reduce: could not find a group"))
