"""The dial-back: entry nodes tell a starting peer whether others can dial it (protocol/reachability.py).

The asker, a throwaway p2pd listening on the peer's own port (preflight.py), opens a stream to each
entry node and sends that port. The entry node takes the address the stream's connection came
from (for a peer behind a home router, the router's public address) and opens a plain TCP
connection to it on that port. It answers whether a libp2p node greeted it with its multistream
header within DIAL_S. A router that forwards nothing refuses or drops the dial; a peer behind it is
private.

An entry node is open to anyone, so the helper's side is bounded:
- it dials only the address the request came from, never one the asker names, so it cannot be
  pointed at a third party;
- one dial at a time per address and MAX_DIALS in all; the rest are answered "busy";
- a request is at most MAX_LINE bytes, read within READ_S; a dial lasts at most DIAL_S.

The answer is untrusted input like any other (trust/wire.py): `parse_answer` returns a DialBack or
raises WireError, and the asker drops what does not parse.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.protocol.reachability import DialBack
from p2p_diloco.trust import wire

logger = logging.getLogger(__name__)

HANDLER = "p2p_diloco.dialback.v1"
GREETING = b"\x13/multistream/1.0.0\n"  # what a libp2p listener sends first on a new TCP connection
DIAL_S = 3.0  # the helper's TCP connect and greeting, together
READ_S = 5.0  # the longest either side waits for the other's line
MAX_LINE = 512
MAX_DIALS = 16
MAX_HELPERS = 3  # entry nodes asked at once


def parse_request(raw: bytes) -> int:
    """The port an asker wants dialled."""
    return wire.field(_json(raw), "port", lambda v: wire.integer(v, 1, 65535))


def parse_answer(raw: bytes, helper: str) -> DialBack:
    """A helper's answer to this peer's request."""
    record = _json(raw)
    seen = wire.field(record, "seen", _address)
    port = wire.field(record, "port", lambda v: wire.integer(v, 1, 65535))
    failure = wire.field(record, "failure", lambda v: wire.text(v, 200))
    return DialBack(helper, seen, port, failure)


def _json(raw: bytes) -> Any:
    try:
        return wire.mapping(json.loads(raw.decode()), "dial-back line")
    except (UnicodeDecodeError, ValueError) as e:
        raise wire.WireError(f"dial-back line: not JSON ({e})") from None


def _address(value: Any) -> str:
    text = wire.text(value, 64)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise wire.WireError(f"{text!r} is not an IP address") from None


async def _read_line(reader: asyncio.StreamReader) -> bytes:
    """Up to MAX_LINE bytes, ending at the first newline or when the other side closes, within READ_S."""

    async def read() -> bytes:
        data = b""
        while b"\n" not in data and len(data) < MAX_LINE:
            chunk = await reader.read(MAX_LINE - len(data))
            if not chunk:
                break
            data += chunk
        return data.split(b"\n", 1)[0]

    return await asyncio.wait_for(read(), READ_S)


def _line(**fields: Any) -> bytes:
    return json.dumps(fields).encode() + b"\n"


class Helper:
    """An entry node's side: answers dial-back requests on its p2p (`serve`)."""

    def __init__(self) -> None:
        self.dialling: set[str] = set()

    async def handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            port = parse_request(await _read_line(reader))
            seen = _ip_of(info.addr)
            writer.write(_line(seen=seen, port=port, failure=await self._dial_once(seen, port)))
            await writer.drain()
        except (wire.WireError, asyncio.TimeoutError, OSError) as e:
            logger.debug("dial-back request from %s dropped: %s", info.peer_id, e)
        finally:
            writer.close()

    async def _dial_once(self, ip: str, port: int) -> str:
        if ip in self.dialling or len(self.dialling) >= MAX_DIALS:
            return "busy: the entry node is dialling this address or too many others; try again"
        self.dialling.add(ip)
        try:
            return await dial(ip, port)
        finally:
            self.dialling.discard(ip)


def _ip_of(addr: Multiaddr) -> str:
    """The IP address a connection came from; WireError for a relayed one (no address of its own)."""
    names = [p.name for p in addr.protocols()]
    if "p2p-circuit" in names:
        raise wire.WireError("the request came through a relay")
    for name in ("ip4", "ip6"):
        if name in names:
            return str(addr.value_for_protocol(name))
    raise wire.WireError(f"no IP address in {addr}")


async def dial(ip: str, port: int) -> str:
    """ "" if a libp2p node greets a TCP connection to (ip, port) within DIAL_S; else why not."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_S)
    except asyncio.TimeoutError:
        return f"no answer within {DIAL_S:g} s"
    except ConnectionRefusedError:
        return "connection refused"
    except OSError as e:
        return e.strerror or type(e).__name__
    try:
        greeting = await asyncio.wait_for(reader.readexactly(len(GREETING)), DIAL_S)
        return "" if greeting == GREETING else "something other than a libp2p node answered"
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError):
        return "something other than a libp2p node answered"
    finally:
        writer.close()


async def serve(p2p: P2P) -> None:
    """Answer dial-back requests on `p2p` (an entry node's, or a public peer's)."""
    await p2p.add_binary_stream_handler(HANDLER, Helper().handle)


def helpers(initial_peers: Sequence[str]) -> list[PeerID]:
    """The peer ids of the first MAX_HELPERS entry nodes (their /p2p/ parts); an address whose id
    does not parse is skipped (the node's own start then says what is wrong with it)."""
    ids = []
    for maddr in initial_peers:
        try:
            ids.append(PeerID.from_base58(Multiaddr(maddr).value_for_protocol("p2p")))
        except Exception:  # multiaddr and base58 raise several types for malformed text
            continue
    return list(dict.fromkeys(ids))[:MAX_HELPERS]


async def ask(p2p: P2P, to: Sequence[PeerID], port: int, timeout_s: float) -> list[DialBack]:
    """The answers of the entry nodes `to` that answered within `timeout_s`."""
    tasks = [asyncio.create_task(_ask_one(p2p, helper, port)) for helper in to]
    if not tasks:
        return []
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    return [answer for task in done if (answer := task.result()) is not None]


async def _ask_one(p2p: P2P, helper: PeerID, port: int) -> DialBack | None:
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(helper, HANDLER)
    except Exception as e:  # hivemind raises ControlFailure, P2PDaemonError... for a peer without the handler
        logger.debug("entry node %s did not take a dial-back request: %s", helper, e)
        return None
    try:
        writer.write(_line(port=port))
        await writer.drain()
        return wire.parse_or_none(lambda raw: parse_answer(raw, str(helper)), await _read_line(reader), "dial-back")
    except (asyncio.TimeoutError, OSError) as e:
        logger.debug("entry node %s did not answer the dial-back: %s", helper, e)
        return None
    finally:
        writer.close()
