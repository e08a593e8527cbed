"""The averager's doors (certified runs), in-process: the certificate a peer shows with its join
request or in the all-gather (parsed by swarm/averaging/gathered.py, tests/unit/test_gathered.py), or
published in the DHT, decides whether it comes in; revocations close every door."""

import asyncio
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.averaging.allreduce import AllreduceException

from p2p_diloco.swarm.trust.doors import Doors
from p2p_diloco.trust import admission

RUN, ALICE, BOB, MALLORY = "run-a", "QmAlice", "QmBob", "QmMallory"
KEY = Ed25519PrivateKey.generate()
ORGANISER = admission.public_key_text(KEY.public_key())


def cert(peer, key=KEY, run=RUN, expires=None):
    return admission.issue(key, run, peer, peer.lower(), expires or int(time.time()) + 3600).to_json()


class Published:
    """The run's published certificates, as the DHT would answer; counts the lookups."""

    def __init__(self, certs):
        self.certs, self.lookups = certs, 0

    async def __call__(self):
        self.lookups += 1
        return self.certs


def doors(published=None):
    return Doors(RUN, ORGANISER, published or Published({}))


@pytest.mark.parametrize(
    "user, problem",
    [
        ({"cert": cert(ALICE)}, None),
        ({"round": 3}, "it showed no certificate"),
        ({"cert": cert(MALLORY)}, "for peer QmMallory, not QmAlice"),  # somebody else's certificate
        ({"cert": cert(ALICE, key=Ed25519PrivateKey.generate())}, "not signed by this run's organiser"),
        ({"cert": cert(ALICE, run="run-b")}, "for run 'run-b'"),
        ({"cert": cert(ALICE, expires=int(time.time()) - 1)}, "expired"),
        ({"cert": "x" * 10_000}, "at most 4096 bytes"),
    ],
)
def test_a_join_request_comes_in_only_with_a_certificate_for_the_requesting_peer(user, problem):
    reason = doors().reason_to_refuse(ALICE, user.get("cert"))
    assert reason is None if problem is None else problem in reason


def test_a_group_with_one_outsider_fails_before_anything_is_averaged():
    d = doors()
    d.check_member(ALICE, cert(ALICE))
    d.check_member(BOB, cert(BOB))
    with pytest.raises(AllreduceException, match="group member QmMallory is not admitted.*nothing averaged"):
        d.check_member(MALLORY, cert(BOB))


def test_state_and_probe_doors_look_up_the_published_certificate_once():
    published = Published({ALICE: cert(ALICE), MALLORY: cert(BOB)})
    d = doors(published)
    assert asyncio.run(d.admitted(ALICE)) and asyncio.run(d.admitted(ALICE))
    assert published.lookups == 1  # cached until the certificate expires
    assert not asyncio.run(d.admitted(MALLORY))  # published somebody else's certificate
    assert not asyncio.run(d.admitted("QmNobody"))  # published nothing
    lookups = published.lookups
    assert not asyncio.run(d.admitted("QmNobody")) and published.lookups == lookups  # refused: rechecked later


def test_a_revocation_closes_every_door_at_once_even_for_a_cached_peer():
    d = doors(Published({ALICE: cert(ALICE)}))
    assert asyncio.run(d.admitted(ALICE))
    d.set_revoked(frozenset({ALICE}))
    assert not asyncio.run(d.admitted(ALICE))
    assert d.reason_to_refuse(ALICE, cert(ALICE)) == "the organiser revoked it"
    with pytest.raises(AllreduceException, match="revoked"):
        d.check_member(ALICE, cert(ALICE))


def test_a_certificate_that_expires_mid_run_closes_the_doors_it_opened(monkeypatch):
    now = time.time()
    published = Published({ALICE: cert(ALICE, expires=int(now) + 60)})
    d = doors(published)
    assert asyncio.run(d.admitted(ALICE))
    monkeypatch.setattr(time, "time", lambda: now + 61)  # a minute later: the cached verdict ran out
    assert not asyncio.run(d.admitted(ALICE)) and published.lookups == 2
    assert "expired" in d.reason_to_refuse(ALICE, published.certs[ALICE])
