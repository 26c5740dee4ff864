"""A bundle whose tokenizer llguidance cannot read (a WordPiece decoder) still serves (issue 54): the server starts,
says once why structured output and chat logprobs are unavailable, refuses them per request with a 400 naming the
field and the reason, and answers everything else."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("httpx")

from openai_asgi import call, chat, completion, with_tool  # noqa: E402
from bundle_edits import copy_of, rehash  # noqa: E402

WORDPIECE = {"type": "WordPiece", "prefix": "##", "cleanup": True}


@pytest.fixture(scope="module")
def wordpiece(tiny_bundle, tmp_path_factory):
    """(the generator, its app, what the server logged at start) over the tiny bundle with a WordPiece decoder."""
    from runtime.api import SpeculativeGenerator
    from runtime.serving.openai_server import LOOPBACK_HOSTS, _prepare_grammars, create_app
    from runtime.core.scheduler import Scheduler

    root = copy_of(tiny_bundle, tmp_path_factory.mktemp("wordpiece") / "b")
    path = root / "tokenizer" / "tokenizer.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), "decoder": WORDPIECE}))
    rehash(root)
    generator = SpeculativeGenerator.from_bundle(root, threads=1)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("draftsmith.openai").addHandler(handler)
    try:
        _prepare_grammars(generator)  # what serve-openai does before it serves
    finally:
        logging.getLogger("draftsmith.openai").removeHandler(handler)
    scheduler = Scheduler(generator, max_batch=2).start()
    yield generator, create_app(scheduler, "tiny", allowed_hosts=LOOPBACK_HOSTS), [r.getMessage() for r in records]
    scheduler.stop()


def test_the_server_starts_and_says_once_what_is_unavailable_and_why(wordpiece):
    logged = wordpiece[2]
    assert len(logged) == 2, logged  # structured output, chat logprobs: one line each
    assert all("can't determine decoder type" in line and "WordPiece" in line for line in logged)
    assert "structured output is unavailable" in logged[0] and "response_format or tools" in logged[0]
    assert "chat logprobs are unavailable" in logged[1]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", chat(response_format={"type": "json_object"}), "response_format"),
        ("/v1/chat/completions", with_tool({"type": "object"}), "tools"),
        ("/v1/completions", completion({"type": "regex", "regex": "[ab]+"}), "response_format"),
        ("/v1/completions", completion({"type": "json_schema", "json_schema": {"schema": {}}}), "response_format"),
        ("/v1/chat/completions", chat(logprobs=True), "logprobs"),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=3), "logprobs"),
    ],
)
def test_what_needs_the_tokens_bytes_is_refused_naming_the_field_and_why(wordpiece, path, body, param):
    response = call(wordpiece[1], "POST", path, json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert "unavailable for this bundle" in error["message"] and "WordPiece" in error["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", chat()),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4, "logprobs": 2}),  # no bytes in these
        ("/v1/chat/completions", chat(response_format={"type": "text"})),  # unconstrained
    ],
)
def test_everything_else_is_served(wordpiece, path, body):
    response = call(wordpiece[1], "POST", path, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
