"""The OpenAI server's app called in-process (httpx's ASGI transport, no socket), and the request bodies that
several test files send it. The ``scheduler`` and ``app`` fixtures these calls go to are in tests/conftest.py."""

from __future__ import annotations

import asyncio

import httpx

MODEL = "tiny"


def call(app, method: str, path: str, **options) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **options)

    return asyncio.run(run())


def completion(fmt: dict, **extra) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": fmt, **extra}


def with_tool(parameters: dict, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
        "tool_choice": "required",
        **extra,
    }


def chat(tools=None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    if tools is not None:
        body.update(
            tools=[{"type": "function", "function": {"name": "f", "parameters": tools}}], tool_choice="required"
        )
    return body
