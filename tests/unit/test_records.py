"""DHT records from other peers are untrusted: malformed ones are dropped; majorities are deterministic."""

from p2p_diloco.protocol.agreement import majority
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.trust.records import (
    bucket_bits,
    bucket_prefix,
    convicted_by,
    progress_key,
    round_bits,
    run_prefix,
)

D1, D2 = "a" * 32, "b" * 32


def rec(peer, round_, digest):
    return RoundRecord(peer, round_, digest, 10, 1.0)


def test_parse_keeps_good_records_and_drops_malformed_ones():
    good = {"peer": "12D3x", "round": 3, "digest": D1, "tokens": 5, "loss": 2.5, "addrs": ["/ip4/1.2.3.4/tcp/1"]}
    assert RoundRecord.parse(good) == RoundRecord("12D3x", 3, D1, 5, 2.5, ("/ip4/1.2.3.4/tcp/1",))
    for bad in [
        None,
        "text",
        {**good, "round": -1},
        {**good, "digest": "zz"},
        {**good, "tokens": "many"},
        {k: v for k, v in good.items() if k != "peer"},
        {**good, "peer": "x" * 500},
        {**good, "groups": 0},
        {**good, "groups": 1025},
        {**good, "groups": True},
        {**good, "spans": -1},
        {**good, "spans": 2.0},
    ]:
        assert RoundRecord.parse(bad) is None, bad
    two_level = RoundRecord.parse({**good, "groups": 3, "spans": 16})
    assert (two_level.groups, two_level.spans) == (3, 16)
    flat = RoundRecord.parse(good)  # a flat round's, or an older peer's
    assert (flat.groups, flat.spans) == (1, 0)


def test_ties_go_to_the_smallest_digest_so_every_peer_picks_the_same():
    assert majority({"p1": D2, "p2": D1}) == D1
    assert majority({"p1": D2, "p2": D2, "p3": D1}) == D2


def test_keys_separate_runs_configs_and_rounds():
    assert run_prefix("my run.v2", "abc") == "my_run_v2-abc"
    assert round_bits(5) == "0" * 29 + "101" and len({round_bits(r) for r in range(100)}) == 100


def test_each_bucket_of_each_bucket_count_meets_under_bits_of_its_own():
    bits = {round_bits(3) + bucket_bits(b, g) for g in (1, 2, 3, 64, 1024) for b in range(g)}
    assert len(bits) == 1 + 2 + 3 + 64 + 1024
    assert all(set(b) <= {"0", "1"} and len(b) == 64 for b in bits)
    assert bucket_bits(5, 6) == "0" * 13 + "110" + "0" * 13 + "101"


def test_records_by_bucket_have_a_key_per_round_and_bucket_and_one_bucket_is_the_run_s_own_key():
    run = run_prefix("r", "abc")
    keys = {progress_key(bucket_prefix(run, r, b, 4)) for r in (7, 8) for b in range(4)}
    assert len(keys) == 8 and progress_key(run) not in keys
    assert progress_key(bucket_prefix(run, 7, 2, 4)) == "r-abc-r7-b2of4_progress"
    assert bucket_prefix(run, 7, 0, 1) == run  # one bucket: the run's keys as today


def test_convictions_are_listed_by_accused_with_who_says_so():
    accusations = {"a": ["m", "x"], "b": ["m"], "m": ["m", "a"], "c": []}
    # m "convicting" itself counts for nothing; m accusing a is listed as it is (the organiser
    # reads how many peers vouch for each, and each accuser judged a signed case first).
    assert convicted_by(accusations) == {"m": ["a", "b"], "x": ["a"], "a": ["m"]}
