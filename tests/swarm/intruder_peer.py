"""A peer that joins a certified run without a certificate: it skips its own admission check (as a
modified client would) and then behaves like any peer: it publishes records, looks for groups and
offers its state.

Run as `python -m tests.swarm.intruder_peer peer ...` (the same arguments as `p2p-diloco peer`).
"""

import sys

from p2p_diloco import cli
from p2p_diloco.swarm.trust import gate


def _no_certificate(self, config):
    return None


gate.Gate._own_certificate = _no_certificate

if __name__ == "__main__":
    sys.exit(cli.main())
