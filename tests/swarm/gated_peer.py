"""`p2p-diloco` with the start gate of tests/swarm/start_gate.py (START_GO): an honest peer that
starts its run together with the others of its test. Same arguments as p2p-diloco peer."""

import sys

from p2p_diloco import cli
from tests.swarm.start_gate import install_gate

install_gate()

if __name__ == "__main__":
    sys.exit(cli.main())
