#!/usr/bin/env python3
"""Is the bootstrap node up? Asks its observer's /healthz (`p2p-diloco bootstrap --observe-port`).

    python3 healthcheck.py [--host 127.0.0.1] [--port 8080] [--timeout 5]

Exit 0 when /healthz answers 200 (the node's DHT is up), silently; else exit 1 with one line on
stderr that says why: the observer is unreachable, did not answer in time, or answered otherwise
(503 and the node's reason). The host and port also come from P2P_DILOCO_OBSERVE_HOST and
P2P_DILOCO_OBSERVE_PORT; options win. Standard library only: it runs as the image's Docker
HEALTHCHECK, from cron or from any monitoring agent.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import urllib.error
import urllib.request

MAX_REASON_CHARS = 300  # of the answer's body, kept on the one line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = f"http://{args.host}:{args.port}/healthz"
    ok, reason = check(url, args.timeout)
    if not ok:
        print(reason, file=sys.stderr)
    return 0 if ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="exit 0 if the bootstrap node's observer says it is healthy")
    env = os.environ
    parser.add_argument("--host", default=env.get("P2P_DILOCO_OBSERVE_HOST", "127.0.0.1"), help="observer host")
    parser.add_argument("--port", type=int, default=int(env.get("P2P_DILOCO_OBSERVE_PORT", "8080")), help="its port")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="wait this long for an answer")
    return parser.parse_args(argv)


def check(url: str, timeout_s: float) -> tuple[bool, str]:
    """(True, "") on a 200 from `url`; else (False, one line naming what went wrong)."""
    # No proxy: an http_proxy in the environment must not send a local health check elsewhere.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as answer:
            status, body = answer.status, answer.read(MAX_REASON_CHARS)
    except urllib.error.HTTPError as e:  # 503 (the node's DHT is down) and every other error status
        status, body = e.code, e.read(MAX_REASON_CHARS)
    except OSError as e:  # URLError (refused, no route, a timeout while connecting) or a timeout while reading
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(why, (TimeoutError, socket.timeout)):
            return False, f"{url} gave no answer within {timeout_s:g} s"
        return False, f"{url} is unreachable ({why}); is the node running with --observe-port?"
    if status == 200:
        return True, ""
    return False, f"{url} answered {status}: {one_line(body)}"


def one_line(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return text or "(empty body)"


if __name__ == "__main__":
    sys.exit(main())
