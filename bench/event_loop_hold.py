"""How long one large request body holds the OpenAI server's event loop: the app in-process (httpx's ASGI transport),
a ticker on the same loop sleeping 1 ms at a time, and the longest gap between its ticks while the body is answered
(every other connection waits that long). Issue 54's body: a chat request whose ``metadata`` is a list of zeros.

    python -m bench.event_loop_hold BUNDLE --items 2100000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

from runtime.api import SpeculativeGenerator
from runtime.core.request import Limits
from runtime.serving.openai_server import create_app
from runtime.core.scheduler import Scheduler


async def longest_gap(app, body: bytes) -> tuple[float, float, int]:
    """(the longest gap between ticks, the request's seconds, its status) while ``body`` is answered."""
    gaps, done = [0.0], asyncio.Event()

    async def tick():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000", timeout=120) as client:
        began = time.perf_counter()
        response = await client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        seconds = time.perf_counter() - began
    done.set()
    await ticker
    return max(gaps), seconds, response.status_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--items", type=int, default=2_100_000, help="zeros in metadata's list (2.1M: ~4.2 MB)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    generator = SpeculativeGenerator.from_bundle(args.bundle, threads=1)
    scheduler = Scheduler(generator, max_batch=2).start()
    limits = Limits(max_tokens_limit=8, max_prompt_bytes=1 << 20, max_body_bytes=16 << 20)
    app = create_app(scheduler, "m", limits=limits)
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": messages, "max_tokens": 1, "metadata": {"a": [0] * args.items}}
    raw = json.dumps(body, separators=(",", ":")).encode()
    try:
        for _ in range(args.repeats):
            gap, seconds, status = asyncio.run(longest_gap(app, raw))
            print(f"{len(raw) / 1e6:.1f} MB body: HTTP {status} in {seconds:.3f} s, the loop held {gap * 1e3:.0f} ms")
    finally:
        scheduler.stop()


if __name__ == "__main__":
    main()
