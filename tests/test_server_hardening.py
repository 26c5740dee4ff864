"""The OpenAI server's door: Host names (DNS rebinding), Content-Type (cross-site posts), slow bodies, the absolute
body cap, an empty API key; and a request whose chat template or text is hostile costs only itself."""

from __future__ import annotations

import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from runtime.serving import openai_server  # noqa: E402
from runtime.request import MAX_BODY_BYTES, Limits  # noqa: E402
from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app, host_name  # noqa: E402
from runtime.serving.scheduler import Scheduler  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def app(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=2).start()
    yield create_app(scheduler, MODEL, allowed_hosts=LOOPBACK_HOSTS)
    scheduler.stop()


def call(app, method: str, path: str, **options) -> httpx.Response:
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as client:
            return await client.request(method, path, **options)

    return asyncio.run(run())


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "attacker.localhost.evil", "0.0.0.0", "[::2]:8000", ""],
)
def test_a_loopback_server_refuses_other_host_names(app, host):
    response = call(app, "GET", "/v1/models", headers={"host": host})
    assert response.status_code == 421 and response.json()["error"]["code"] == "misdirected_request"


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "::1"])
def test_a_loopback_server_answers_loopback_names(app, host):
    assert call(app, "GET", "/v1/models", headers={"host": host}).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonp"],
)
def test_a_post_that_a_browser_could_send_cross_site_is_refused(app, content_type):
    headers = {"content-type": content_type} if content_type else {}
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    response = call(app, "POST", "/v1/completions", content=body, headers=headers)
    assert response.status_code == 415


def test_json_with_a_charset_is_json(app):
    response = call(
        app,
        "POST",
        "/v1/completions",
        content=b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert response.status_code == 200


def test_a_body_that_never_finishes_arriving_is_a_408(app, monkeypatch):
    monkeypatch.setattr(openai_server, "BODY_SECONDS", 0.2)
    sent = []

    async def run():
        async def receive():
            if not sent:
                sent.append(1)
                return {"type": "http.request", "body": b'{"model": ', "more_body": True}
            await asyncio.sleep(3600)

        messages = []

        async def send(message):
            messages.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", b"100")],
            "query_string": b"",
            "http_version": "1.1",
            "scheme": "http",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 1),
            "root_path": "",
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        return messages

    messages = asyncio.run(run())
    assert messages[0]["status"] == 408


def test_the_body_limit_has_an_absolute_cap():
    assert Limits.for_context(1 << 22).max_body_bytes == MAX_BODY_BYTES
    assert Limits.for_context(2048).max_body_bytes < MAX_BODY_BYTES


@pytest.mark.parametrize(
    "header,name",
    [
        (b"127.0.0.1:80", "127.0.0.1"),
        (b"[::1]:8000", "::1"),
        (b"::1", "::1"),
        (b"LocalHost", "localhost"),
        (b"[::1", "[::1"),
    ],
)
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_not_taken_as_none(tiny_bundle, key, monkeypatch):
    from click.testing import CliRunner

    from runtime.cli import main

    monkeypatch.setenv("DRAFTSMITH_API_KEY", key)
    monkeypatch.setattr(openai_server, "serve", lambda *a, **k: pytest.fail("the server started"))
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--port", "1"])
    assert result.exit_code != 0 and "API key is empty" in result.output


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "ab\ud800"},
        {"model": MODEL, "prompt": "ok", "stop": ["\udfff"]},
        {"model": MODEL, "prompt": "ok", "temperature": 5e-324, "max_tokens": 2},
    ],
)
def test_hostile_text_is_a_400_and_the_server_still_serves(app, body):
    import json

    raw = json.dumps(body).encode()  # json.dumps escapes the surrogates as \ud800, as a client would send them
    response = call(app, "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"})
    if "temperature" in body:
        assert response.status_code == 200
    else:
        assert response.status_code == 400 and "Unicode" in response.json()["error"]["message"]
    good = call(app, "POST", "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200


def test_health_follows_the_schedulers_loop(tiny_bundle):
    """/health answers from the scheduler's real state: 200 while its loop runs, 503 once it is stopped (or died)."""
    from runtime.api import SpeculativeGenerator

    scheduler = Scheduler(SpeculativeGenerator.from_bundle(tiny_bundle, threads=1), max_batch=1).start()
    app = create_app(scheduler, MODEL)
    assert call(app, "GET", "/health").status_code == 200
    scheduler.stop()
    assert call(app, "GET", "/health").status_code == 503
