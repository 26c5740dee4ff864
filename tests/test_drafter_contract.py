"""The drafter contract (runtime/decoding/drafter.py) and registry (runtime/drafters/registry.py): every capability is
declared on the base class and called unconditionally, never probed; every name the bundle schema, the API and the
CLIs accept (runtime/drafter_names.py) is a registered kind that makes a drafter, and no registered kind is missing
from those names."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from runtime.decoding.drafter import Drafter
from runtime.engines.base import Engine
from runtime.drafter_names import DRAFTERS
from runtime.drafters.registry import REGISTRY, DraftSources, make_drafter
from runtime.errors import RequestError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "builder", "runtime", "triton_repo")
CAPABILITIES = {name for name in vars(Drafter) if not name.startswith("_")} | {"grammars"}


def capability_probes(source: str, capabilities: set[str] = CAPABILITIES) -> list[tuple[int, str]]:
    """(line, name) of every ``hasattr(x, "name")`` / ``getattr(x, "name", ...)`` of a capability (a drafter's by
    default; tests/test_engine_contract.py asks for an engine's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in capabilities
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def test_no_drafter_capability_is_probed():
    probes = [
        f"{path.relative_to(ROOT)}:{line} probes {name!r}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, name in capability_probes(path.read_text(encoding="utf-8"))
    ]
    assert probes == [], "declare the capability on runtime.decoding.drafter.Drafter and call it:\n" + "\n".join(probes)


def test_the_guard_sees_a_probe():
    assert capability_probes('if hasattr(d, "take_features"):\n    pass\nx = getattr(d, "takes_prefixes", False)') == [
        (1, "take_features"),
        (3, "takes_prefixes"),
    ]
    assert capability_probes('getattr(engine, "takes_features", False)') == []  # an engine's, not a drafter's


class _Engine(Engine):
    vocab_size = 16


CROSS = ("tli", "string")  # the kinds of a draft with its own tokenizer: they take the vocabularies' bridge


def sources(draft=None, has_hidden=False, bridge=None) -> DraftSources:
    return DraftSources(16, draft, has_hidden, 0.0, bridge)


def byte_bridge():
    from runtime.text.vocab_bridge import VocabBridge

    table = ([bytes([65 + i]) for i in range(16)], np.zeros(16, bool))
    return VocabBridge.from_tables(None, None, table, table)


@pytest.mark.parametrize("name", DRAFTERS)
def test_every_registered_kind_makes_a_drafter_that_implements_the_contract(name):
    drafter = make_drafter(name, sources(draft=_Engine(), bridge=byte_bridge() if name in CROSS else None))
    assert isinstance(drafter, Drafter)
    required = ("start", "propose", "settle", "observe", "keep_rows")
    assert all(getattr(type(drafter), method) is not getattr(Drafter, method) for method in required)
    drafter.take_features(None)  # optional hooks exist on every drafter
    drafter.constrain_rows([None])


def test_a_kind_that_needs_the_draft_engine_gives_none_without_one_and_an_unknown_kind_is_refused():
    assert [name for name in DRAFTERS if make_drafter(name, sources()) is None] == [
        name for name, kind in REGISTRY.items() if kind.uses_draft_engine
    ]
    with pytest.raises(RequestError, match="drafter must be one of"):
        make_drafter("medusa", sources())


@pytest.mark.parametrize("name", DRAFTERS)
def test_each_kind_says_which_vocabularies_it_drafts_across(name):
    """A draft with its own tokenizer takes tli/string (and the model-free kinds); a same-vocabulary draft the
    others: the wrong pairing is a RequestError naming the right kinds, never a crash mid-decode."""
    engine_kinds = [n for n, kind in REGISTRY.items() if kind.uses_draft_engine]
    for bridge in (None, byte_bridge()):
        refused = name in engine_kinds and (name in CROSS) == (bridge is None)
        if refused:
            with pytest.raises(RequestError, match="tli|model"):
                make_drafter(name, sources(draft=_Engine(), bridge=bridge))
        else:
            assert isinstance(make_drafter(name, sources(draft=_Engine(), bridge=bridge)), Drafter)


def test_a_feature_draft_needs_a_target_that_returns_hidden_states():
    class FeatureEngine(_Engine):
        takes_features = True

    with pytest.raises(RequestError, match="hidden states"):
        make_drafter("model", sources(draft=FeatureEngine()))
    assert make_drafter("hybrid", sources(draft=FeatureEngine(), has_hidden=True)).reads_features


def test_the_names_are_the_registry_s_and_the_schema_checks_them():
    """runtime/drafter_names.py is the registry's names as data (same names, same order): a drafter registered
    without its name there, or a name left behind, fails here before any bundle records it."""
    from runtime.bundle import BuildSpec, SpecError

    assert DRAFTERS == tuple(REGISTRY) and all(kind.name == name for name, kind in REGISTRY.items())
    assert [BuildSpec(target="t", drafter=name).drafter for name in DRAFTERS] == list(DRAFTERS)
    with pytest.raises(SpecError, match="drafter"):
        BuildSpec(target="t", drafter="medusa")


def test_same_vocab_marks_the_kinds_a_draft_with_its_own_tokenizer_refuses():
    """``same_vocab`` (what builder/build.py swaps for the cross-tokenizer default) is exactly the kinds that refuse a
    draft with a tokenizer of its own."""
    refused = []
    for name in DRAFTERS:
        try:
            make_drafter(name, sources(draft=_Engine(), bridge=byte_bridge()))
        except RequestError:
            refused.append(name)
    assert refused == [name for name, kind in REGISTRY.items() if kind.same_vocab]


def test_the_clis_read_the_names():
    import click

    from builder.cli import main as build_engines
    from runtime.cli import generate
    from bench.drafter_list import drafter_labels

    for command in (generate, build_engines):
        choices = [p.type.choices for p in command.params if p.name in ("drafter", "drafter_kind")]
        assert choices and all(isinstance(c, (list, tuple)) for c in choices)
        assert [tuple(c) for c in choices] == [DRAFTERS], command.name
    assert isinstance(generate, click.Command)
    # the bench takes a list (several drafters in one run), each item checked against the same registry
    assert drafter_labels(",".join(DRAFTERS)) == list(DRAFTERS)
    with pytest.raises(click.BadParameter, match="expected drafter kinds"):
        drafter_labels("model,medusa")


def test_prompt_lookup_through_the_registry_proposes_point_masses():
    from runtime.decoding.sampling import SamplingParams

    drafter = make_drafter("prompt_lookup", sources())
    drafter.start([[1, 2, 3, 1, 2]])
    proposal = drafter.propose([2], SamplingParams(), [np.random.default_rng(0)])
    assert proposal.tokens == [[3, 1]]
