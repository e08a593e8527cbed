"""`p2p-diloco` with the gate of tests/swarm/round_gate.py (ROUND_GO): an honest peer that
starts its first round together with the others of its test. Same arguments as p2p-diloco peer."""

import sys

from p2p_diloco import cli
from tests.swarm.round_gate import install_gate

install_gate()

if __name__ == "__main__":
    sys.exit(cli.main())
