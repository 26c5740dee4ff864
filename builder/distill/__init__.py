"""Distil a draft: train a small model to imitate the target on the target's own outputs.

The pipeline (``distill_draft(DistillRecipe(...), target, out)``; ``draftsmith distill`` wraps it), one module per
stage:

- ``corpus``: the prompts (the shipped ``data/distill_prompts.txt`` or the user's file), a few held out, and the
  samples and padded batches every stage shares;
- ``continuations``: the target (torch) continues every prompt, batched;
- ``distributions``: one teacher-forced pass of the target keeps the top ``top_k`` probabilities of each position;
- ``draft``: the draft to train -- the target's first N layers with its embeddings, final norm and head, or a given
  checkpoint -- and its optional reduced-vocabulary head;
- ``training``: KL(target || draft) over those rows for a wall-clock budget, embeddings and (tied) head frozen;
- ``evaluation``: greedy acceptance before and after, replayed exactly on the held-out prompts;
- ``save``: a Hugging Face folder (safetensors + the target's tokenizer) that ``build-engines --draft DIR`` takes;
- ``recipe``: ``DistillRecipe``, what a distillation makes and how (the command's flags, a preset's ``distill:``
  block, the Python callers' fields);
- ``pipeline`` runs them in order; ``cli`` is the command.
"""

from builder.distill.cli import distill
from builder.distill.continuations import eos_ids_of, generate
from builder.distill.corpus import COMPLETION_MARK, DistillError, Prompt, Sample, load_prompts, split_prompts
from builder.distill.distributions import teacher
from builder.distill.draft import check_init, init_draft, kept_vocabulary, reduce_head
from builder.distill.evaluation import ACCEPTANCE_KS, Acceptance, acceptance, replay
from builder.distill.pipeline import distill_draft
from builder.distill.recipe import RECIPE_KEYS, DistillRecipe, recipe_from
from builder.distill.save import REPORT_FILE, VOCAB_FILE, is_distilled, read_draft_vocab, save_draft
from builder.distill.training import train

__all__ = ["ACCEPTANCE_KS", "COMPLETION_MARK", "REPORT_FILE", "RECIPE_KEYS", "VOCAB_FILE", "Acceptance",
           "DistillError", "DistillRecipe", "Prompt", "Sample", "acceptance", "check_init", "distill", "distill_draft",
           "eos_ids_of", "generate", "init_draft", "is_distilled", "kept_vocabulary", "load_prompts",
           "read_draft_vocab", "recipe_from", "reduce_head", "replay", "save_draft", "split_prompts", "teacher",
           "train"]
