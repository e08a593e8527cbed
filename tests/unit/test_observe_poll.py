"""`p2p-diloco observe --poll-s SECONDS`: how often the observer reads the run's records. Each read
is DHT requests the run's nodes serve; the default keeps the observer under 5 % of a 3-peer run's
DHT requests (bench/observer_load.py)."""

import pytest

from p2p_diloco import cli
from p2p_diloco import config as config_mod

RUN = ["observe", "--config", "run.toml", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"]


def test_the_default_poll_is_the_measured_one():
    assert cli.build_parser().parse_args(RUN).poll_s == cli.OBSERVE_POLL_S == 5.0


def test_a_poll_interval_is_taken_in_seconds():
    assert cli.build_parser().parse_args([*RUN, "--poll-s", "0.5"]).poll_s == 0.5


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "fast"])
def test_a_poll_interval_that_is_no_positive_time_is_refused_in_one_line(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args([*RUN, "--poll-s", bad])
    assert exit_.value.code == 2
    assert f"a number of seconds, more than 0, not {bad!r}" in capsys.readouterr().err


def test_observe_polls_at_the_interval_given(tmp_path, monkeypatch):
    import p2p_diloco.observe.service
    import p2p_diloco.swarm.run_reader
    import p2p_diloco.train.metrics

    config_mod.save(config_mod.load(None, {}), tmp_path / "run.toml")
    polled = {}

    class Reader:  # no DHT: what cmd_observe hands to observe() is all this test looks at
        poll, healthy = object(), object()

        def __init__(self, config, identity):
            pass

        def close(self):
            polled["closed"] = True

    def observe(config, poll, healthy, host, port, stop, emit, poll_s=1.0, evaluate=None):
        polled["poll_s"] = poll_s

    monkeypatch.setattr(p2p_diloco.swarm.run_reader, "Observer", Reader)
    monkeypatch.setattr(p2p_diloco.observe.service, "observe", observe)
    monkeypatch.setattr(p2p_diloco.observe.service, "evaluation", lambda *args: None)
    monkeypatch.setattr(p2p_diloco.train.metrics, "setup_logging", lambda level: None)
    monkeypatch.setattr(cli, "_install_stop_handlers", lambda *args, **kwargs: None)
    run = [*RUN, "--poll-s", "7.5"]
    run[2] = str(tmp_path / "run.toml")
    assert cli.main(run) == 0
    assert polled == {"poll_s": 7.5, "closed": True}


def test_a_newer_rounds_agreed_digest_is_looked_for_polling_between_looks_until_its_deadline(monkeypatch):
    import threading
    import time

    from p2p_diloco.observe import service

    polls, looks = [], iter(["", "", "d1"])
    assert service.settled(lambda: next(looks), threading.Lock(), lambda: polls.append(1)) == "d1"
    assert len(polls) == 2, "a poll between two looks, none before the first"
    polls.clear()
    assert service.settled(lambda: "d0", threading.Lock(), lambda: polls.append(1)) == "d0" and not polls
    monkeypatch.setattr(service, "AGREED_WAIT_S", 0.3)
    started = time.monotonic()
    assert service.settled(lambda: "", threading.Lock(), lambda: None) == ""
    assert 0.3 <= time.monotonic() - started < 0.3 + service.AGREED_POLL_S
