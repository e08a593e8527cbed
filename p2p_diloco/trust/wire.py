"""The boundary for values from other nodes (I4, docs/design.md §6): typed, total parsers.

Every value another node hands this peer (a DHT record of any kind, a served state's metadata, the
header of an all-reduce part, a probe or a case) is read field by field through these parsers.
Each one is total: whatever it is given, it returns a valid value or raises `WireError`, and
nothing else. Valid means what the code behind the boundary relies on:
- numbers are finite and in the range the field can hold (an int fits the 64 bits msgpack and
  torch pack it into), and a bool is never taken for a number;
- strings are bounded, and of the expected alphabet where there is one (peer ids, digests);
- sequences and mappings are bounded (at most `max_n` items are read).

A reader turns `WireError` into "dropped" with `parse_or_none`, which logs each kind of drop once.
Nothing from the network reaches the round logic, the dashboard or a file unparsed.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from p2p_diloco.errors import P2PDilocoError

logger = logging.getLogger(__name__)

T = TypeVar("T")

INT64_MAX = 2**63 - 1
MAX_REAL = 1e300  # floats beyond this are no measurement, and their sums overflow to inf
MAX_PEER_ID = 128  # a base58 libp2p id is 46-52 characters
_PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{1,128}$")  # base58
_DIGEST = re.compile(r"^[0-9a-f]{32}$")  # checkpoint.digest's hex


class WireError(P2PDilocoError):
    """A value from another node is malformed; the reader drops it (and logs it once)."""


def mapping(value: Any, what: str = "record") -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise WireError(f"{what}: not a mapping ({type(value).__name__})")
    return value


def field(record: Mapping[str, Any], key: str, parse: Callable[[Any], T], default: Any = ...) -> T:
    """`parse(record[key])`; a missing key is `default` where one is given, else malformed."""
    if key not in record:
        if default is ...:
            raise WireError(f"no {key!r}")
        return default
    try:
        return parse(record[key])
    except WireError as e:
        raise WireError(f"{key!r}: {e}") from None


def integer(value: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    if type(value) is not int:  # a bool is an int to Python, and never a count here
        raise WireError(f"not an integer ({type(value).__name__})")
    if not lo <= value <= hi:
        raise WireError(f"integer out of [{lo}, {hi}]")
    return value


def real(value: Any, lo: float = -MAX_REAL, hi: float = MAX_REAL) -> float:
    if type(value) not in (int, float):
        raise WireError(f"not a number ({type(value).__name__})")
    number = float(value) if abs(value) <= MAX_REAL else math.inf  # a huge int is no float either
    if not math.isfinite(number) or not lo <= number <= hi:
        raise WireError(f"number not finite or out of [{lo:g}, {hi:g}]")
    return number


def flag(value: Any) -> bool:
    if type(value) is not bool:
        raise WireError(f"not a bool ({type(value).__name__})")
    return value


def text(value: Any, max_len: int, pattern: re.Pattern[str] | None = None) -> str:
    if not isinstance(value, str):
        raise WireError(f"not a string ({type(value).__name__})")
    if len(value) > max_len:
        raise WireError(f"a string of {len(value)} characters, more than {max_len}")
    if pattern is not None and not pattern.match(value):
        raise WireError("a string of the wrong form")
    return value


def peer_id(value: Any) -> str:
    return text(value, MAX_PEER_ID, _PEER_ID)


def digest(value: Any) -> str:
    return text(value, 32, _DIGEST)


def choice(value: Any, choices: tuple[str, ...], other: str | None = None) -> str:
    """One of `choices`; any other string is `other` where that is given (a newer peer's word)."""
    word = text(value, max(map(len, choices), default=0) if other is None else 64)
    if word in choices:
        return word
    if other is None:
        raise WireError(f"not one of {', '.join(choices)}")
    return other


def items(value: Any, max_n: int, parse: Callable[[Any], T]) -> tuple[T, ...]:
    """The first `max_n` items of a list, each parsed (a malformed item is a malformed list)."""
    if not isinstance(value, list | tuple):
        raise WireError(f"not a list ({type(value).__name__})")
    return tuple(parse(v) for v in value[:max_n])


def scalar(value: Any) -> Any:
    """A config value: a bool, an int of 64 bits, a float, None, or a string of at most 1024."""
    if value is None or type(value) in (bool, float):
        return value
    if type(value) is int:
        return integer(value, -INT64_MAX - 1)
    return text(value, 1024)


def config_sections(value: Any, max_sections: int = 32, max_keys: int = 128) -> dict[str, dict[str, Any]]:
    """A config's shared fields as another node published them: {section: {key: value}}, each
    value a `scalar` or a list of at most 64 of them (config.Config.shared_dict's shape)."""

    def one(v: Any) -> Any:
        return list(items(v, 64, scalar)) if isinstance(v, list | tuple) else scalar(v)

    def section(v: Any) -> dict[str, Any]:
        keys = mapping(v, "config section")
        if len(keys) > max_keys:
            raise WireError(f"a config section of more than {max_keys} keys")
        return {text(k, 64): one(x) for k, x in keys.items()}

    sections = mapping(value, "config")
    if len(sections) > max_sections:
        raise WireError(f"a config of more than {max_sections} sections")
    return {text(name, 64): section(v) for name, v in sections.items()}


def parse_or_none(parse: Callable[[Any], T], value: Any, what: str) -> T | None:
    """`parse(value)`, or None if it is malformed: the reader drops it, logged once a kind."""
    try:
        return parse(value)
    except WireError as e:
        dropped(what, str(e))
        return None


_dropped_seen: set[tuple[str, str]] = set()


def dropped(what: str, reason: str) -> None:
    """Log a dropped value once per (kind, reason): a peer that sends garbage every second must
    not flood the log. Bounded: after 1024 kinds, drops are no longer logged."""
    key = (what, reason[:200])
    if key in _dropped_seen or len(_dropped_seen) >= 1024:
        return
    _dropped_seen.add(key)
    logger.info("dropped a malformed %s from another node: %s", what, key[1])
