"""``python -m kvlink.vllm.proxy`` between a client and two vLLM engines (``engine_process``: vLLM's
real scheduler and kvlink's connector on vLLM's own KV caches) behind a stand-in for vLLM's
OpenAI server: what the proxy sends reaches the schedulers as ``kv_transfer_params`` the way
vLLM's server passes them, and the engines' ``kv_transfer_params`` come back in the response
as it returns them. What is stubbed: the HTTP server and the tokenizer (prompts are token
ids); the scheduler, the connector, the transfers and the byte checks are the real ones. Each
request's decode checks every byte it read."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import urllib.request
import uuid
from typing import Any, Dict, List

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Proc, assert_no_leak, close  # noqa: E402

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvlink.vllm.proxy import Instance, Proxy, pick, progressive_pair  # noqa: E402


def test_the_pair_and_the_flow_are_picked_by_load_and_by_what_the_probes_said():
    a, b, c = Instance("a", in_flight=2), Instance("b", in_flight=1), Instance("c", in_flight=1)
    assert pick([a, b, c], 0).url == "b" and pick([a, b, c], 2).url == "c"
    info = {"addresses": ["h:1"], "tp_size": 1, "block_sizes": [16], "progressive": True}
    assert progressive_pair(info, dict(info, addresses=[])) is None  # a decode's addresses are not used
    assert "did not answer" in progressive_pair(info, None)
    assert "cannot" in progressive_pair(info, dict(info, progressive=False, why_not_progressive="a window"))
    assert "differ" in progressive_pair(info, dict(info, tp_size=2))
    assert "differ" in progressive_pair(info, dict(info, block_sizes=[32]))
    assert "no kvlink addresses" in progressive_pair(dict(info, addresses=[]), info)


class Server:
    """A stand-in for vLLM's OpenAI server over one engine process: ``/v1/completions`` adds the
    request (prompt as token ids, ``max_tokens``, ``kv_transfer_params``) under the client's
    ``X-Request-Id`` with a suffix of its own, as vLLM's server does, and answers once the
    engine finished it; a thread steps the engine meanwhile."""

    def __init__(self, proc: Proc, loop: asyncio.AbstractEventLoop):
        self.proc, self.loop = proc, loop
        self.lock = threading.Lock()
        self.waiting: Dict[str, asyncio.Future] = {}
        self.added: List[str] = []
        self.running = True
        self.thread = threading.Thread(target=self.step, daemon=True)
        self.thread.start()

    def step(self) -> None:
        while self.running:
            with self.lock:
                out = self.proc.call("step")
            for f in out["finished"]:
                fut = self.waiting.pop(f["id"], None)
                if fut is not None:
                    self.loop.call_soon_threadsafe(fut.set_result, f)
            if not out["scheduled"]:
                time.sleep(0.005)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        rid = f"{request.headers.get('X-Request-Id', 'cmpl')}-{uuid.uuid4().hex[:8]}"
        fut = self.loop.create_future()
        self.waiting[rid] = fut
        with self.lock:
            self.proc.call("add", rid, list(body["prompt"]), int(body["max_tokens"]), body.get("kv_transfer_params"))
        if "kvlink_probe" not in (body.get("kv_transfer_params") or {}):
            self.added.append(rid)
        done = await asyncio.wait_for(fut, 60)
        answer = {"id": rid, "choices": [{"index": 0, "text": "", "finish_reason": done["reason"]}],
                  "kv_transfer_params": done["params"]}
        if not body.get("stream"):
            return web.json_response(answer)
        out = web.StreamResponse()
        out.content_type = "text/event-stream"
        await out.prepare(request)
        await out.write(f"data: {json.dumps(answer)}\n\n".encode() + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    def call(self, cmd: str, *args: Any) -> Any:
        """A command to the engine, between the server's steps."""
        with self.lock:
            return self.proc.call(cmd, *args)

    @property
    def name(self) -> str:
        return self.proc.name

    def close(self) -> None:
        self.running = False
        self.thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack():
    """A prefill and a decode engine behind their servers, and two proxies (progressive where
    it can, and ``--sequential``), on one event loop in a thread."""
    prefill, decode = Proc("xprefill"), Proc("xdecode")
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runners: List[web.AppRunner] = []
    servers: List[Server] = []

    async def serve(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    try:
        prefill.wait_ready()
        decode.wait_ready()
        urls = []
        for proc in (prefill, decode):
            server = Server(proc, loop)
            servers.append(server)
            app = web.Application()
            app.router.add_post("/v1/completions", server.completions)
            urls.append(run(serve(app)))
        proxies = {
            mode: run(serve(Proxy([urls[0]], [urls[1]], mode == "sequential", 60.0, 5.0).app()))
            for mode in ("progressive", "sequential")
        }
        yield {"prefill": servers[0], "decode": servers[1], "servers": servers, "proxies": proxies}
    finally:
        for s in servers:
            s.close()
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        close(prefill, decode)


def post(url: str, body: Dict[str, Any], stream: bool = False) -> Any:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(dict(body, stream=stream)).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=90) as r:
        text = r.read().decode()
    if stream:
        return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return json.loads(text)


def get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def run_requests(stack, mode: str, count: int, seed: int) -> None:
    """``count`` requests through the ``mode`` proxy, at once; every decode checked byte for
    byte, every request answered with its tokens."""
    url = stack["proxies"][mode]
    decode = stack["servers"][1]
    before = len(decode.added)
    prompts = [[(seed * 31 + i * 7 + j) % 990 + 10 for j in range(40 + 97 * i)] for i in range(count)]
    results: List[Any] = [None] * count

    def one(i: int) -> None:
        results[i] = post(url, {"model": "m", "prompt": prompts[i], "max_tokens": 3}, stream=i % 2 == 1)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(results):
        answer = r[-1] if isinstance(r, list) else r
        assert answer and answer["choices"][0]["finish_reason"] == "length", (i, r)
    ids = decode.added[before:]
    s = stack["decode"].call("state")
    assert s["bad"] == [], s["bad"]
    assert set(ids) <= set(s["verified"]), set(ids) - set(s["verified"])
    assert_no_leak([stack["prefill"], stack["decode"]])


def test_the_models_list_of_a_decode_that_does_not_answer_is_a_bad_gateway():
    async def ask() -> Any:
        dead = [f"http://127.0.0.1:{free_port()}"]
        runner = web.AppRunner(Proxy(dead, dead, False, 5.0, 1.0).app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://127.0.0.1:{port}/v1/models") as r:
                    return r.status, await r.json()
        finally:
            await runner.cleanup()

    status, body = asyncio.run(ask())
    assert status == 502, body
    assert "the decode at" in body["error"]["message"], body


def test_the_proxy_sends_both_legs_at_once_where_both_instances_can(stack):
    url = stack["proxies"]["progressive"]
    before = stack["decode"].call("state")["engine_stats"]["reads_done"]
    run_requests(stack, "progressive", 6, 1)
    counts = get(url, "/kvlink/stats")
    assert counts["progressive"] == 6 and counts["sequential"] == 0, counts
    assert stack["decode"].call("state")["engine_stats"]["reads_done"] - before == 6


def test_the_sequential_proxy_runs_the_prefill_first(stack):
    url = stack["proxies"]["sequential"]
    run_requests(stack, "sequential", 4, 2)
    counts = get(url, "/kvlink/stats")
    assert counts["sequential"] == 4 and counts["progressive"] == 0, counts
