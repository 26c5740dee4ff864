"""Errors a caller can act on."""


class RequestError(ValueError):
    """A generation request is out of range (k, temperature, top_p, prompt length, ...); the message says which."""
