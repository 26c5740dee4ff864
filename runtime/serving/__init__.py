"""Serving many requests: the in-flight scheduler, the OpenAI-compatible server, graceful drain."""
