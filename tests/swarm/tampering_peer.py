"""A peer that lies: it trains and publishes honest digests, but serves joiners a tampered θ.

Run as `python -m tests.swarm.tampering_peer peer ...` (the same arguments as `p2p-diloco peer`).
"""

import sys

from p2p_diloco import cli, peer


def _serve_tampered(self):
    metadata, (theta, momentum) = _honest(self)
    return metadata, [theta + 1e-3, momentum]


_honest = peer.Peer.serve_state
peer.Peer.serve_state = _serve_tampered

if __name__ == "__main__":
    sys.exit(cli.main())
