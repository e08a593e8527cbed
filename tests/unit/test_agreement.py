"""Agreement and catch-up decisions (protocol/agreement.py): pure functions, every expected value worked out by hand."""

from p2p_diloco.protocol import agreement
from p2p_diloco.protocol.agreement import Reference
from p2p_diloco.protocol.network import RoundRecord

A, B, C = "a" * 32, "b" * 32, "c" * 32


def rec(peer, round_, digest, serves=True):
    return RoundRecord(peer, round_, digest, tokens=0, loss=0.0, serves=serves)


def records(*rs):
    return {r.peer: r for r in rs}


# majority


def test_the_digest_most_peers_hold_is_the_majority():
    assert agreement.majority({"p1": B, "p2": A, "p3": B}) == B


def test_a_tie_goes_to_the_smallest_digest_so_every_peer_picks_the_same():
    assert agreement.majority({"p1": B, "p2": A}) == A
    assert agreement.majority({"p1": C, "p2": B, "p3": C, "p4": B}) == B


def test_a_single_digest_is_its_own_majority():
    assert agreement.majority({"p1": C}) == C


# live


def test_live_with_rounds_keeps_peers_at_those_rounds_only():
    rs = records(rec("p1", 3, A), rec("p2", 4, A), rec("p3", 5, A))
    assert agreement.live(rs, set(), 3, 4) == {"p1", "p2"}
    assert agreement.live(rs, set(), 5) == {"p3"}
    assert agreement.live(rs, set(), 6) == set()


def test_live_drops_stale_peers():
    rs = records(rec("p1", 3, A), rec("p2", 3, A))
    assert agreement.live(rs, {"p2", "p9"}, 3) == {"p1"}


def test_live_without_rounds_is_every_peer_with_a_record_and_a_heartbeat():
    rs = records(rec("p1", 3, A), rec("p2", 4, A), rec("p3", 5, B))
    assert agreement.live(rs, {"p2", "p9"}) == {"p1", "p3"}
    assert agreement.live(rs, set(), 4) == {"p2"}


# whom_to_wait_for / still_waiting


def test_wait_for_the_group_the_peers_seen_at_the_round_and_me_sorted():
    assert agreement.whom_to_wait_for("p2", ["p3", "p1"], ["p4"]) == ("p1", "p2", "p3", "p4")


def test_wait_for_lists_a_peer_once_even_if_in_group_seen_and_me():
    assert agreement.whom_to_wait_for("p1", ["p1", "p2"], ["p2", "p1"]) == ("p1", "p2")


def test_wait_for_me_alone_when_no_group_and_nobody_seen():
    assert agreement.whom_to_wait_for("p1", [], []) == ("p1",)


def test_still_waiting_for_expected_peers_that_have_not_published():
    assert agreement.still_waiting(("p1", "p2", "p3"), ["p1"], set()) == {"p2", "p3"}


def test_a_stale_peer_is_not_waited_for():
    assert agreement.still_waiting(("p1", "p2", "p3"), ["p1"], {"p3"}) == {"p2"}


def test_nobody_waited_for_once_every_expected_peer_published():
    assert agreement.still_waiting(("p1", "p2"), ["p2", "p1", "p5"], set()) == set()


# tally


def test_tally_counts_my_own_digest_even_if_my_record_is_not_readable_yet():
    digests, missing = agreement.tally(("p1", "p2"), {"p2": A}, "p1", B)
    assert digests == {"p1": B, "p2": A}
    assert missing == []


def test_tally_my_known_digest_overrides_what_was_read_for_me():
    digests, _ = agreement.tally(("p1",), {"p1": A}, "p1", B)
    assert digests == {"p1": B}


def test_tally_lists_missing_peers_in_expected_order():
    digests, missing = agreement.tally(("p4", "p1", "p3", "p2"), {"p3": A}, "p1", A)
    assert digests == {"p1": A, "p3": A}
    assert missing == ["p4", "p2"]


# clients


def test_clients_are_the_peers_whose_records_do_not_serve():
    rs = records(rec("p1", 1, A), rec("p2", 1, A, serves=False), rec("p3", 1, A, serves=False))
    assert agreement.clients(rs, "p1", False) == {"p2", "p3"}


def test_clients_include_me_when_i_am_a_client():
    rs = records(rec("p1", 1, A), rec("p2", 1, A, serves=False))
    assert agreement.clients(rs, "p9", True) == {"p2", "p9"}
    assert agreement.clients(records(rec("p1", 1, A)), "p1", True) == {"p1"}


# reference


def test_reference_is_the_majority_and_its_holders_sorted():
    digest, holders = agreement.reference({"p3": A, "p1": A, "p2": B}, set())
    assert digest == A
    assert holders == ["p1", "p3"]


def test_client_digests_do_not_count_while_a_reachable_peers_digest_is_in():
    # two clients hold B, one reachable peer holds A: A wins, the clients follow the reachable peer
    digest, holders = agreement.reference({"p1": A, "p2": B, "p3": B}, {"p2", "p3"})
    assert digest == A
    assert holders == ["p1"]


def test_client_digests_count_when_only_clients_published():
    digest, holders = agreement.reference({"p1": B, "p2": A, "p3": B}, {"p1", "p2", "p3"})
    assert digest == B
    assert holders == []


def test_holders_exclude_clients_that_hold_the_majority_digest():
    digest, holders = agreement.reference({"p1": A, "p2": A, "p3": A}, {"p2"})
    assert digest == A
    assert holders == ["p1", "p3"]


def test_reference_tie_among_reachable_peers_goes_to_the_smallest_digest():
    digest, holders = agreement.reference({"p1": B, "p2": A, "p3": B}, {"p3"})
    assert digest == A
    assert holders == ["p2"]


# should_adopt


def test_a_peer_that_differs_from_the_majority_adopts_it():
    assert agreement.should_adopt(A, B) is True


def test_a_peer_that_holds_the_majority_keeps_its_state():
    assert agreement.should_adopt(A, A) is False


# counted, backed: the swarm's state is what at least half of the counted peers hold


def test_stale_and_fresh_peers_do_not_count():
    rs = records(rec("p1", 5, A), rec("p2", 5, A), rec("p3", 9, C), rec("p4", 9, C))
    assert agreement.counted(rs, stale={"p2"}, fresh={"p3"}) == {"p1", "p4"}


def test_one_attacker_claiming_a_later_round_backs_nothing_among_four():
    # me + p1 + p2 at (5, A), the attacker m at (9, C): 3 of 4 hold (5, A), 1 of 4 holds (9, C)
    rs = records(rec("p1", 5, A), rec("p2", 5, A), rec("m", 9, C))
    mine = rec("me", 5, A)
    assert agreement.backed(rs, {"p1", "p2", "m"}, "me", mine) == Reference(5, A, ("me", "p1", "p2"))


def test_two_colluders_among_five_back_nothing_either():
    rs = records(rec("p1", 5, A), rec("p2", 5, A), rec("m", 9, C), rec("n", 9, C))
    assert agreement.backed(rs, set(rs), "me", rec("me", 5, A)).round == 5  # 2 of 5 < half


def test_a_joiner_follows_the_state_half_of_the_swarm_holds():
    # the joiner at round 0 and two peers at (5, A): 2 of 3 voters hold it
    rs = records(rec("p1", 5, A), rec("p2", 5, A))
    assert agreement.backed(rs, set(rs), "j", rec("j", 0, B)) == Reference(5, A, ("p1", "p2"))


def test_of_two_peers_each_backs_itself_and_the_later_round_wins():
    rs = records(rec("p1", 6, B))
    assert agreement.backed(rs, {"p1"}, "me", rec("me", 5, A)) == Reference(6, B, ("p1",))


def test_two_halves_of_one_round_go_to_the_smallest_digest():
    rs = records(rec("p1", 5, B), rec("p2", 5, B), rec("p3", 5, A))
    assert agreement.backed(rs, set(rs), "me", rec("me", 5, A)) == Reference(5, A, ("me", "p3"))


def test_three_peers_at_three_rounds_back_nothing():
    rs = records(rec("p1", 7, A), rec("p2", 6, B))
    assert agreement.backed(rs, set(rs), "me", rec("me", 5, C)) is None


def test_a_sybil_flood_of_fresh_ids_is_not_counted():
    rs = records(rec("p1", 5, A), *(rec(f"s{i}", 9, C) for i in range(5)))
    assert agreement.backed(rs, {"p1"}, "me", rec("me", 5, A)) == Reference(5, A, ("me", "p1"))


def test_without_a_state_given_this_peers_own_record_votes():
    rs = records(rec("me", 5, A), rec("p1", 5, A), rec("m", 6, C))
    assert agreement.backed(rs, {"p1", "m"}, "me") == Reference(5, A, ("me", "p1"))
    assert agreement.backed(records(rec("p1", 6, C)), {"p1"}, "me") == Reference(6, C, ("p1",))


def test_clients_count_only_while_no_serving_peer_does():
    # the client is at a later round, and its digest would win round 5 too: neither counts
    rs = records(rec("p1", 5, A), rec("p2", 9, C, serves=False), rec("p3", 5, C, serves=False))
    assert agreement.backed(rs, set(rs), "me") == Reference(5, A, ("p1",))
    # a client follows the reachable peer: its own state does not vote
    assert agreement.backed(rs, set(rs), "p3", rec("p3", 5, C, serves=False)) == Reference(5, A, ("p1",))
    only_clients = records(rec("p2", 5, C, serves=False))
    assert agreement.backed(only_clients, {"p2"}, "me") == Reference(5, C, ())


# runs_ahead


def test_a_peer_alone_ahead_of_the_backed_state_runs_ahead():
    rs = records(rec("p1", 5, B), rec("p2", 5, B))
    state = agreement.backed(rs, set(rs), "me", rec("me", 6, A))
    assert state == Reference(5, B, ("p1", "p2"))
    assert agreement.runs_ahead(state, rs, set(rs), 6, A) is True


def test_a_peer_whose_state_is_backed_does_not_run_ahead():
    rs = records(rec("p1", 6, A), rec("p2", 5, B))
    assert agreement.runs_ahead(Reference(6, A, ("me", "p1")), rs, set(rs), 6, A) is False


def test_a_peer_behind_the_backed_state_catches_up_instead():
    rs = records(rec("p1", 6, B), rec("p2", 6, B))
    assert agreement.runs_ahead(Reference(6, B, ("p1", "p2")), rs, set(rs), 5, A) is False


def test_with_nothing_backed_only_peers_with_someone_behind_them_wait():
    rs = records(rec("p1", 7, A), rec("p2", 6, B), rec("p3", 5, C))
    assert agreement.runs_ahead(None, rs, set(rs), 7, A) is True
    assert agreement.runs_ahead(None, rs, set(rs), 5, C) is False


def test_peers_behind_that_do_not_count_or_cannot_serve_are_not_waited_for():
    rs = records(rec("p1", 5, B), rec("p2", 4, B, serves=False))
    assert agreement.runs_ahead(None, rs, {"p2"}, 6, A) is False
    assert agreement.runs_ahead(None, rs, set(), 6, A) is False


# catch_up_target


def test_a_later_round_is_the_target():
    ref = Reference(6, A, ("p1",))
    assert agreement.catch_up_target(ref, 5, A, False) is ref


def test_the_same_round_with_the_same_digest_needs_no_download():
    assert agreement.catch_up_target(Reference(5, A, ("p1",)), 5, A, False) is None


def test_the_same_round_with_another_digest_is_the_target():
    ref = Reference(5, B, ("p1",))
    assert agreement.catch_up_target(ref, 5, A, False) is ref


def test_an_earlier_round_is_not_downloaded_by_a_reachable_peer():
    assert agreement.catch_up_target(Reference(4, B, ("p1",)), 5, A, False) is None


def test_a_client_follows_the_reachable_peers_even_to_an_earlier_round():
    ref = Reference(4, B, ("p1",))
    assert agreement.catch_up_target(ref, 5, A, True) is ref


def test_no_target_when_the_swarm_has_no_backed_state_or_nobody_serves_it():
    assert agreement.catch_up_target(None, 5, A, False) is None
    assert agreement.catch_up_target(None, 5, A, True) is None
    assert agreement.catch_up_target(Reference(6, B, ()), 5, A, False) is None


# download_sources


def test_download_sources_never_include_me_and_keep_the_order():
    assert agreement.download_sources(("p1", "p2", "p3", "p4"), "p3") == ["p1", "p2", "p4"]
    assert agreement.download_sources(["p4", "p2"], "p9") == ["p4", "p2"]
    assert agreement.download_sources(["p1"], "p1") == []


# expected_group


def test_expected_group_is_the_larger_of_the_swarms_progress_and_the_peers_at_the_rounds():
    assert agreement.expected_group(4, {"p1", "p2"}) == 4
    assert agreement.expected_group(2, {"p1", "p2", "p3"}) == 3
    assert agreement.expected_group(0, set()) == 0


# still_finishing


def test_still_finishing_lists_live_peers_at_any_round_without_my_final_state():
    rs = records(
        rec("p1", 10, A),  # holds my final state: done
        rec("p2", 10, B),  # final round, other state
        rec("p3", 9, A),  # round before, already holds my state (same digest)
        rec("p4", 9, B),  # round before, other state
        rec("p5", 8, B),  # further behind: it will catch up to the final state
        rec("p6", 10, C),  # stale
        rec("p7", 0, C),  # starting up: settling or downloading from round 0
    )
    assert agreement.still_finishing(rs, {"p6"}, 10, A) == ["p2", "p4", "p5", "p7"]


def test_a_state_an_honest_peer_copied_is_not_a_second_vote_for_it():
    # a caught up to the attacker's state in the seconds after the start, when it saw only m: the
    # state has one peer that made it (m) of four voters, so c does not follow, and a is ahead alone
    rs = records(rec("a", 1, C), rec("m", 1, C), rec("b", 0, A))
    rs["a"] = RoundRecord("a", 1, C, tokens=0, loss=0.0, copied=True)
    state = agreement.backed(rs, set(rs), "c", rec("c", 0, A))
    assert state == Reference(0, A, ("b", "c"))
    assert agreement.runs_ahead(state, rs, set(rs) | {"c"}, 1, C) is True


def test_a_record_says_whether_its_state_was_copied_and_old_records_made_theirs():
    good = {"peer": "p1", "round": 3, "digest": A, "tokens": 5, "loss": 2.5}
    assert RoundRecord.parse(good).copied is False
    assert RoundRecord.parse({**good, "copied": True}).copied is True


def test_private_peers_hold_a_state_for_a_peer_that_reaches_them_directly():
    # An all-home swarm (hole punching): p1 and p2 private at (5, A). A joiner at round 0 with no
    # direct connection has nobody to download from; with one to p2 (punched), p2 holds it for it.
    rs = records(rec("p1", 5, A, serves=False), rec("p2", 5, A, serves=False))
    joiner = rec("j", 0, B, serves=False)
    assert agreement.backed(rs, set(rs), "j", joiner) == Reference(5, A, (), 2)
    assert agreement.backed(rs, set(rs), "j", joiner, reachable={"p2"}) == Reference(5, A, ("p2",), 2)
    # beside a public peer only the public one votes, as before: a punched private peer holds no vote
    rs = records(rec("pub", 5, A), rec("p2", 5, C, serves=False))
    assert agreement.backed(rs, set(rs), "j", joiner, reachable={"p2"}) == Reference(5, A, ("pub",), 1)
