"""An experiment for bench/allreduce.py (NOSEAL=1 in the workers' environment): the butterfly without
its accountability: no signature made or checked, no chunk digests, and no audit after it. What
the seals and signatures on the butterfly's critical path cost, against the same all-reduce with
them in the same session (issue 30: our butterfly 1.29-1.34x the bound, the same bytes in our
schedule over p2pd's raw streams 1.14-1.18x). Installed before the swarm starts, as lockstep.py
is; the package carries none of it, and a run with it is not a run anyone could trust.
"""

from __future__ import annotations

from p2p_diloco.swarm.averaging import auditor, ledger
from p2p_diloco.trust import audit

FAKE_SIGNATURE = b"\0" * 256  # an RSA-2048 signature's size: the same bytes on the wire


def install() -> None:
    def sign_part(self, reducer, part, weight, encoded, decoded):
        return audit.pack_seal(audit.chunk_norms(decoded), (), FAKE_SIGNATURE)

    def accept_part(self, reducer, sender, part, weight, encoded, sealed):
        norms, _, signature = audit.unpack_seal(sealed)
        signed = ledger.SignedPart(sender, weight, encoded, signature, audit.Seal((), norms))
        self.parts.setdefault(part, {})[sender] = signed
        return signed

    def sign_average(self, reducer, part, encoded):
        self.averages[(reducer, part)] = ledger.SignedAverage(encoded, FAKE_SIGNATURE)
        return FAKE_SIGNATURE

    def accept_average(self, reducer, part, encoded, signature):
        self.averages[(reducer, part)] = ledger.SignedAverage(encoded, signature)

    async def no_audit(self, runner, pace_bytes_s=0.0, butterfly_s=0.0):
        return 0

    ledger.Ledger.sign_part = sign_part
    ledger.Ledger.accept_part = accept_part
    ledger.Ledger.sign_average = sign_average
    ledger.Ledger.accept_average = accept_average
    auditor.Auditor.check = no_audit
