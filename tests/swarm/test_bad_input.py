"""Bad swarm input gets one clear line and a non-zero exit: taken port, foreign identity, dead peers."""

import socket
import subprocess

import pytest

from p2p_diloco import config
from tests.swarm.conftest import CLI, ENV, SWARM

FAKE_PEER_ID = "QmW6jYSj4CRDDYnptoKGFN2nFvhFYYUrynQh5Nsu72XBP8"


def run_peer(tmp_path, *extra):
    options = [
        f"--{k}={v}" for k, v in {**SWARM, "run.dir": str(tmp_path / "run"), "swarm.join_timeout_s": "10"}.items()
    ]
    return subprocess.run([*CLI, "peer", *options, *extra], capture_output=True, text=True, timeout=120, env=ENV)


def last_line(result):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture
def closed_port():
    """A port that nothing listens on: bound (so nobody else takes it) but never accepting."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.timeout(120)
def test_unreachable_initial_peer(tmp_path, closed_port):
    result = run_peer(tmp_path, "--initial-peers", f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{FAKE_PEER_ID}")
    assert result.returncode == 2, "a wrong address is a problem of the input (errors.EntryUnreachable)"
    assert last_line(result) == (
        f"error: could not reach any initial peer: 127.0.0.1 port {closed_port} refused the connection: nothing "
        f"listens there; check the port against the --initial-peers line the node printed, and that the "
        f"bootstrap node is running"
    )


@pytest.mark.timeout(120)
def test_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = last_line(
            run_peer(tmp_path, "--swarm.port", str(port), "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{FAKE_PEER_ID}")
        )
    assert line.startswith(f"error: port {port} on 127.0.0.1 is not free")


@pytest.mark.timeout(120)
def test_identity_file_that_is_not_a_key(tmp_path, closed_port):
    key = tmp_path / "identity.key"
    key.write_text("this is not a key\n")
    line = last_line(
        run_peer(
            tmp_path,
            "--swarm.identity_path",
            str(key),
            "--initial-peers",
            f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{FAKE_PEER_ID}",
        )
    )
    assert line == (
        f"error: identity file {key} is not a private key; delete it to make a new one (this peer then "
        f"gets a new peer id), or point swarm.identity_path at the right file"
    )
    assert key.read_text() == "this is not a key\n"


@pytest.mark.timeout(120)
def test_status_of_an_unreachable_swarm_is_one_line(tmp_path, closed_port):
    toml = tmp_path / "run.toml"
    config.save(config.load(None, SWARM), toml)
    maddr = f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/{FAKE_PEER_ID}"
    result = subprocess.run(
        [*CLI, "status", "--config", str(toml), "--initial-peers", maddr],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
    )
    assert result.returncode == 2 and last_line(result).startswith("error: could not reach any initial peer")
