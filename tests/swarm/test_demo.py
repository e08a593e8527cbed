"""`p2p-diloco demo`: a bootstrap node and peer processes, one view, everything ended at the end."""

import subprocess

import pytest

from tests.swarm.conftest import CLI, ENV


@pytest.mark.timeout(240)
def test_demo_runs_two_peers_that_agree_and_stops_them(tmp_path):
    result = subprocess.run([*CLI, "demo", "--peers", "2", "--rounds", "2", "--dir", str(tmp_path / "demo")],
                            capture_output=True, text=True, timeout=220, env=ENV)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    rounds = [line for line in lines if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["0", "1", "2"]
    assert all("digests equal" in line for line in rounds)
    assert "group 2" in rounds[1] and "group 2" in rounds[2]
    assert "peers exited with [0, 0]" in lines
    assert "digests equal on every peer in every round" in result.stdout
