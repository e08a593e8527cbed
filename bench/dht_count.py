"""`python bench/dht_count.py COMMAND ARGS...`: `p2p-diloco COMMAND ARGS...` with its DHT requests counted.

Before the command starts, hivemind's DHTProtocol gets counters: the requests this node serves
(`rpc_ping`, `rpc_store`, `rpc_find` as registered with libp2p, and the keys in each store and
find) and the requests it sends (`call_ping`, `call_store`, `call_find`). hivemind runs the DHT
node in a child process that it forks (`hivemind.DHT` is a `ForkProcess`), so the patched class
is what the child runs. Every process that counts something writes its cumulative counts every
FLUSH_S seconds, atomically, to `$DHT_COUNTS_DIR/<command>-<pid>.json`: `{"command", "pid",
"time", "counts"}`.

bench/observer_load.py runs the swarm's nodes and the observer through this.
"""

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from hivemind.dht.protocol import DHTProtocol

FLUSH_S = 0.5
COUNTS_DIR = Path(os.environ.get("DHT_COUNTS_DIR", "."))
COMMAND = sys.argv[1] if len(sys.argv) > 1 else "none"
_counts: Counter[str] = Counter()
_lock = threading.Lock()
_flushing_in: int | None = None  # the pid whose flusher thread runs (a forked child starts its own)


def _bump(name: str, keys: int = 0) -> None:
    global _flushing_in
    with _lock:
        _counts[name] += 1
        if keys:
            _counts[f"{name}_keys"] += keys
        if _flushing_in != os.getpid():
            _flushing_in = os.getpid()
            threading.Thread(target=_flush_forever, name="dht-count-flush", daemon=True).start()


def _flush_forever() -> None:
    while True:
        _flush()
        time.sleep(FLUSH_S)  # the flush period of a daemon thread (nothing waits on it)


def _flush() -> None:
    with _lock:
        snapshot = {"command": COMMAND, "pid": os.getpid(), "time": time.time(), "counts": dict(_counts)}
    path = COUNTS_DIR / f"{COMMAND}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot))
    os.replace(tmp, path)


def _keys(request: object) -> int:
    return len(getattr(request, "keys", ()))


def _patch() -> None:
    """Counters around the handlers DHTProtocol registers with libp2p (what other nodes ask: its
    own rpc_store and rpc_find call rpc_ping locally, not counted) and around its call_* senders."""
    register = DHTProtocol.add_p2p_handlers

    async def add_p2p_handlers(self, p2p, wrapper=None, **kwargs):
        return await register(self, p2p, _Counting(self if wrapper is None else wrapper), **kwargs)

    DHTProtocol.add_p2p_handlers = add_p2p_handlers
    for name in ("call_ping", "call_store", "call_find"):
        setattr(DHTProtocol, name, _counted_call(getattr(DHTProtocol, name), f"sent_{name[5:]}"))


class _Counting:
    """The servicer as libp2p sees it: its rpc_ping, rpc_store and rpc_find count each request."""

    def __init__(self, servicer):
        self._servicer = servicer

    def __getattr__(self, name):
        method = getattr(self._servicer, name)
        if name not in ("rpc_ping", "rpc_store", "rpc_find"):
            return method

        async def handler(request, context):
            _bump(f"served_{name[4:]}", _keys(request))
            return await method(request, context)

        return handler


def _counted_call(original, label: str):
    async def call(self, peer, *args, **kwargs):
        keys = kwargs.get("keys", args[0] if args else ())
        _bump(label, 0 if label == "sent_ping" else len(keys))
        return await original(self, peer, *args, **kwargs)

    call.__name__ = original.__name__
    return call


if __name__ == "__main__":
    COUNTS_DIR.mkdir(parents=True, exist_ok=True)
    _patch()
    from p2p_diloco.cli import main

    sys.exit(main(sys.argv[1:]))
