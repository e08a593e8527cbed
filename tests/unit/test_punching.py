"""swarm/punching.py without a network: whom a private peer under hole punching tries again."""

from p2p_diloco.swarm.punching import RETRY_MAX_S, RETRY_S, Punching


def test_a_peer_no_punch_reached_is_tried_again_after_a_wait_that_doubles_up_to_half_an_hour():
    punching = Punching(run_dht=None, relays=[])
    assert punching._due("p", now=0.0)  # never tried
    waits = []
    for failures in range(1, 9):
        punching._failed["p"] = (1000.0, failures)
        wait = next(s for s in range(0, 4000, 10) if punching._due("p", now=1000.0 + s))
        waits.append(wait)
    assert waits == [60, 120, 240, 480, 960, 1800, 1800, 1800]
    assert (RETRY_S, RETRY_MAX_S) == (60.0, 1800.0)  # what the waits above were computed from
    assert punching.shown({"b", "a"}) == {"serves": False, "direct": ["a", "b"]}
