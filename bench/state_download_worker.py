"""One process of bench/state_download.py: a holder that serves a state, or the joiner that downloads it.

    python bench/state_download_worker.py holder MADDR HOST_IP NUMEL RUN_DIR [lie]
    python bench/state_download_worker.py joiner MADDR HOST_IP NUMEL RUN_DIR HOLDER_MADDRS

Every holder serves the same state of round 1 (θ and momentum of NUMEL values each, drawn from
fixed seeds); a holder given `lie` sends the honest manifest but zeros for every chunk. A holder
prints "ready MADDR" once up. The joiner prints "ready", then for each line on stdin
"whole PEER" (the whole state from one holder, as before issue 30) or "chunks PEER,PEER,..."
(in chunks from those holders at once) prints one JSON line: seconds, whether the state matched
its digest, and the holders the download dropped. Ends at EOF on stdin. Logs go to stderr.
"""

import json
import sys
import time
from pathlib import Path

import torch

from p2p_diloco import config
from p2p_diloco.protocol import chunks, outer
from p2p_diloco.swarm import HivemindSwarm
from p2p_diloco.swarm.averaging import chunked


def state(numel: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    theta = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    momentum = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    return theta, momentum, outer.digest(1, {"w": theta}, {"w": momentum})


def swarm(maddrs: str, host: str, numel: int, run_dir: Path, served) -> HivemindSwarm:
    cfg = config.load(None, {"swarm.host": host, "swarm.initial_peers": maddrs, "run.dir": str(run_dir)})
    run_dir.mkdir(parents=True, exist_ok=True)
    return HivemindSwarm(cfg, run_dir, numel, served)


def holder(maddr: str, host: str, numel: int, run_dir: Path, lie: bool) -> None:
    theta, momentum, digest = state(numel)
    if lie:  # before the averager process forks: it inherits the lie
        honest = chunked.Served.chunk
        chunked.Served.chunk = lambda self, index: [bytes(len(p)) for p in honest(self, index)]
    node = swarm(maddr, host, numel, run_dir, lambda: ({"round": 1, "digest": digest}, [theta, momentum]))
    try:
        print("ready", next(m for m in node.visible_maddrs() if host in m), flush=True)
        sys.stdin.read()  # until the parent closes it
    finally:
        node.close()


def joiner(maddr: str, host: str, numel: int, run_dir: Path, holders: str) -> None:
    theta, momentum, digest = state(numel)
    del theta, momentum
    node = swarm(f"{maddr},{holders}", host, numel, run_dir, lambda: ({}, []))
    try:
        print("ready", flush=True)
        for line in sys.stdin:
            mode, peers = line.split()
            print(json.dumps(download(node, mode, peers.split(","), digest, numel)), flush=True)
    finally:
        node.close()


def download(node: HivemindSwarm, mode: str, peers: list[str], digest: str, numel: int) -> dict:
    like = {"w": torch.empty(numel)}
    total_s, stall_s = node.download.total_s, node.download.stall_s
    start = time.monotonic()
    if mode == "whole":
        metadata, tensors = node.averager.download_state_from(peers[0], total_s, stall_s)
        return {"s": time.monotonic() - start, "ok": outer.served_digest(metadata, tensors, like) == digest}
    manifests = node.averager.state_manifests(peers, (1, digest), stall_s)
    if mode == "manifests":  # a warm-up: every holder reads its state and hashes it once
        return {"s": time.monotonic() - start, "manifests": len(manifests)}
    manifest, group = chunks.manifest_groups(manifests, 1, digest)[0]
    got = node.averager.download_chunks(manifest, group, total_s, stall_s)
    seconds = time.monotonic() - start
    ok = got.tensors is not None and outer.served_digest({"round": 1}, got.tensors, like) == digest
    return {"s": seconds, "ok": ok, "chunks": len(manifest.hashes), "dropped": got.dropped, "liars": sorted(got.liars)}


if __name__ == "__main__":
    role, maddr, host, numel, run_dir, *rest = sys.argv[1:]
    if role == "holder":
        holder(maddr, host, int(float(numel)), Path(run_dir), rest == ["lie"])
    else:
        joiner(maddr, host, int(float(numel)), Path(run_dir), rest[0])
