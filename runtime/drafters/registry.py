"""Every drafter by name: what each name makes, and what it needs (a draft engine, the target's vocabulary). The
Python API, the servers and the builder read this table; the bundle schema and the CLIs check a name against the
plain list in runtime/drafter_names.py, which tests/test_drafter_contract.py holds equal to this table's names (the
schema sits below the engines these drafters call, so it cannot import them). Adding a drafter: docs/drafts.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.decoding.drafter import Drafter
from runtime.drafter_names import DRAFTERS
from runtime.drafters.cross_vocab import CrossVocabDrafter
from runtime.drafters.feature import FeatureDrafter
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.suffix import HYBRID_SUFFIX, SuffixDrafter
from runtime.drafters.tokens import TokenDrafter
from runtime.errors import RequestError


@dataclass(frozen=True)
class DraftSources:
    """What a drafter may be made from for one request."""

    vocab_size: int  # the target's
    draft: object | None  # the bundle's draft engine (None: it has none)
    target_has_hidden: bool  # the target engine returns its final hidden states (a feature draft's input)
    confidence: float  # a model drafter stops a row's draft when its top probability falls below this
    bridge: object | None = None  # a VocabBridge where the draft has a tokenizer of its own (None: the target's)


@dataclass(frozen=True)
class DrafterKind:
    name: str
    summary: str
    uses_draft_engine: bool  # without the bundle's draft engine the request decodes target-only
    make: Callable[[DraftSources], Drafter]
    # its draft engine must share the target's tokenizer: where a build pairs a draft with a tokenizer of its own,
    # builder/build.py records the cross-tokenizer drafter as the bundle's default instead
    same_vocab: bool = False


def model_drafter(sources: DraftSources) -> Drafter:
    """The draft engine's drafter: a feature draft (its graph takes the target's hidden states), a model, or one
    that returns tokens (its runtime decodes the draft itself)."""
    if sources.bridge is not None:
        raise RequestError(
            "this bundle's draft has a tokenizer of its own: its drafters are 'tli' and 'string' "
            "(or the model-free 'prompt_lookup' and 'suffix')"
        )
    if sources.draft is not None and sources.draft.returns_tokens:  # a TensorRT-LLM draft engine
        return TokenDrafter(sources.draft)
    if sources.draft is not None and sources.draft.takes_features:  # the draft engine's graph
        if not sources.target_has_hidden:
            raise RequestError(
                "this bundle's draft drafts from the target's hidden states, but its target engine "
                "returns none; rebuild the bundle with this Draftsmith"
            )
        return FeatureDrafter(sources.draft, sources.confidence)
    return ModelDrafter(sources.draft, sources.confidence)


def _suffix(sources: DraftSources) -> Drafter:
    return SuffixDrafter(sources.vocab_size)


def _hybrid(sources: DraftSources) -> Drafter:
    return HybridDrafter(model_drafter(sources), sources.vocab_size)


def _hybrid_suffix(sources: DraftSources) -> Drafter:
    confident = SuffixDrafter(sources.vocab_size, HYBRID_SUFFIX)
    return HybridDrafter(model_drafter(sources), sources.vocab_size, free=confident)


def _cross(method: str) -> Callable[[DraftSources], Drafter]:
    def make(sources: DraftSources) -> Drafter:
        if sources.bridge is None:
            raise RequestError(
                f"the {method!r} drafter drafts with a tokenizer other than the target's; this "
                "bundle's draft shares the target's: use 'model'"
            )
        return CrossVocabDrafter(sources.draft, sources.bridge, method, sources.vocab_size, sources.confidence)

    return make


REGISTRY: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(
            "model",
            "the bundle's draft engine (a draft model, or a feature draft over the target's hidden states)",
            True,
            model_drafter,
            same_vocab=True,
        ),
        DrafterKind(
            "prompt_lookup",
            "n-gram lookup in the prompt and the text so far (no draft engine)",
            False,
            lambda sources: PromptLookupDrafter(sources.vocab_size),
        ),
        DrafterKind(
            "hybrid",
            "prompt lookup where the context has a 2-gram match, the draft engine elsewhere",
            True,
            _hybrid,
            same_vocab=True,
        ),
        DrafterKind(
            "suffix",
            "a suffix trie of the prompt, the text and a server's earlier responses (no draft engine)",
            False,
            _suffix,
        ),
        DrafterKind(
            "hybrid_suffix",
            "the suffix drafter where it is sure, the draft engine elsewhere",
            True,
            _hybrid_suffix,
            same_vocab=True,
        ),
        DrafterKind(
            "tli",
            "a draft with its own tokenizer, drafting inside the tokens both vocabularies share "
            "(exact for greedy and sampled decoding)",
            True,
            _cross("tli"),
        ),
        DrafterKind(
            "string",
            "a draft with its own tokenizer: its greedy text re-tokenized for the target, kept where "
            "it is the target's own choice",
            True,
            _cross("string"),
        ),
    )
}


def drafter_kind(name: str) -> DrafterKind:
    """The registered kind ``name``; RequestError (a client's mistake) for an unknown one."""
    kind = REGISTRY.get(name)
    if kind is None:
        raise RequestError(f"drafter must be one of {DRAFTERS}, received {name!r}")
    return kind


def make_drafter(name: str, sources: DraftSources) -> Drafter | None:
    """A new drafter of kind ``name`` for one request; None when it needs a draft engine and the bundle has none
    (the request then decodes target-only). RequestError for an unknown name."""
    kind = drafter_kind(name)
    if kind.uses_draft_engine and sources.draft is None:
        return None
    return kind.make(sources)
