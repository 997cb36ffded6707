"""The messages kvlink's SGLang backend exchanges between a prefill and a decode rank, over
kvlink's authenticated engine messages (``Engine.send_message`` / ``Engine.messages``).

Pure functions, no I/O: every message is a JSON object, and every field of one that arrived is
checked here before use (a peer's message is hostile input). A malformed message raises
``BadMessage`` with what is wrong; the caller logs it and drops it alone.

Every message names the room and the decode's attempt at it (``nonce``, chosen by the receiver):
SGLang reuses a room for a retried request, and a late message of an earlier attempt must not
touch the new one.

- ``want`` (decode to prefill, from ``KVReceiver.send_metadata``): the decode is ready for room
  ``room``; it expects ``pages`` pages past its own prefix of ``prefix`` tokens, the aux row
  if ``aux``, and ``states[i]`` indices of state type ``i``; reply to ``addr`` (its KV engine),
  and grant the aux and state spaces to the engine ids in ``readers``. ``tp``: the decode
  rank's ``[rank, size]`` in its attention-TP group (a prefill rank waits for every decode
  rank that reads it; a decode rank asks every prefill rank it reads).
- ``chunk`` (prefill to decode, from each ``KVSender.send``, split into messages of at most
  ``MAX_PAGES_PER_MESSAGE`` pages so each stays under kvlink's 64 KiB): pages ``pages`` of the prefill,
  held under ``id`` (hold token ``hold``), are the request's pages ``[first, first + len(pages))``.
  The last chunk (``last``) also names the aux row and the state rows, each held under its
  own id and token on the prefill's engine for that space (``spaces``: ``[{"space", "addr", "id",
  "hold", "indices", "ring"}]``; ``ring``: a dsa_tail row's ring size, see
  ``kvlink.sglang.states``). The decode's reads name the token: only that hold confirms them.
- ``abort`` (either way): the sender gave up on room ``room``, with ``reason``.
- ``ping`` (either way, room 0): nothing; sent to a peer whose session is down so that the
  engine connects again (a peer that is alive comes back up).
"""

from __future__ import annotations

import json
from typing import Any

MAX_PAGES = 1 << 20
"""Most pages one request may announce (a 16M-token prompt of 16-token pages)."""
MAX_PAGES_PER_MESSAGE = 4096
"""Most pages one chunk message names: 4,096 ids of at most 10 digits stay well under 64 KiB."""
MAX_STATE_TYPES = 16
MAX_REASON = 512
MAX_ID = 256
MAX_ADDR = 128
MAX_TP = 4096


class BadMessage(ValueError):
    """A peer's message is not one of ours, or a field is out of its range."""


def _int(d: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise BadMessage(f"{key} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def _str(d: dict[str, Any], key: str, limit: int) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise BadMessage(f"{key} must be a string of 1 to {limit} characters")
    return v


def _ints(v: Any, key: str, limit: int) -> list[int]:
    if not isinstance(v, list) or len(v) > limit:
        raise BadMessage(f"{key} must be a list of at most {limit} integers")
    if not all(type(x) is int and 0 <= x < 1 << 31 for x in v):
        raise BadMessage(f"{key} must hold integers in [0, 2^31)")
    return v


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def want(
    room: int,
    nonce: int,
    addr: str,
    pages: int,
    prefix: int,
    aux: bool,
    states: list[int],
    readers: dict[str, Any],
    tp: tuple = (0, 1),
) -> bytes:
    return encode(
        {
            "t": "want",
            "room": room,
            "nonce": nonce,
            "addr": addr,
            "pages": pages,
            "prefix": prefix,
            "aux": aux,
            "states": states,
            "readers": readers,
            "tp": list(tp),
        }
    )


def chunk(
    room: int,
    nonce: int,
    id: str,
    first: int,
    pages: list[int],
    last: bool,
    spaces: list[dict[str, Any]] | None = None,
    hold: int | None = None,
) -> bytes:
    return encode(
        {
            "t": "chunk",
            "room": room,
            "nonce": nonce,
            "id": id,
            "hold": hold,
            "first": first,
            "pages": pages,
            "last": last,
            "spaces": spaces or [],
        }
    )


def _hold(d: dict[str, Any]) -> int | None:
    """A hold token (absent or null when nothing was held)."""
    return None if d.get("hold") is None else _int(d, "hold", 1, (1 << 64) - 1)


def ping() -> bytes:
    return encode({"t": "ping", "room": 0, "nonce": 0})


def abort(room: int, nonce: int | None, reason: str) -> bytes:
    """``nonce`` None: every attempt at the room (a prefill that gave up before any want)."""
    return encode({"t": "abort", "room": room, "nonce": nonce, "reason": reason[:MAX_REASON]})


# Long: one branch per message kind, each naming and bounding every field, read against the
# encoders above.
def decode(body: bytes) -> dict[str, Any]:
    """The message in ``body``, every field checked; raises ``BadMessage``."""
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadMessage(f"not JSON: {e}") from None
    if not isinstance(d, dict):
        raise BadMessage("not a JSON object")
    kind = d.get("t")
    room = _int(d, "room", 0, (1 << 64) - 1)
    nonce = None if kind == "abort" and d.get("nonce") is None else _int(d, "nonce", 0, (1 << 64) - 1)
    if kind == "want":
        out = {
            "t": kind,
            "room": room,
            "nonce": nonce,
            "addr": _str(d, "addr", MAX_ADDR),
            "pages": _int(d, "pages", 0, MAX_PAGES),
            "prefix": _int(d, "prefix", 0, 1 << 40),
        }
        if not isinstance(d.get("aux"), bool):
            raise BadMessage("aux must be a boolean")
        out["aux"] = d["aux"]
        tp = d.get("tp")
        if not (
            isinstance(tp, list) and len(tp) == 2 and all(type(x) is int for x in tp) and 0 <= tp[0] < tp[1] <= MAX_TP
        ):
            raise BadMessage(f"tp must be [rank, size] with rank < size <= {MAX_TP}")
        out["tp"] = (tp[0], tp[1])
        out["states"] = _ints(d.get("states"), "states", MAX_STATE_TYPES)
        readers = d.get("readers")
        if not isinstance(readers, dict):
            raise BadMessage("readers must be an object")
        aux_reader = readers.get("aux")
        if aux_reader is not None and not (isinstance(aux_reader, str) and 0 < len(aux_reader) <= MAX_ID):
            raise BadMessage("readers.aux must be an engine id")
        states = readers.get("states", [])
        if (
            not isinstance(states, list)
            or len(states) != len(out["states"])
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_ID for s in states)
        ):
            raise BadMessage("readers.states must name one engine per state type")
        if out["aux"] and aux_reader is None:
            raise BadMessage("readers.aux must name the engine that reads the aux row")
        out["readers"] = {"aux": aux_reader, "states": states}
        return out
    if kind == "chunk":
        out = {
            "t": kind,
            "room": room,
            "nonce": nonce,
            "id": _str(d, "id", MAX_ID),
            "hold": _hold(d),
            "first": _int(d, "first", 0, MAX_PAGES),
            "pages": _ints(d.get("pages"), "pages", MAX_PAGES_PER_MESSAGE),
        }
        if not isinstance(d.get("last"), bool):
            raise BadMessage("last must be a boolean")
        out["last"] = d["last"]
        spaces = d.get("spaces")
        if not isinstance(spaces, list) or len(spaces) > MAX_STATE_TYPES + 1:
            raise BadMessage("spaces must be a list")
        checked = []
        for s in spaces:
            if not isinstance(s, dict):
                raise BadMessage("each space must be an object")
            space = s.get("space")
            if not (space == "aux" or (type(space) is int and 0 <= space < MAX_STATE_TYPES)):
                raise BadMessage('space must be "aux" or a state type index')
            ring = s.get("ring")
            if ring is not None and not (type(ring) is int and 0 < ring < 1 << 31):
                raise BadMessage("ring must be a positive integer")
            checked.append(
                {
                    "space": space,
                    "addr": _str(s, "addr", MAX_ADDR),
                    "id": _str(s, "id", MAX_ID),
                    "hold": _hold(s),
                    "indices": _ints(s.get("indices"), "indices", MAX_PAGES),
                    "ring": ring,
                }
            )
        if checked and not out["last"]:
            raise BadMessage("only the last chunk names aux and state spaces")
        out["spaces"] = checked
        return out
    if kind == "ping":
        return {"t": kind, "room": room, "nonce": nonce}
    if kind == "abort":
        reason = d.get("reason")
        if not isinstance(reason, str):
            raise BadMessage("reason must be a string")
        return {"t": kind, "room": room, "nonce": nonce, "reason": reason[:MAX_REASON]}
    raise BadMessage(f"unknown message kind {kind!r:.40}")
