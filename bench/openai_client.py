"""One streamed request to an OpenAI-compatible server: its settings (``Spec``), the seeded mix of settings a load
sends (``mixed_spec``), and the client that reads its server-sent events and times them (``run_one``). Apart from
bench/openai_load.py, which runs many of these at once, so bench/drain_openai.py can send the same requests."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, field

import httpx

PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):",
    "Speculative decoding is",
    "Write a short note about the sea.",
    "for i in range(10):",
    "Once upon a time",
)
STOPS = ("\n\n", ". ")


@dataclass(frozen=True)
class Spec:
    """One request's settings."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    cancel_after: int = 0  # close the stream after this many text chunks (0: read it to the end)
    num_draft_tokens: int | None = None  # the server's draft length for this request (None: its own)

    @property
    def deterministic(self) -> bool:
        """Its text must not depend on what else the server runs: greedy, or sampled with a seed."""
        return self.temperature == 0 or self.seed is not None

    def body(self, model: str, chat: bool) -> dict:
        body = {
            "model": model,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        for name in ("top_p", "seed", "num_draft_tokens"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop:
            body["stop"] = list(self.stop)
        return body


@dataclass
class Outcome:
    spec: Spec
    status: str = "lost"  # answered, cancelled, failed or lost
    text: str = ""
    tokens: int = 0  # completion tokens (from the usage chunk)
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str = ""


def mixed_spec(
    index: int,
    seed: int,
    max_tokens: int,
    cancel_fraction: float,
    prompts: tuple[str, ...] = PROMPTS,
    max_draft_tokens: int = 0,
    long_prompt: str = "",
    long_fraction: float = 0.0,
    draft_tokens: int | None = None,
) -> Spec:
    """Request ``index`` of a run: the same index and seed always give the same settings. With
    ``max_draft_tokens``, half the requests pick num_draft_tokens in 1..it; with ``long_prompt``, a
    ``long_fraction`` of them send it (a prompt near the context limit); ``draft_tokens`` (e.g. 0: speculation
    off) is every request's num_draft_tokens instead."""
    rng = random.Random(seed * 1_000_003 + index)
    kind = rng.random()
    temperature, top_p, sample_seed = (0.0, None, None) if kind < 0.5 else (0.8, 0.95, None)
    if 0.5 <= kind < 0.8:
        sample_seed = rng.randrange(1 << 16)
    prompt = rng.choice(prompts)
    if long_prompt and rng.random() < long_fraction:
        prompt = long_prompt
    return Spec(
        prompt=prompt,
        max_tokens=max(1, rng.choice([max_tokens // 4, max_tokens // 2, max_tokens])),
        temperature=temperature,
        top_p=top_p,
        seed=sample_seed,
        stop=(rng.choice(STOPS),) if rng.random() < 0.25 else (),
        cancel_after=rng.randint(1, 3) if rng.random() < cancel_fraction else 0,
        num_draft_tokens=draft_tokens
        if draft_tokens is not None
        else rng.randint(1, max_draft_tokens)
        if max_draft_tokens and rng.random() < 0.5
        else None,
    )


def long_prompt_of(tokens: int) -> str:
    """A prompt of roughly ``tokens`` tokens for a BPE vocabulary (varied English words, about one token each)."""
    words = ("the sea is calm and the sky is clear so we walk on the sand and talk about the day").split()
    return " ".join(words[i % len(words)] for i in range(tokens))


def sse_lines(response):
    """A server-sent event stream's lines, split only where the protocol splits them (CR, LF, CRLF): httpx's
    ``iter_lines`` also splits at U+2028, U+0085 and the like, which a JSON string may carry raw."""
    buffer = ""
    for text in response.iter_text():
        *lines, buffer = re.split(r"\r\n|\r|\n", buffer + text)
        yield from lines
    if buffer:
        yield buffer


def run_one(client: httpx.Client, base: str, spec: Spec, model: str, chat: bool) -> Outcome:
    """Send one streamed request and read it (to the end, or to ``spec.cancel_after`` chunks)."""
    out = Outcome(spec)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start = last = time.perf_counter()
    finished = done = False
    try:
        with client.stream("POST", base + path, json=spec.body(model, chat)) as response:
            if response.status_code != 200:
                response.read()
                out.status, out.error = "failed", f"HTTP {response.status_code}: {error_message(response.text)}"
                return out
            chunks = 0
            for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[len("data: ") :])
                if "error" in data:
                    out.status, out.error = "failed", f"error event: {data['error'].get('message')}"
                    return out
                if data.get("usage"):
                    out.tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices", []):
                    piece = choice.get("text") if "text" in choice else choice.get("delta", {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if out.ttft is None:
                            out.ttft = now - start
                        else:
                            out.gaps.append(now - last)
                        last, chunks, out.text = now, chunks + 1, out.text + piece
                    finished = finished or choice.get("finish_reason") is not None
                if spec.cancel_after and chunks >= spec.cancel_after and not finished:
                    out.status = "cancelled"  # leaving the block closes the connection: the server cancels
                    return out
    except (httpx.HTTPError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"
        return out
    if finished and done:
        out.status = "answered"
    else:
        out.error = out.error or "the stream ended without a finish_reason and [DONE]"
    return out


def error_message(text: str) -> str:
    """An OpenAI error body's message, or the body's first 200 characters."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:200]
