"""Where a decode rank finds its prefill rank: a small HTTP registry the prefill's main process
runs on ``--disaggregation-bootstrap-port`` (SGLang starts it as the backend's bootstrap
server), which each prefill rank tells its kvlink handshake address.

The registry only hands out addresses: everything after it goes through kvlink's handshake,
which with a deployment key authenticates both sides, so a forged registration leads a decode
to a peer that cannot prove the key, and the read fails with that reason.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

logger = logging.getLogger(__name__)

MAX_BODY = 4096
MAX_RANKS = 4096


class KvlinkBootstrapServer(BaseKVBootstrapServer):
    """The registry: ``PUT /kvlink/route`` (a prefill rank's ``dp_rank``, ``tp_rank``,
    ``tp_size``, ``dp_size``, ``addr``, ``engine_id``, ``page_size``, ``dtype``, ``heads``,
    ``states``, ``state_addrs``, ``state_split``, optional ``http_port``),
    ``GET /kvlink/route?dp_rank=&tp_rank=`` (that rank's entry, 404 until registered),
    ``GET /kvlink/group?dp_rank=`` (``{"ranks": [...]}``, the DP group's entries in TP rank
    order, 404 until all registered), ``GET /kvlink/info`` (sizes, and
    whether every rank registered) and ``GET /health``.

    Every rank of one prefill shares its sizes and KV layout: a registration that disagrees
    with those before it starts a new generation (a prefill restarted with other settings),
    and the entries that disagree with it are dropped, with a warning."""

    # Long: the HTTP handler is a class inside, closing over the registry; its four short
    # methods are most of the lines.
    def __init__(self, host: str, port: int):
        self.ranks: dict[tuple[int, int], dict[str, Any]] = {}
        self.lock = threading.Lock()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            # A client that stops sending does not keep its thread for ever.
            timeout = 10

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("bootstrap: " + fmt, *args)

            def _answer(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                if urllib.parse.urlparse(self.path).path != "/kvlink/route":
                    return self._answer(404, {"error": "unknown path"})
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = 0
                if not 0 < n <= MAX_BODY:
                    return self._answer(400, {"error": f"body of 1 to {MAX_BODY} bytes expected"})
                try:
                    entry = _check_entry(json.loads(self.rfile.read(n)))
                except (ValueError, KeyError, TypeError) as e:
                    return self._answer(400, {"error": str(e)})
                with registry.lock:
                    key = (entry["dp_rank"], entry["tp_rank"])
                    if key not in registry.ranks and len(registry.ranks) >= MAX_RANKS:
                        return self._answer(400, {"error": "too many ranks"})
                    registry.admit(key, entry)
                logger.info("kvlink bootstrap: prefill dp %d tp %d at %s", key[0], key[1], entry["addr"])
                self._answer(200, {"ok": True})

            def do_GET(self) -> None:
                url = urllib.parse.urlparse(self.path)
                q = urllib.parse.parse_qs(url.query)
                if url.path == "/health":
                    return self._answer(200, {"ok": True})
                with registry.lock:
                    ranks = dict(registry.ranks)
                if url.path == "/kvlink/info":
                    if not ranks:
                        return self._answer(404, {"error": "no prefill rank registered yet"})
                    any_rank = next(iter(ranks.values()))
                    tp, dp = any_rank["tp_size"], any_rank["dp_size"]
                    return self._answer(
                        200,
                        {
                            "tp_size": tp,
                            "dp_size": dp,
                            "page_size": any_rank["page_size"],
                            "dtype": any_rank["dtype"],
                            "heads": any_rank["heads"],
                            "states": any_rank["states"],
                            "complete": len(ranks) >= tp * dp,
                        },
                    )
                if url.path == "/kvlink/group":
                    try:
                        dp = int(q["dp_rank"][0])
                    except (KeyError, ValueError):
                        return self._answer(400, {"error": "dp_rank expected"})
                    group = [e for (d, _), e in sorted(ranks.items()) if d == dp]
                    if not group or len(group) != group[0]["tp_size"]:
                        return self._answer(404, {"error": f"prefill DP group {dp} not fully registered"})
                    return self._answer(200, {"ranks": group})
                if url.path == "/kvlink/route":
                    try:
                        key = (int(q["dp_rank"][0]), int(q["tp_rank"][0]))
                    except (KeyError, ValueError):
                        return self._answer(400, {"error": "dp_rank and tp_rank expected"})
                    if key not in ranks:
                        return self._answer(404, {"error": f"prefill dp {key[0]} tp {key[1]} not registered"})
                    return self._answer(200, ranks[key])
                self._answer(404, {"error": "unknown path"})

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="kvlink-bootstrap", daemon=True)
        self.thread.start()
        logger.info("kvlink bootstrap server on %s:%d", host, self.port)

    def admit(self, key: tuple[int, int], entry: dict[str, Any]) -> None:
        """Records ``entry`` under ``key`` (the lock held); see the class docstring."""
        shared = ("tp_size", "dp_size", "page_size", "dtype", "heads", "states")
        stale = [k for k, e in self.ranks.items() if any(e[f] != entry[f] for f in shared)]
        if stale:
            logger.warning(
                "kvlink bootstrap: prefill dp %d tp %d registers %s; dropping %d earlier ranks that "
                "registered otherwise",
                key[0],
                key[1],
                {f: entry[f] for f in shared},
                len(stale),
            )
        for k in stale:
            del self.ranks[k]
        old = self.ranks.get(key)
        if old is not None and old["engine_id"] != entry["engine_id"]:
            logger.info(
                "kvlink bootstrap: prefill dp %d tp %d re-registered (engine %s, was %s)",
                key[0],
                key[1],
                entry["engine_id"],
                old["engine_id"],
            )
        self.ranks[key] = entry

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _check_entry(d: Any) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError("a JSON object expected")
    out: dict[str, Any] = {}
    for k, hi in (
        ("dp_rank", MAX_RANKS),
        ("tp_rank", MAX_RANKS),
        ("tp_size", MAX_RANKS),
        ("dp_size", MAX_RANKS),
        ("page_size", 1 << 20),
    ):
        v = d[k]
        if type(v) is not int or not 0 <= v <= hi:
            raise ValueError(f"{k} out of range")
        out[k] = v
    if not (out["tp_rank"] < out["tp_size"] and out["dp_rank"] < out["dp_size"]):
        raise ValueError("rank beyond its size")
    for k in ("addr", "dtype", "engine_id"):
        if not isinstance(d[k], str) or not 0 < len(d[k]) <= 256:
            raise ValueError(f"{k} must be a short string")
        out[k] = d[k]
    out["heads"] = d.get("heads") is True
    kinds = d.get("states", [])
    if (
        not isinstance(kinds, list)
        or len(kinds) > 16
        or not all(isinstance(k, str) and 0 < len(k) <= 32 for k in kinds)
    ):
        raise ValueError("states must list at most 16 state type names")
    out["states"] = kinds
    addrs = d.get("state_addrs", [])
    if not isinstance(addrs, list) or len(addrs) > 16 or not all(isinstance(a, str) and len(a) <= 256 for a in addrs):
        raise ValueError("state_addrs must list at most 16 addresses")
    out["state_addrs"] = addrs
    # Per state type, why a decode of another attention TP size cannot read it ("": it can).
    whys = d.get("state_split", [])
    if not isinstance(whys, list) or len(whys) > 16 or not all(isinstance(w, str) and len(w) <= 512 for w in whys):
        raise ValueError("state_split must list at most 16 short reasons")
    out["state_split"] = whys
    # The prefill's HTTP API port, where a decode sends a retracted request back (optional).
    port = d.get("http_port")
    if port is not None:
        if type(port) is not int or not 0 < port < 65536:
            raise ValueError("http_port out of range")
        out["http_port"] = port
    return out


def _url(bootstrap_addr: str, path: str) -> str:
    return f"http://{bootstrap_addr}{path}"


def register(bootstrap_addr: str, entry: dict[str, Any], deadline_s: float = 600.0) -> threading.Thread:
    """Registers a prefill rank, retrying in the background until the registry answers (the
    server starts in another process) or ``deadline_s`` passes (logged as an error)."""

    def run() -> None:
        body = json.dumps(entry).encode()
        end = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < end:
            req = urllib.request.Request(
                _url(bootstrap_addr, "/kvlink/route"),
                data=body,
                method="PUT",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    r.read()
                    return
            except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
                last = e
                time.sleep(min(2.0, 0.2 + (time.monotonic() - (end - deadline_s)) / 20))
        logger.error(
            "kvlink: could not register with the bootstrap server at %s for %.0f s: %s; decodes cannot find this rank",
            bootstrap_addr,
            deadline_s,
            last,
        )

    t = threading.Thread(target=run, name="kvlink-register", daemon=True)
    t.start()
    return t


def get(bootstrap_addr: str, path: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """The registry's JSON answer, or None when it has none yet or cannot be reached."""
    try:
        with urllib.request.urlopen(_url(bootstrap_addr, path), timeout=timeout) as r:
            d = json.loads(r.read(MAX_BODY + 1))
            return d if isinstance(d, dict) else None
    # ValueError: bad JSON or a bad address; HTTPException: not HTTP at all (a wrong port).
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return None


MAX_DP_GROUPS = 256


def look_up(bootstrap_addr: str) -> tuple | None:
    """The prefill behind ``bootstrap_addr`` once all its ranks registered: its shared
    settings, and each DP group's ranks in TP order; None until then (or when the answers do
    not hold together). Runs off the scheduler thread."""
    from types import SimpleNamespace

    info = get(bootstrap_addr, "/kvlink/info")
    if not info or info.get("complete") is not True:
        return None
    try:
        found = SimpleNamespace(
            dp_size=int(info["dp_size"]),
            tp_size=int(info["tp_size"]),
            follow_bootstrap_room=True,
            page_size=info.get("page_size"),
            dtype=info.get("dtype"),
            heads=info.get("heads") is True,
            states=info.get("states"),
        )
    except (KeyError, TypeError, ValueError):
        logger.warning("kvlink: the bootstrap server at %s answered %r", bootstrap_addr, info)
        return None
    if not 0 < found.dp_size <= MAX_DP_GROUPS:
        logger.warning("kvlink: the prefill at %s has %d DP groups", bootstrap_addr, found.dp_size)
        return None
    groups = {}
    for dp in range(found.dp_size):
        g = get(bootstrap_addr, f"/kvlink/group?dp_rank={dp}")
        ranks = g.get("ranks") if g else None
        if (
            not isinstance(ranks, list)
            or len(ranks) != found.tp_size
            or not all(
                isinstance(r, dict) and isinstance(r.get("addr"), str) and isinstance(r.get("engine_id"), str)
                for r in ranks
            )
        ):
            return None
        groups[dp] = ranks
    return found, groups
