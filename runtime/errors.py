"""Errors a caller can act on."""


class RequestError(ValueError):
    """A generation request is out of range (k, temperature, top_p, prompt length, ...); the message says which,
    and ``field`` names the first field at fault (DecodeRequest's name; None: the request as a whole), which a
    server reports in its own protocol's name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field
