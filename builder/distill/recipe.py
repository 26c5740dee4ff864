"""``DistillRecipe``: what a distillation makes and how, in one frozen object.

The command's flags, a preset's ``distill:`` block and the Python callers all build one; ``distill_draft`` takes it
with the few things that are not the recipe (the target, the draft folder, threads, the console). The fields a preset
and the command may set are ``RECIPE_KEYS`` (the command's flags, same names, same defaults); the others are the
Python API's alone (the tests' step bounds, batch sizes).

The values are checked by ``check()``, which ``distill_draft`` calls after it has looked at the draft folder, not when
the recipe is made: a preset whose draft is already distilled is kept without reading its values, and a value a
flag overrides is never judged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from builder.distill.corpus import DistillError
from runtime.bundle import GGUF_KERNELS
from runtime.engines import gguf_ops

RECIPE_KEYS = (
    "init",
    "prompts",
    "continuations",
    "train_steps",
    "prefill_windows",
    "minutes",
    "max_new_tokens",
    "temperature",
    "loss",
    "draft_vocab",
    "samples_per_prompt",
    "sample_temperature",
    "generate_share",
    "heldout",
    "lr",
    "seed",
    "teacher_engine",
    "generate_batch",
    "self_prompts",
    "prefill_text",
    "prefill_length",
    "prefill_rows",
    "prefill_share",
    "draft_intermediate",
    "heldout_prompts",
)  # a preset's `distill:` keys, and the command's flags
TEACHER_ENGINES = ("auto", "gguf", "fp32", "torch")


@dataclass(frozen=True)
class DistillRecipe:
    """A draft's recipe (builder/distill/cli.py's flags say what each field does).

    The recipe is budgeted in work, never in time (builder/distill/plan.py): every stage stops when its work is
    done, so the same recipe makes the same draft on a busy or slow machine as on a quiet one, only later.
    ``continuations``: the training continuations the target makes (0: every training prompt ``samples_per_prompt``
    times); ``train_steps``: the optimizer steps (0: ``plan.DEFAULT_TRAIN_STEPS``); ``prefill_windows``: the
    windows of ``prefill_text`` the target's engine reads (0: ``plan.DEFAULT_PREFILL_WINDOWS``). ``minutes`` is
    deprecated: a work amount left at 0 is then translated from it at fixed rates (``plan.translate_minutes``:
    what a minute bought the default recipe on the reference machine), ``generate_share`` and ``prefill_share``
    splitting it as they split the old budget; they mean nothing else.

    ``samples_per_prompt`` > 1 adds continuations sampled at ``sample_temperature`` after the first pass, pass after
    pass over the prompts (``continuations`` cuts the last pass): a small corpus then yields more distinct target
    text, so the draft overfits less (one greedy continuation per prompt of the 208 shipped ones gave 0.98 top-1 on
    training prompts, 0.28 held out).

    ``teacher_engine``: what generates the continuations and the teacher rows. ``auto`` is the fused ONNX engine the
    bundle's target will be (a GGUF file's own blocks, or fp32), in continuous batches of ``generate_batch`` rows,
    ~4x torch's ``generate`` here and with the teacher rows from the same calls; ``torch`` is transformers.

    ``self_prompts`` > 0: before the continuations, the target samples that many user queries from its chat
    template's user-turn prefix (builder/distill/self_prompts.py, the Magpie method); the distinct, finished ones join
    the training prompts (the held-out prompts stay the shipped ones).

    ``prefill_text`` (feature drafts): text sources the target's engine reads whole in batched prefill, windows of
    ``prefill_length`` tokens, ``prefill_rows`` a call (builder/distill/prefill.py): the bulk of the pairs at the
    cost of a prefill rather than of generation. With it the distillation keeps its data and training on disk and
    resumes where a killed run stopped (builder/distill/resumable.py), ending on the draft an unbroken run makes.
    ``draft_intermediate``: the draft layer's MLP width (0: the target's). ``heldout_prompts``: the held-out set,
    shipped sets (``heldout-code``, ``heldout-chat``) or prompt files, none of it in the training corpus (empty: a
    ``heldout`` share of the corpus).
    """

    # RECIPE_KEYS: a preset's `distill:` block and the command's flags
    init: str = "layers=4"  # layers=N, feature, or a draft checkpoint to start from
    prompts: str | Path | None = None  # a prompt file; None: the shipped corpus
    continuations: int = 0  # training continuations (0: every training prompt samples_per_prompt times)
    train_steps: int = 0  # optimizer steps (0: plan.DEFAULT_TRAIN_STEPS, or from the deprecated minutes)
    prefill_windows: int = 0  # windows of prefill_text (0: plan.DEFAULT_PREFILL_WINDOWS, or from minutes)
    minutes: float | None = None  # deprecated: work amounts left at 0 translated from it (plan.translate_minutes)
    max_new_tokens: int = 64
    temperature: float = 0.0  # of the first continuation of each training prompt (0: greedy)
    loss: str = "kl"
    draft_vocab: int = 0  # keep only this many of the most frequent target tokens in the head (0: all)
    samples_per_prompt: int = 1
    sample_temperature: float = 1.0
    generate_share: float = 0.4  # of the deprecated minutes: the data's share (the rest: training)
    heldout: float = 0.1
    lr: float = 5e-4
    seed: int = 0
    teacher_engine: str = "auto"
    generate_batch: int = 32
    self_prompts: int = 0
    prefill_text: tuple[str, ...] = ()  # sources: python:PACKAGE, a file or a folder (feature drafts)
    prefill_length: int = 512  # tokens a prefilled window
    prefill_rows: int = 1  # windows an engine call
    prefill_share: float = 0.7  # of the deprecated minutes' data share: prefilled windows (the rest: continuations)
    draft_intermediate: int = 0  # a feature draft's MLP width (0: the target's)
    heldout_prompts: tuple[str, ...] = ()  # shipped held-out sets or prompt files (empty: a share of the corpus)
    # the Python API's alone
    top_k: int = 32  # teacher probabilities kept per position
    batch_prompts: int = 16  # rows of torch's generate
    tokens_per_batch: int = 1024  # training and teacher batches
    max_prompt_tokens: int = 256
    chat: bool | None = None  # through the chat template (None: every prompt not marked @completion)
    train_prompt_positions: bool = True
    accuracy_level: int = 4  # the ONNX teacher engine's MatMulNBits accuracy level
    # quant gguf: the teacher engine's kernel, the preset's own ``gguf_kernel`` (runtime.bundle.GGUF_KERNELS), so the
    # draft learns the hidden states of the kernel the bundle's target engine multiplies with
    gguf_kernel: str = "auto"
    checkpoint_seconds: float = 300.0  # a resumable training's checkpoint interval (tests: 0, every step)

    @property
    def features(self) -> bool:
        """A feature draft (builder/distill/feature_draft.py) rather than a truncated or given checkpoint."""
        return self.init == "feature"

    @property
    def resumable(self) -> bool:
        """Data made by batched prefill, kept on disk with the training's checkpoints (builder/distill/resumable.py)."""
        return bool(self.prefill_text)

    @property
    def prompts_name(self) -> str:
        """The prompts as the report names them."""
        return str(self.prompts) if self.prompts else "builtin:distill_prompts.txt"

    def check(self) -> None:
        """Refuse values no distillation can run with (DistillError naming the flag), before anything slow."""
        if self.draft_vocab < 0:
            raise DistillError(f"--draft-vocab must be >= 0, received {self.draft_vocab}")
        if self.samples_per_prompt < 1 or self.sample_temperature <= 0:
            raise DistillError(
                f"--samples-per-prompt must be >= 1 and --sample-temperature > 0, received "
                f"{self.samples_per_prompt} and {self.sample_temperature}"
            )
        if self.teacher_engine not in TEACHER_ENGINES:
            raise DistillError(f"--teacher-engine must be auto, gguf, fp32 or torch, received {self.teacher_engine!r}")
        if self.features and self.teacher_engine == "torch":
            raise DistillError(
                "--init feature trains on the target engine's hidden states: use --teacher-engine auto, gguf or fp32"
            )
        if self.self_prompts < 0:
            raise DistillError(f"--self-prompts must be >= 0, received {self.self_prompts}")
        if self.self_prompts and self.teacher_engine == "torch":
            raise DistillError("--self-prompts samples with the target's ONNX engine: use --teacher-engine auto")
        if self.gguf_kernel not in GGUF_KERNELS:
            raise DistillError(f"gguf_kernel must be one of {GGUF_KERNELS}, received {self.gguf_kernel!r}")
        reason = gguf_ops.unavailable_reason()
        if self.gguf_kernel == "native" and reason is not None:
            raise DistillError(f"gguf_kernel native: {reason}; or set gguf_kernel: matmulnbits")
        for name in ("continuations", "train_steps", "prefill_windows"):
            if getattr(self, name) < 0:
                raise DistillError(f"--{name.replace('_', '-')} must be >= 0, received {getattr(self, name)}")
        if self.minutes is not None and self.minutes <= 0:
            raise DistillError(f"--minutes must be > 0, received {self.minutes}")
        if self.generate_batch < 1:
            raise DistillError(f"--generate-batch must be >= 1, received {self.generate_batch}")
        if not 0 < self.generate_share < 1:
            raise DistillError(f"--generate-share must be in (0, 1), received {self.generate_share}")
        self._check_prefill()

    def _check_prefill(self) -> None:
        if self.prefill_text and not self.features:
            raise DistillError("--prefill-text makes a feature draft's pairs: use it with --init feature")
        if self.prefill_length < 16 or self.prefill_rows < 1:
            raise DistillError(
                f"--prefill-length must be >= 16 and --prefill-rows >= 1, received {self.prefill_length} and "
                f"{self.prefill_rows}"
            )
        if not 0 <= self.prefill_share <= 1:
            raise DistillError(f"--prefill-share must be in [0, 1], received {self.prefill_share}")
        if self.draft_intermediate < 0 or (self.draft_intermediate and not self.features):
            raise DistillError(
                f"--draft-intermediate is a feature draft's MLP width (>= 0), received {self.draft_intermediate}"
            )

    def overridden(self, values: dict) -> DistillRecipe:
        """This recipe with ``values`` (RECIPE_KEYS only) in place of its own: the flags given over a preset's."""
        return dataclasses.replace(self, **{key: values[key] for key in RECIPE_KEYS if key in values})


def recipe_from(config: dict, path) -> tuple[str, str, DistillRecipe]:
    """(target, out, recipe) of a preset's ``distill:`` block: the draft folder is the preset's ``draft``; the keys
    the block leaves out keep the command's defaults; the teacher's kernel is the preset's ``gguf_kernel``."""
    block = config.get("distill")
    if not isinstance(block, dict):
        raise DistillError(f"{path} has no 'distill:' recipe (a mapping of draftsmith distill options)")
    unknown = sorted(set(block) - set(RECIPE_KEYS))
    if unknown:
        raise DistillError(f"{path}: unknown distill option(s) {unknown}; known: {list(RECIPE_KEYS)}")
    if not config.get("target") or not config.get("draft"):
        raise DistillError(f"{path} must name the target and, as 'draft', the folder the recipe distils into")
    lists = ("prefill_text", "heldout_prompts")  # YAML lists; the recipe holds tuples, as the flags give them
    sequences = {key: tuple(block[key]) for key in lists if isinstance(block.get(key), list)}
    kernel = config.get("gguf_kernel", "auto")
    return str(config["target"]), str(config["draft"]), DistillRecipe(**{**block, **sequences}, gguf_kernel=kernel)
