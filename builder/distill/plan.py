"""A distillation's work: how many continuations, prefilled windows and training steps its recipe makes, fixed by the
recipe and its prompts alone, so the same command makes the same draft on any machine (a busy or slow one takes
longer, never gets less); and the time that work is expected to take, printed before anything slow runs.

The expected time comes from reference rates, in multiply-adds a second, measured on the reference machine
(``REFERENCE_MACHINE``) and applied to the target's and the draft's sizes (``target_macs``, ``draft_macs``); the
stages then print the rates they measure as they run (the held-out continuations time the target, the first
training steps the draft), and their progress lines the time left at those rates.

``minutes`` (deprecated) is translated into work at fixed rates (``translate_minutes``): what a second of the old
budget bought the default recipe on the reference machine, whatever the target; a recipe that gives a work amount
keeps it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from builder.distill.corpus import DistillError

REFERENCE_MACHINE = "2 idle AMD EPYC cores (avx2, avx512_vnni, avx512_bf16)"
# the reference machine's rates (docs/drafts.md, "Work, not time"): SmolLM2-135M's GGUF engine continues 32 rows at
# a time at ~270 target tokens a second (134.5M multiply-adds a token, its 49,152-row head included); prefill reads
# windows ~2.4x as fast a token, without the head; the default feature draft trains a step of 2,048 token slots in
# ~0.58 s (930 steps in 545 s, 2026-12-02: 8.9M multiply-adds a token, forward and backward counted as 3x the
# forward); a layers=4 draft a step of 1,024 in 0.85 s (655 in 557 s, 2026-12-01: 18.9M a token)
GENERATE_MACS_PER_SECOND = 36e9
PREFILL_MACS_PER_SECOND = 68e9
TRAIN_MACS_PER_SECOND = {"feature": 88e9, "layers": 68e9}
FILL = 0.9  # a continuation's mean length over max_new_tokens (the default recipe: 0.88)
SETUP_SECONDS = 60  # loading the target, writing its engine, measuring and saving the draft (the default recipe)
SELF_PROMPT_TOKENS = 96  # a self-written prompt's token limit (builder/distill/self_prompts.py)

DEFAULT_TRAIN_STEPS = 600
DEFAULT_PREFILL_WINDOWS = 96
FEATURE_TOKENS_PER_BATCH = 2048  # a feature draft's training step (train_feature_draft)

# the deprecated ``minutes`` in work: what a second of the old budget bought the default recipe on the reference
# machine (2026-12-01: 126,334 target tokens in 596 s of generation, 558 training steps in 545 s); and the
# resumable flow's old plan of prefilled windows (300 tokens a second of its prefill share)
MINUTES_TOKENS_PER_SECOND = 212
MINUTES_STEPS_PER_SECOND = 1.0
MINUTES_PREFILL_TOKENS_PER_SECOND = 300
MINUTES_TRAINING_SHARE = 0.9  # of the training share: the rest went to the measurements and the save


@dataclass(frozen=True)
class Work:
    """What a distillation makes: ``continuations`` of the training prompts (pass after pass: each prompt once at
    ``temperature``, then sampled), at most ``max_new_tokens`` each, after ``heldout`` greedy held-out ones and
    ``self_prompts`` queries the target writes; ``prefill_windows`` of ``prefill_length`` tokens (a resumable
    recipe); ``train_steps`` optimizer steps of ``batch_tokens`` token slots."""

    heldout: int
    continuations: int
    max_new_tokens: int
    train_steps: int
    batch_tokens: int
    self_prompts: int = 0
    prefill_windows: int = 0
    prefill_length: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        parts = [f"{self.heldout:,} held-out continuations"]
        if self.self_prompts:
            parts.append(f"{self.self_prompts:,} self-written prompts")
        parts.append(f"{self.continuations:,} training continuations (up to {self.max_new_tokens} tokens each)")
        if self.prefill_windows:
            parts.append(f"{self.prefill_windows:,} prefilled windows of {self.prefill_length} tokens")
        parts.append(f"{self.train_steps:,} training steps of {self.batch_tokens:,} token slots")
        return ", ".join(parts)


def continuation_count(recipe, prompts: int) -> tuple[int, str]:
    """(training continuations, how the count was set) for ``prompts`` training prompts: ``continuations`` if given,
    else the deprecated ``minutes``' share, else every prompt ``samples_per_prompt`` times; never more than that."""
    available = prompts * recipe.samples_per_prompt
    if recipe.continuations:
        asked, why = recipe.continuations, "as given"
    elif recipe.minutes is not None:
        asked, why = translate_minutes(recipe)["continuations"], f"from minutes {recipe.minutes:g}"
    else:
        return available, f"{recipe.samples_per_prompt} per prompt"
    if asked > available:
        return available, f"{why} {asked:,}, capped at {prompts} prompts x {recipe.samples_per_prompt} samples"
    return asked, why


def train_steps(recipe) -> int:
    """The optimizer steps: ``train_steps``, else from the deprecated ``minutes``, else ``DEFAULT_TRAIN_STEPS``."""
    if recipe.train_steps:
        return recipe.train_steps
    return translate_minutes(recipe)["train_steps"] if recipe.minutes is not None else DEFAULT_TRAIN_STEPS


def prefill_windows(recipe) -> int:
    """The prefilled windows (a resumable recipe's), a whole number of ``prefill_rows`` calls: ``prefill_windows``,
    else from the deprecated ``minutes``, else ``DEFAULT_PREFILL_WINDOWS``."""
    if not recipe.prefill_text:
        return 0
    if recipe.prefill_windows:
        count = recipe.prefill_windows
    elif recipe.minutes is not None:
        count = translate_minutes(recipe)["prefill_windows"]
    else:
        count = DEFAULT_PREFILL_WINDOWS
    return recipe.prefill_rows * max(1, math.ceil(count / recipe.prefill_rows))


def translate_minutes(recipe) -> dict:
    """The deprecated ``minutes`` as work, at the fixed ``MINUTES_*`` rates: ``generate_share`` of it makes data
    (of that, ``prefill_share`` prefilled windows in a resumable recipe), the rest trains."""
    seconds = recipe.minutes * 60
    data = recipe.generate_share * seconds
    generated = data * (1 - recipe.prefill_share) if recipe.prefill_text else data
    tokens = generated * MINUTES_TOKENS_PER_SECOND
    windows = MINUTES_PREFILL_TOKENS_PER_SECOND * recipe.prefill_share * data / recipe.prefill_length
    return {
        "continuations": max(1, math.floor(tokens / (FILL * recipe.max_new_tokens))),
        "train_steps": max(1, round((seconds - data) * MINUTES_TRAINING_SHARE * MINUTES_STEPS_PER_SECOND)),
        "prefill_windows": max(1, math.ceil(windows)) if recipe.prefill_text else 0,
    }


def plan(recipe, train_prompts: int, heldout: int) -> tuple[Work, str]:
    """(the recipe's work for ``train_prompts`` and ``heldout`` prompts, how its continuations were counted)."""
    count, why = continuation_count(recipe, train_prompts)
    work = Work(
        heldout=heldout,
        continuations=count,
        max_new_tokens=recipe.max_new_tokens,
        train_steps=train_steps(recipe),
        batch_tokens=FEATURE_TOKENS_PER_BATCH if recipe.features else recipe.tokens_per_batch,
        self_prompts=recipe.self_prompts,
        prefill_windows=prefill_windows(recipe),
        prefill_length=recipe.prefill_length if recipe.prefill_text else 0,
    )
    return work, why


# --- the time it is expected to take --------------------------------------------------------------------------------


def layer_macs(config, intermediate: int = 0) -> int:
    """Multiply-adds a token of one decoder layer of ``config``'s shapes (a transformers config): attention's four
    projections and the gated MLP (``intermediate``: its width, 0 the config's)."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    width = intermediate or config.intermediate_size
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * width


def target_macs(config) -> tuple[int, int]:
    """(multiply-adds of a generated token, of a prefilled one: no head) of the target."""
    body = config.num_hidden_layers * layer_macs(config)
    return body + config.vocab_size * config.hidden_size, body


def draft_macs(recipe, config, draft_config=None) -> int:
    """Multiply-adds a trained token of the recipe's draft, forward only: a feature draft's fc, layer and kept head
    rows; a ``layers=N`` draft's N layers and head (``draft_config``: a given checkpoint's, its layers counted)."""
    head = (recipe.draft_vocab or config.vocab_size) * config.hidden_size
    if recipe.features:
        return 2 * config.hidden_size**2 + layer_macs(config, recipe.draft_intermediate) + head
    if recipe.init.startswith("layers="):
        return int(recipe.init[7:]) * layer_macs(config) + head
    if draft_config is None:
        return 0
    own = (recipe.draft_vocab or draft_config.vocab_size) * draft_config.hidden_size
    return draft_config.num_hidden_layers * layer_macs(draft_config) + own


def expected_seconds(
    work: Work, config, trained_macs: int, generate_rate: float | None = None, features: bool = True
) -> dict:
    """Each stage's expected seconds at the reference rates (``generate_rate``: target tokens a second measured on
    this machine, for the generation stages; ``features``: a feature draft's training rate, else a layers draft's);
    a stage of unknown cost (a given draft's training) is left out."""
    generated, prefilled = target_macs(config)
    per_token = 1 / generate_rate if generate_rate else generated / GENERATE_MACS_PER_SECOND
    seconds = {
        "setup": SETUP_SECONDS,
        "heldout": work.heldout * FILL * work.max_new_tokens * per_token,
        "self_prompts": work.self_prompts * FILL * SELF_PROMPT_TOKENS * per_token,
        "continuations": work.continuations * FILL * work.max_new_tokens * per_token,
        "prefill": work.prefill_windows * work.prefill_length * prefilled / PREFILL_MACS_PER_SECOND,
    }
    if trained_macs:
        rate = TRAIN_MACS_PER_SECOND["feature" if features else "layers"]
        seconds["training"] = work.train_steps * work.batch_tokens * 3 * trained_macs / rate
    return {name: round(value, 1) for name, value in seconds.items() if value}


def say_plan(say, work: Work, why: str, seconds: dict, recipe=None) -> None:
    """The plan and its expected time, before anything slow runs (and a word on ``recipe``'s deprecated ``minutes``
    where it set an amount)."""
    if recipe is not None and minutes_used(recipe):
        say(
            "distill: minutes (--minutes) is deprecated and no longer a time limit: translated into work at fixed "
            "rates (give continuations, train_steps and prefill_windows instead)"
        )
    say(f"distill: plan: {work.describe()} (continuations: {why})")
    total = sum(seconds.values())
    stages = ", ".join(f"{name} {value:.0f} s" for name, value in seconds.items())
    say(
        f"distill: expected about {total / 60:.0f} min on {REFERENCE_MACHINE} ({stages}); a busier or slower "
        "machine takes longer for the same draft"
    )


def minutes_used(recipe) -> bool:
    """Whether the deprecated ``minutes`` sets any of the recipe's work amounts (one left at 0)."""
    if recipe.minutes is None:
        return False
    return not (recipe.continuations and recipe.train_steps and (recipe.prefill_windows or not recipe.prefill_text))


def check_work(work: Work) -> None:
    if work.continuations < 1 and not work.prefill_windows:
        raise DistillError("the recipe plans no training continuation: raise --continuations or --samples-per-prompt")
