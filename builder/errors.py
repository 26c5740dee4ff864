"""The build's one refusal, apart from the pipeline (``builder.build``): every stage module raises it, and none of
them may import the orchestrator that imports them."""


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""
