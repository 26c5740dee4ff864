"""Distil a draft: train a small model to imitate the target on the target's own outputs.

The pipeline (``distill_draft(DistillRecipe(...), target, out)``; ``draftsmith distill`` wraps it), one module per
stage:

- ``corpus``: the prompts (the shipped ``data/distill_prompts.txt`` or the user's file), a few held out, and the
  samples and padded batches every stage shares;
- ``continuations``: the target (torch) continues every prompt, batched;
- ``distributions``: one teacher-forced pass of the target keeps the top ``top_k`` probabilities of each position;
- ``draft``: the draft to train -- the target's first N layers with its embeddings, final norm and head, or a given
  checkpoint -- and its optional reduced-vocabulary head;
- ``plan``: the recipe's work (continuations, prefilled windows, training steps: never a time) and its expected
  time, said before anything slow runs;
- ``training``: KL(target || draft) over those rows for the planned steps, embeddings and (tied) head frozen;
- ``evaluation``: greedy acceptance before and after, replayed exactly on the held-out prompts;
- ``save``: a Hugging Face folder (safetensors + the target's tokenizer) that ``build-engines --draft DIR`` takes;
- ``recipe``: ``DistillRecipe``, what a distillation makes and how (the command's flags, a preset's ``distill:``
  block, the Python callers' fields);
- ``pipeline`` runs them in order; ``cli`` is the command.

Import each name from its stage's module (``from builder.distill.pipeline import distill_draft``): this package
file imports nothing, so loading one stage never loads the others (tests/test_layout.py: no import circle through
a package's ``__init__``).
"""
