"""Serving over HTTP: the OpenAI-compatible server (its protocol, responses, connection bounds, pacing and graceful
drain). The decoding it serves is runtime/core/'s."""
