"""An OpenAI-compatible proxy for disaggregated vLLM serving on kvlink: each request goes to a
prefill instance and a decode instance, the decode's response (streamed or not) back to the
client.

    python -m kvlink.vllm.proxy --prefill http://p0:8100 --prefill http://p1:8100 \\
        --decode http://d0:8200 --port 8000

Two flows. **Progressive** (where both instances can): both legs are sent at once with a
transfer id and a hold token; the decode admits the request at once and reads the prompt's KV
as the prefill computes it (``kvlink.vllm.progressive``). **Sequential** (vLLM's usual one):
the prefill runs first, and its response's ``kv_transfer_params`` go with the decode's leg.
Before the first request to an instance the proxy asks it (one request of one token with
``kvlink_probe``) for its kvlink addresses, TP size, block sizes and whether it can take part
in a progressive transfer; a pair whose answers differ in TP size or block sizes, or an
instance that is not kvlink's, runs the sequential flow. ``--sequential`` always does.

Each request goes to the prefill and the decode with the fewest requests in flight. Every wait
has a deadline (``--timeout``, seconds between bytes of a response; ``--connect-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .progressive import PROBE

logger = logging.getLogger("kvlink.vllm.proxy")

#: Headers passed on to the instances.
FORWARDED = ("Authorization", "X-Request-Id")
#: How long a probe's answer is trusted before the instance is asked again.
PROBE_TTL = 60.0


@dataclass
class Instance:
    """One vLLM instance: its URL, requests in flight and what its probe said."""

    url: str
    in_flight: int = 0
    info: dict[str, Any] | None = None
    probed: float = -PROBE_TTL
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def pick(instances: list[Instance], turn: int) -> Instance:
    """The instance with the fewest requests in flight (ties in turn)."""
    n = len(instances)
    order = [instances[(turn + i) % n] for i in range(n)]
    return min(order, key=lambda i: i.in_flight)


def progressive_pair(prefill: dict[str, Any] | None, decode: dict[str, Any] | None) -> str | None:
    """Why a prefill and a decode whose probes answered ``prefill`` and ``decode`` cannot run a
    progressive transfer, or None."""
    if not prefill or not decode:
        return "an instance did not answer kvlink's probe"
    for name, info in (("prefill", prefill), ("decode", decode)):
        if not info.get("progressive"):
            return f"the {name} cannot: {info.get('why_not_progressive')}"
    if not prefill.get("addresses"):
        return "the prefill has no kvlink addresses"
    if prefill.get("tp_size") != decode.get("tp_size") or prefill.get("block_sizes") != decode.get("block_sizes"):
        return "their TP sizes or block sizes differ"
    return None


def prefill_leg(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill's request: the client's, one token, not streamed, with ``params``."""
    leg = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):
        leg.pop(key, None)
    return leg


def legs(body: dict[str, Any], prefill: dict[str, Any], tid: str, hold: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A progressive transfer's two requests: the prefill's and the decode's."""
    p = prefill_leg(
        body, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "transfer_hold": hold}
    )
    d = dict(
        body,
        kv_transfer_params={
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "progressive": True,
            "remote_addresses": list(prefill["addresses"]),
            "remote_request_id": tid,
            "remote_hold": hold,
            "remote_block_sizes": list(prefill["block_sizes"]),
            "remote_engine_id": prefill.get("engine_id"),
            "tp_size": prefill["tp_size"],
        },
    )
    return p, d


class Proxy:
    """The proxy's state: its instances and the HTTP session it reaches them with."""

    def __init__(
        self, prefills: list[str], decodes: list[str], sequential: bool, timeout: float, connect_timeout: float
    ):
        self.prefills = [Instance(u.rstrip("/")) for u in prefills]
        self.decodes = [Instance(u.rstrip("/")) for u in decodes]
        self.sequential = sequential
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=timeout)
        self.turn = itertools.count()
        self.session: aiohttp.ClientSession | None = None
        self.counts = {"progressive": 0, "sequential": 0, "prefill_failed": 0}

    async def start(self, _app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout)

    async def stop(self, _app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/kvlink/stats", self.stats)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.counts)

    async def models(self, request: web.Request) -> web.StreamResponse:
        """The first decode's models; 502 when it does not answer."""
        assert self.session is not None
        url = self.decodes[0].url
        try:
            async with self.session.get(url + "/v1/models", headers=_headers(request)) as r:
                return web.Response(status=r.status, body=await r.read(), content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            logger.warning("models of %s: %s", url, e)
            return web.json_response({"error": {"message": f"the decode at {url} failed: {e}"}}, status=502)

    async def probe(self, inst: Instance, model: Any, headers: dict[str, str]) -> dict[str, Any] | None:
        """What ``inst`` answers kvlink's probe (cached ``PROBE_TTL`` seconds), None when it
        does not answer one."""
        async with inst.lock:
            if time.monotonic() - inst.probed < PROBE_TTL:
                return inst.info
            assert self.session is not None
            body = {"model": model, "prompt": [0], "max_tokens": 1, "kv_transfer_params": {PROBE: True}}
            info = None
            try:
                async with self.session.post(inst.url + "/v1/completions", json=body, headers=headers) as r:
                    if r.status == 200:
                        info = ((await r.json()).get("kv_transfer_params") or {}).get("kvlink")
                    else:
                        logger.warning("probe of %s: HTTP %d: %s", inst.url, r.status, (await r.text())[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                logger.warning("probe of %s failed: %s", inst.url, e)
            inst.info, inst.probed = info, time.monotonic()
            logger.info("%s: %s", inst.url, info)
            return info

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the body is not a JSON object"}}, status=400)
        turn = next(self.turn)
        prefill, decode = pick(self.prefills, turn), pick(self.decodes, turn)
        headers = _headers(request)
        why = "--sequential"
        if not self.sequential:
            p_info = await self.probe(prefill, body.get("model"), headers)
            d_info = await self.probe(decode, body.get("model"), headers)
            why = progressive_pair(p_info, d_info) or ""
        prefill.in_flight += 1
        decode.in_flight += 1
        try:
            if not why:
                return await self.progressive(request, body, prefill, decode, headers)
            return await self.sequential_flow(request, body, prefill, decode, headers)
        finally:
            prefill.in_flight -= 1
            decode.in_flight -= 1

    async def progressive(
        self, request: web.Request, body: dict[str, Any], prefill: Instance, decode: Instance, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Both legs at once; the decode's response to the client."""
        assert prefill.info is not None
        tid, hold = "kvlink-" + secrets.token_hex(12), secrets.randbits(63) + 1
        p_body, d_body = legs(body, prefill.info, tid, hold)
        self.counts["progressive"] += 1
        p_leg = asyncio.ensure_future(
            self.run_prefill(prefill, request.path, p_body, dict(headers, **{"X-Request-Id": tid}))
        )
        answered = False
        try:
            out = await self.relay(request, decode, d_body, dict(headers, **{"X-Request-Id": tid}))
            answered = out.status == 200
            return out
        finally:
            # The prefill's answer is not the client's: it is awaited (its errors logged)
            # once the decode answered; otherwise (the decode failed, the client went away)
            # its connection is closed, which makes vLLM abort the prefill's request and
            # release its hold.
            if answered and not p_leg.done():
                await asyncio.wait([p_leg], timeout=self.timeout.sock_read)
            if not p_leg.done():
                p_leg.cancel()

    async def run_prefill(
        self, inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | None:
        """The prefill's leg: its response's ``kv_transfer_params``, None when it failed."""
        assert self.session is not None
        try:
            async with self.session.post(inst.url + path, json=body, headers=headers) as r:
                text = await r.text()
                if r.status != 200:
                    self.counts["prefill_failed"] += 1
                    logger.warning("prefill %s: HTTP %d: %s", inst.url, r.status, text[:500])
                    return None
                return json.loads(text).get("kv_transfer_params")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self.counts["prefill_failed"] += 1
            inst.probed = -PROBE_TTL  # asked again before its next request
            logger.warning("prefill %s failed: %s", inst.url, e)
            return None

    async def sequential_flow(
        self, request: web.Request, body: dict[str, Any], prefill: Instance, decode: Instance, headers: dict[str, str]
    ) -> web.StreamResponse:
        """The prefill first, then the decode with its transfer parameters."""
        self.counts["sequential"] += 1
        params = await self.run_prefill(
            prefill, request.path, prefill_leg(body, {"do_remote_decode": True, "do_remote_prefill": False}), headers
        )
        if not params:
            return web.json_response({"error": {"message": f"the prefill at {prefill.url} failed"}}, status=502)
        return await self.relay(request, decode, dict(body, kv_transfer_params=params), headers)

    async def relay(
        self, request: web.Request, inst: Instance, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Sends ``body`` to ``inst`` and streams its response to the client."""
        assert self.session is not None
        try:
            async with self.session.post(inst.url + request.path, json=body, headers=headers) as r:
                out = web.StreamResponse(status=r.status)
                out.content_type = r.content_type
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            inst.probed = -PROBE_TTL
            logger.warning("decode %s failed: %s", inst.url, e)
            return web.json_response({"error": {"message": f"the decode at {inst.url} failed: {e}"}}, status=502)


def _headers(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in FORWARDED if h in request.headers}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlink.vllm.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeat for more)")
    ap.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeat for more)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--sequential", action="store_true", help="never run progressive transfers")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may stay silent in a response")
    ap.add_argument("--connect-timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, args.sequential, args.timeout, args.connect_timeout)
    web.run_app(proxy.app(), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
