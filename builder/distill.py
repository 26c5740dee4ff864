"""Distil a draft: train a small model to imitate the target on the target's own outputs.

Pipeline (``distill_draft``; the click command ``distill`` wraps it): the target (torch) continues a prompt corpus
(the shipped ``data/distill_prompts.txt`` or the user's file), batched; a few prompts are held out. One
teacher-forced pass of the target over every prompt + continuation keeps the top ``top_k`` probabilities of each
position (sparse logits: the full 49152-wide rows of SmolLM2 would need gigabytes). The draft -- the target's first
N layers with its embeddings, final norm and head, or a given checkpoint -- is then trained for a wall-clock budget
on KL(target || draft) at temperature 1 over those top-k rows (or cross-entropy on the target's tokens,
``loss="tokens"``), with the embeddings and the (tied) head frozen. Acceptance is measured before and after on the
held-out prompts, and the draft is saved as a Hugging Face folder (safetensors + the target's tokenizer) that
``build-engines --draft DIR`` takes.

Greedy acceptance is computed exactly by replaying the speculative loop on the target's greedy continuation of each
held-out prompt: a step drafts up to k tokens, keeps the run of them that matches the target's tokens (teacher-forced
draft argmax), and emits one target token more. It equals what greedy speculative decoding would accept, up to
rounding differences between torch and the exported engines.

Reduced-vocabulary head (``draft_vocab=N``): the draft's head keeps the N token ids the target emitted most often in
the training continuations (plus its EOS ids). They are saved in ``DIR/draft_vocab.json``; ``build-engines`` exports
the draft with only those head rows and the runtime maps its logits back to the full vocabulary with -inf elsewhere
(``runtime.engine.MappedVocabEngine``), so the draft's q is 0 outside the kept set and rejection sampling stays exact.
The saved safetensors keep the full head, so the folder stays an ordinary Hugging Face checkpoint.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable

import click
import numpy as np

COMPLETION_MARK = "@completion"  # first line of a corpus block: a raw text completion, not a chat turn
VOCAB_FILE = "draft_vocab.json"
REPORT_FILE = "distill_report.json"
ACCEPTANCE_KS = (1, 2, 3, 4, 6, 8)


class DistillError(RuntimeError):
    """Distillation cannot go on; the message says why and what to do."""


@dataclass
class Prompt:
    text: str
    completion: bool = False  # True: fed as raw text; False: through the chat template when the tokenizer has one


@dataclass
class Sample:
    """One prompt with the target's continuation and sparse teacher distributions for every next-token position."""

    prompt: list[int]
    continuation: list[int]
    top_ids: np.ndarray | None = None  # [L-1, K] int64: the target's top-k next tokens at positions 0..L-2
    top_probs: np.ndarray | None = None  # [L-1, K] float32: their probabilities (temperature 1)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.continuation


@dataclass
class Acceptance:
    top1: float  # teacher-forced top-1 agreement with the target's tokens over continuation positions
    positions: int
    greedy: dict = field(default_factory=dict)  # k -> {"acceptance", "tokens_per_step", "alpha"}

    def to_dict(self) -> dict:
        return {"top1_agreement": round(self.top1, 4), "positions": self.positions,
                "greedy": {str(k): v for k, v in self.greedy.items()}}


# --- prompts --------------------------------------------------------------------------------------------------------

def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The shipped corpus, or a user's file: blocks separated by ``---`` lines, or one prompt per line.

    A block whose first line is ``@completion`` is fed as raw text (code to continue); the others go through the
    target's chat template when it has one.
    """
    from runtime.bench import parse_prompts
    if path is None:
        text = resources.files("builder").joinpath("data/distill_prompts.txt").read_text(encoding="utf-8")
    else:
        path = Path(path)
        if not path.is_file():
            raise DistillError(f"{path}: no such prompt file")
        text = path.read_text(encoding="utf-8")
    prompts = []
    for block in parse_prompts(text):
        first, _, rest = block.partition("\n")
        if first.strip() == COMPLETION_MARK:
            if rest.strip():
                prompts.append(Prompt(rest, completion=True))
        else:
            prompts.append(Prompt(block))
    if len(prompts) < 2:
        raise DistillError(f"{path or 'the shipped corpus'}: need at least 2 prompts (some are held out), "
                           f"found {len(prompts)}")
    return prompts


def split_prompts(prompts: list, heldout: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle; at least one prompt on each side."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_held = min(len(prompts) - 1, max(1, round(heldout * len(prompts))))
    held = sorted(order[:n_held])
    train = sorted(order[n_held:])
    return [prompts[i] for i in train], [prompts[i] for i in held]


def encode(tokenizer, prompt: Prompt, chat: bool | None, max_tokens: int) -> list[int]:
    use_chat = bool((not prompt.completion) if chat is None else chat) and bool(getattr(tokenizer, "chat_template", None))
    if use_chat:  # transformers renders templates in jinja2's sandbox, as runtime.text does
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = prompt.text
    # as the runtime encodes prompts: a rendered chat prompt carries its own special tokens (Tokenizer.encode_chat)
    ids = tokenizer(text, add_special_tokens=not use_chat)["input_ids"]
    return list(ids[-max_tokens:])


# --- the target's side ----------------------------------------------------------------------------------------------

def eos_ids_of(model, tokenizer) -> list[int]:
    ids = set()
    for value in (getattr(model.config, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)
                  if getattr(model, "generation_config", None) else None, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def generate(model, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             eos_ids: list[int], pad_id: int, batch_size: int = 16, deadline: float = math.inf,
             advance: Callable[[int], None] = lambda n: None) -> list[Sample]:
    """Continue every prompt with the target (left-padded batches of similar length). Stops starting batches at
    ``deadline``; returns the samples made so far, in the order of ``prompts``."""
    import torch
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    done: dict[int, Sample] = {}
    torch.manual_seed(seed)
    for start in range(0, len(order), batch_size):
        if start and time.perf_counter() > deadline:  # the first batch always runs
            break
        rows = order[start: start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        options = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                       eos_token_id=eos_ids or None)
        if temperature > 0:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        else:
            options.update(temperature=None, top_k=None, top_p=None)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        for r, i in enumerate(rows):
            continuation = []
            for token in out[r, width:].tolist():
                continuation.append(token)
                if token in eos_ids:
                    break
            done[i] = Sample(list(prompts[i]), continuation)
        advance(len(rows))
    return [done[i] for i in sorted(done)]


def teacher(model, samples: list[Sample], top_k: int, tokens_per_batch: int = 1024,
            advance: Callable[[int], None] = lambda n: None) -> None:
    """Fill each sample's sparse teacher rows: the target's top-k next-token probabilities at every position."""
    import torch
    for batch in _batches(samples, tokens_per_batch, shuffle=None):
        ids, mask = _pad([s.ids for s in batch])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            for r, s in enumerate(batch):
                n = len(s.ids) - 1
                probs = torch.softmax(logits[r, :n].float(), dim=-1)
                values, index = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
                s.top_ids, s.top_probs = index.numpy().astype(np.int64), values.numpy().astype(np.float32)
        del logits
        advance(len(batch))


def _pad(rows: list[list[int]], pad: int = 0):
    import torch
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def _batches(samples: list[Sample], tokens: int, shuffle: random.Random | None):
    """Right-padded batches of about ``tokens`` tokens (padding included), similar lengths together."""
    if shuffle is None:
        order = sorted(samples, key=lambda s: len(s.ids))
    else:
        order = list(samples)
        shuffle.shuffle(order)
        # sort within windows so batches hold similar lengths but their order stays random
        window = 64
        order = [s for i in range(0, len(order), window)
                 for s in sorted(order[i: i + window], key=lambda s: len(s.ids))]
    batch: list[Sample] = []
    chunks = []
    for s in order:
        width = max([len(s.ids)] + [len(b.ids) for b in batch])
        if batch and width * (len(batch) + 1) > tokens:
            chunks.append(batch)
            batch = []
        batch.append(s)
    if batch:
        chunks.append(batch)
    if shuffle is not None:
        shuffle.shuffle(chunks)
    return chunks


# --- the draft ------------------------------------------------------------------------------------------------------

def _clean_config(config, layers: int | None = None):
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF-loaded target: the draft is plain fp32
    if layers is not None:
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:layers]
    return config


def check_init(init: str, total: int) -> int:
    """The layer count of ``layers=N`` (0 for a checkpoint path), checked against the target's ``total`` layers."""
    if not init.startswith("layers="):
        if not init:
            raise DistillError("--init: give layers=N or a draft checkpoint")
        return 0
    text = init[7:]
    if not text.isdigit() or not 1 <= int(text) < total:
        raise DistillError(f"--init {init}: N must be an integer in [1, {total - 1}] (the target has {total} layers)")
    return int(text)


def init_draft(target_model, init: str, allow_pickle: bool = False):
    """``layers=N``: a fresh model holding the target's first N layers, embeddings, final norm and head (copies, so
    the target is untouched); otherwise a checkpoint (HF folder or .gguf) to start from."""
    import torch
    from transformers import AutoModelForCausalLM
    if init.startswith("layers="):
        layers = check_init(init, target_model.config.num_hidden_layers)
        config = _clean_config(target_model.config, layers)
        torch.manual_seed(0)
        draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = target_model.state_dict()
        keep = {}
        for name in draft.state_dict():
            if name in state:
                keep[name] = state[name]
        missing, unexpected = draft.load_state_dict(keep, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
        if missing:
            raise DistillError(f"--init {init}: the truncated draft has weights the target lacks: {missing[:5]}")
        return draft.eval()
    from builder import checkpoint as ckpt
    draft = ckpt.resolve(init, allow_pickle).load_model()
    draft.config = _clean_config(draft.config)
    draft.hf_quantizer = None
    return draft


def kept_vocabulary(samples: list[Sample], size: int, vocab: int, always: list[int]) -> np.ndarray:
    """The ``size`` ids the target emitted most often (ties: lower id first), plus ``always``; sorted."""
    counts = np.zeros(vocab, np.int64)
    for s in samples:
        ids = np.asarray([t for t in s.continuation if t < vocab], np.int64)
        np.add.at(counts, ids, 1)
    boost = np.zeros(vocab, np.int64)
    for s in samples:  # prompt tokens break ties among unseen ones: better than the lowest ids
        ids = np.asarray([t for t in s.prompt if t < vocab], np.int64)
        np.add.at(boost, ids, 1)
    order = np.lexsort((np.arange(vocab), -boost, -counts))  # last key is the primary one
    kept = set(int(t) for t in always if t < vocab)
    for t in order:
        if len(kept) >= size:
            break
        kept.add(int(t))
    return np.array(sorted(kept), np.int64)


def coverage(samples: list[Sample], kept: np.ndarray | None) -> float:
    if kept is None:
        return 1.0
    tokens = np.asarray([t for s in samples for t in s.continuation], np.int64)
    return float(np.isin(tokens, kept).mean()) if len(tokens) else 0.0


def _head_weight(draft, kept):
    import torch
    weight = draft.get_output_embeddings().weight
    return weight if kept is None else weight.index_select(0, torch.as_tensor(kept))


def _hidden(draft, ids, mask):
    base = getattr(draft, draft.base_model_prefix)
    return base(input_ids=ids, attention_mask=mask).last_hidden_state


def draft_argmax(draft, samples: list[Sample], kept: np.ndarray | None, tokens_per_batch: int = 1024) -> list:
    """Teacher-forced draft argmax (full-vocabulary ids) at every next-token position of each sample."""
    import torch
    out = {}
    with torch.no_grad():
        weight = _head_weight(draft, kept)
        for batch in _batches(samples, tokens_per_batch, shuffle=None):
            ids, mask = _pad([s.ids for s in batch])
            hidden = _hidden(draft, ids, mask)
            best = (hidden @ weight.T).argmax(-1).numpy()
            if kept is not None:
                best = kept[best]
            for r, s in enumerate(batch):
                out[id(s)] = best[r, : len(s.ids) - 1]
    return [out[id(s)] for s in samples]


def acceptance(draft, samples: list[Sample], kept: np.ndarray | None = None, ks=ACCEPTANCE_KS) -> Acceptance:
    """Greedy acceptance on the target's greedy continuations, replayed exactly (see the module docstring)."""
    predictions = draft_argmax(draft, samples, kept)
    matches = []
    for s, pred in zip(samples, predictions):
        start = len(s.prompt) - 1  # position whose next token is the first continuation token
        want = np.asarray(s.continuation, np.int64)
        matches.append(pred[start: start + len(want)] == want)
    total = sum(len(m) for m in matches)
    top1 = float(sum(int(m.sum()) for m in matches) / total) if total else 0.0
    return Acceptance(top1, total, {k: replay(matches, k) for k in ks})


def replay(matches: list[np.ndarray], k: int) -> dict:
    """Greedy speculative decoding replayed over per-position matches (draft argmax == target token) of the target's
    continuations: each step drafts up to k tokens (leaving room for the target's own), keeps the matching run and
    emits one target token more. alpha[i]: the share of steps that reached draft position i and had it accepted."""
    drafted = accepted = steps = emitted = 0
    tried, kept_at = np.zeros(k), np.zeros(k)
    for m in matches:
        pos = 0
        while pos < len(m):
            d = min(k, len(m) - pos - 1)
            n = 0
            while n < d and m[pos + n]:
                n += 1
            tried[: min(d, n + 1)] += 1
            kept_at[:n] += 1
            drafted, accepted, steps, emitted = drafted + d, accepted + n, steps + 1, emitted + n + 1
            pos += n + 1
    return {"acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_step": round(emitted / steps, 3) if steps else 0.0,
            "alpha": [round(float(a), 4) for a in kept_at / np.maximum(tried, 1)]}


def train(draft, samples: list[Sample], *, deadline: float, max_steps: int | None = None, lr: float = 5e-4,
          loss: str = "kl", kept: np.ndarray | None = None, tokens_per_batch: int = 1024, seed: int = 0,
          train_prompt_positions: bool = True, on_step: Callable[[int, float, float], None] = lambda *a: None,
          ) -> dict:
    """Train the draft's decoder layers and final norm (embeddings and head frozen) until ``deadline`` or
    ``max_steps``. Learning rate: short warm-up, then cosine decay over the budget (steps or time)."""
    import torch
    if loss not in ("kl", "tokens"):
        raise DistillError(f"loss must be 'kl' or 'tokens', received {loss!r}")
    for p in draft.parameters():
        p.requires_grad_(False)
    base = getattr(draft, draft.base_model_prefix)
    trainable = [p for name, p in base.named_parameters() if "embed" not in name]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    vocab = draft.get_output_embeddings().weight.shape[0]
    remap = None
    if kept is not None:
        remap = torch.full((max(vocab, int(kept.max()) + 1),), -1, dtype=torch.long)
        remap[torch.as_tensor(kept)] = torch.arange(len(kept))
    started = time.perf_counter()
    budget = max(deadline - started, 1e-9)
    step, losses = 0, []
    draft.train()
    while True:
        for batch in _batches(samples, tokens_per_batch, shuffle=rng):
            progress = step / max_steps if max_steps else (time.perf_counter() - started) / budget
            if progress >= 1.0:
                draft.eval()
                return {"steps": step, "seconds": round(time.perf_counter() - started, 1),
                        "final_loss": round(float(np.mean(losses[-20:])), 4) if losses else None}
            rate = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
            for group in optimizer.param_groups:
                group["lr"] = rate
            value = _loss(draft, batch, loss, kept, remap, train_prompt_positions)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            losses.append(float(value.detach()))
            step += 1
            on_step(step, losses[-1], rate)


def _loss(draft, batch: list[Sample], loss: str, kept, remap, prompt_positions: bool):
    import torch
    ids, mask = _pad([s.ids for s in batch])
    hidden = _hidden(draft, ids, mask)
    rows, targets_ids, targets_probs = [], [], []
    for r, s in enumerate(batch):
        n = len(s.ids) - 1
        first = 0 if (prompt_positions and loss == "kl") else len(s.prompt) - 1
        rows.append(hidden[r, first:n])
        if loss == "kl":
            targets_ids.append(torch.from_numpy(s.top_ids[first:n]))
            targets_probs.append(torch.from_numpy(s.top_probs[first:n]))
        else:
            targets_ids.append(torch.tensor(s.ids[first + 1: n + 1])[:, None])
            targets_probs.append(torch.ones(n - first, 1))
    h = torch.cat(rows)
    t_ids, t_probs = torch.cat(targets_ids), torch.cat(targets_probs)
    if remap is not None:
        t_ids = remap[t_ids.clamp(max=len(remap) - 1)]
        t_probs = torch.where(t_ids >= 0, t_probs, torch.zeros_like(t_probs))  # q is 0 there: drop, as the sampler does
        t_ids = t_ids.clamp(min=0)
    logits = h @ _head_weight(draft, kept).T
    log_q = torch.log_softmax(logits, dim=-1).gather(1, t_ids)
    weight = t_probs.sum(1).clamp(min=1e-6)
    # cross-entropy against the (sparse) target distribution: KL(p || q) up to p's entropy, a constant
    return -((t_probs * log_q).sum(1) / weight).mean()


# --- saving ---------------------------------------------------------------------------------------------------------

def save_draft(draft, tokenizer, out: Path, kept: np.ndarray | None, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    draft.hf_quantizer = None
    if hasattr(draft.config, "quantization_config"):
        del draft.config.quantization_config
    for p in draft.parameters():
        p.requires_grad_(False)
    draft.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    vocab_file = out / VOCAB_FILE
    if kept is not None:
        vocab_file.write_text(json.dumps({"kept_ids": [int(t) for t in kept],
                                          "full_vocab_size": int(draft.config.vocab_size)}), encoding="utf-8")
    elif vocab_file.exists():
        vocab_file.unlink()
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2), encoding="utf-8")


def read_draft_vocab(folder: str | Path) -> np.ndarray | None:
    """The kept ids of a reduced-vocabulary draft folder, or None for a full head."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    kept = np.asarray(data["kept_ids"], np.int64)
    if kept.ndim != 1 or len(kept) == 0 or len(np.unique(kept)) != len(kept) or kept.min() < 0:
        raise DistillError(f"{path}: kept_ids must be a non-empty list of distinct non-negative token ids")
    return kept  # in file order: column j of the reduced head is token kept[j] (the runtime reads the same file)


def reduce_head(model, kept: np.ndarray):
    """Replace the output head by one over the kept ids only (untied from the embeddings, which stay full).
    The model then returns logits [B, S, len(kept)], column j for token kept[j]."""
    import torch
    head = model.get_output_embeddings()
    if int(kept.max()) >= head.weight.shape[0]:
        raise DistillError(f"draft_vocab keeps id {int(kept.max())} but the head has {head.weight.shape[0]} rows")
    small = torch.nn.Linear(head.weight.shape[1], len(kept), bias=getattr(head, "bias", None) is not None)
    with torch.no_grad():
        small.weight.copy_(head.weight[torch.as_tensor(kept)])
        if small.bias is not None:
            small.bias.copy_(head.bias[torch.as_tensor(kept)])
    model.set_output_embeddings(small)
    if hasattr(model, "_tied_weights_keys"):
        model._tied_weights_keys = None  # the embeddings keep every row: no tying from here on
    return model


# --- the pipeline ---------------------------------------------------------------------------------------------------

def distill_draft(target: str, init: str, out: str | Path, *, prompts: str | Path | None = None, minutes: float = 15.0,
            max_new_tokens: int = 64, seed: int = 0, threads: int = 0, draft_vocab: int = 0, loss: str = "kl",
            temperature: float = 0.0, heldout: float = 0.1, top_k: int = 32, lr: float = 5e-4,
            batch_prompts: int = 16, tokens_per_batch: int = 1024, max_steps: int | None = None,
            max_prompt_tokens: int = 256, chat: bool | None = None, generate_share: float = 0.4,
            samples_per_prompt: int = 1, sample_temperature: float = 1.0,
            train_prompt_positions: bool = True, force: bool = False, console=None, quiet: bool = False) -> dict:
    """Distil a draft for ``target`` into the Hugging Face folder ``out``; returns the report (also written to
    ``out/distill_report.json``).

    ``minutes`` is the whole budget: after loading the target, generation may use ``generate_share`` of what is left
    (at least one batch), training the rest less a reserve for the final measurement. ``max_steps`` (tests) bounds
    training by steps instead of time.

    ``samples_per_prompt`` > 1 adds continuations sampled at ``sample_temperature`` after the first pass (while the
    generation share lasts): a small corpus then yields more distinct target text, so the draft overfits less (one
    greedy continuation per prompt of the 208 shipped ones gave 0.98 top-1 on training prompts, 0.28 held out).
    """
    import torch
    from rich.console import Console

    from builder import checkpoint as ckpt
    started = time.perf_counter()
    deadline = started + minutes * 60
    out = Path(out).absolute()
    _check_out(out, force)
    if draft_vocab < 0:
        raise DistillError(f"--draft-vocab must be >= 0, received {draft_vocab}")
    if samples_per_prompt < 1 or sample_temperature <= 0:
        raise DistillError(f"--samples-per-prompt must be >= 1 and --sample-temperature > 0, received "
                           f"{samples_per_prompt} and {sample_temperature}")
    if not 0 < generate_share < 1:
        raise DistillError(f"--generate-share must be in (0, 1), received {generate_share}")
    console = console or Console(stderr=True, quiet=quiet)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    say = console.print
    corpus = load_prompts(prompts)
    train_prompts, held_prompts = split_prompts(corpus, heldout, seed)
    say(f"distill: {len(corpus)} prompts ({len(train_prompts)} train, {len(held_prompts)} held out) from "
        f"{prompts or 'the shipped corpus'}")
    checkpoint = ckpt.resolve(target)
    check_init(init, checkpoint.config.num_hidden_layers)
    tokenizer = checkpoint.load_tokenizer()
    target_model = checkpoint.load_model()
    timings = {"load": round(time.perf_counter() - started, 1)}
    eos = eos_ids_of(target_model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    train_ids = [encode(tokenizer, p, chat, max_prompt_tokens) for p in train_prompts]
    held_ids = [encode(tokenizer, p, chat, max_prompt_tokens) for p in held_prompts]

    with _progress(console, quiet) as progress:
        t0 = time.perf_counter()
        task = progress.add_task("target: held-out continuations", total=len(held_ids))
        held = generate(target_model, held_ids, max_new_tokens, temperature=0.0, seed=seed, eos_ids=eos, pad_id=pad,
                        batch_size=batch_prompts, advance=lambda n: progress.advance(task, n))
        gen_deadline = time.perf_counter() + generate_share * max(0.0, deadline - time.perf_counter())
        task = progress.add_task("target: training continuations", total=len(train_ids))
        samples = generate(target_model, train_ids, max_new_tokens, temperature=temperature, seed=seed, eos_ids=eos,
                           pad_id=pad, batch_size=batch_prompts, deadline=gen_deadline,
                           advance=lambda n: progress.advance(task, n))
        for extra in range(1, samples_per_prompt):
            if time.perf_counter() > gen_deadline:
                break
            task = progress.add_task(f"target: sampled continuations {extra + 1}", total=len(train_ids))
            samples += generate(target_model, train_ids, max_new_tokens, temperature=sample_temperature,
                                seed=seed + extra, eos_ids=eos, pad_id=pad, batch_size=batch_prompts,
                                deadline=gen_deadline, advance=lambda n, t=task: progress.advance(t, n))
        if not samples:
            raise DistillError("the budget ran out before any training continuation was generated; raise --minutes")
        timings["generate"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        task = progress.add_task("target: teacher distributions", total=len(samples))
        teacher(target_model, samples, top_k, tokens_per_batch, advance=lambda n: progress.advance(task, n))
        timings["teacher"] = round(time.perf_counter() - t0, 1)

        draft = init_draft(target_model, init)
        del target_model
        kept = None
        if draft_vocab:
            vocab = min(len(tokenizer), draft.get_output_embeddings().weight.shape[0])
            if draft_vocab >= vocab:
                raise DistillError(f"--draft-vocab {draft_vocab} is not smaller than the vocabulary ({vocab})")
            kept = kept_vocabulary(samples, draft_vocab, vocab, eos)
        t0 = time.perf_counter()
        before = acceptance(draft, held, kept)
        measure = time.perf_counter() - t0
        say(f"before: held-out top-1 agreement {before.top1:.3f}, greedy acceptance "
            + ", ".join(f"k={k} {before.greedy[k]['acceptance']:.3f}" for k in (2, 4)))
        train_deadline = deadline - 1.5 * measure - 5
        if max_steps is None and train_deadline <= time.perf_counter():
            raise DistillError(f"no time left to train within --minutes {minutes}; raise it")
        total = max_steps or max(1, int(train_deadline - time.perf_counter()))
        task = progress.add_task("draft: training", total=total)
        t0 = time.perf_counter()

        last_line = [time.perf_counter()]

        def on_step(step, value, rate):
            done = step if max_steps else min(total, time.perf_counter() - t0)
            progress.update(task, completed=done, description=f"draft: training (loss {value:.3f})")
            if not console.is_terminal and time.perf_counter() - last_line[0] > 60:  # logs: a line a minute
                last_line[0] = time.perf_counter()
                say(f"training: step {step}, loss {value:.4f}, lr {rate:.2e}, {time.perf_counter() - t0:.0f} s")

        trained = train(draft, samples, deadline=train_deadline, max_steps=max_steps, lr=lr, loss=loss, kept=kept,
                        tokens_per_batch=tokens_per_batch, seed=seed, train_prompt_positions=train_prompt_positions,
                        on_step=on_step)
        progress.update(task, completed=total)
    timings["train"] = trained["seconds"]
    after = acceptance(draft, held, kept)
    train_fit = acceptance(draft, samples[: len(held)], kept, ks=(4,))
    say(f"after:  held-out top-1 agreement {after.top1:.3f}, greedy acceptance "
        + ", ".join(f"k={k} {after.greedy[k]['acceptance']:.3f}" for k in (2, 4))
        + f" (training prompts: top-1 {train_fit.top1:.3f})")
    timings["total"] = round(time.perf_counter() - started, 1)
    report = {
        "target": target, "init": init, "loss": loss, "seed": seed, "minutes": minutes,
        "prompts": str(prompts) if prompts else "builtin:distill_prompts.txt",
        "train_prompts": len(samples), "heldout_prompts": len(held),
        "train_tokens": sum(len(s.continuation) for s in samples),
        "train_positions": sum(len(s.ids) - 1 for s in samples),
        "heldout_tokens": sum(len(s.continuation) for s in held),
        "max_new_tokens": max_new_tokens, "generation_temperature": temperature, "top_k": top_k,
        "samples_per_prompt": samples_per_prompt, "sample_temperature": sample_temperature,
        "generate_share": generate_share,
        "draft_layers": draft.config.num_hidden_layers,
        "draft_vocab": int(len(kept)) if kept is not None else 0,
        "draft_vocab_coverage_heldout": round(coverage(held, kept), 4),
        "before": before.to_dict(), "after": after.to_dict(), "train_top1_after": round(train_fit.top1, 4),
        "training": trained, "seconds": timings,
    }
    _publish_draft(draft, tokenizer, out, kept, report, force)
    say(f"saved the draft to {out} ({timings['total']:.0f} s in all); build with: "
        f"build-engines --target {target} --draft {out}")
    return report


def draft_problem(folder: Path) -> str | None:
    """Why --force may not replace ``folder`` (None: a Hugging Face model folder, i.e. a draft)."""
    config = folder / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8")) if config.is_file() and not config.is_symlink() else None
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not isinstance(data, dict) or not ({"model_type", "architectures"} & set(data)):
        return "it holds no model config.json"
    return None


def _check_out(out: Path, force: bool) -> None:
    from builder.build import BuildError, check_output
    try:
        check_output(out, force, draft_problem, "draft folder")
    except BuildError as err:
        raise DistillError(str(err)) from None


def _publish_draft(draft, tokenizer, out: Path, kept, report: dict, force: bool) -> None:
    """Write the draft into a hidden folder beside ``out`` and swap it in whole (the builder's staging and publish):
    an interrupted save leaves the previous draft, never a half-written one next to a finished-looking report."""
    from builder.build import BuildError, publish, staging
    try:
        with staging(out, force, draft_problem, "draft folder") as tmp:
            save_draft(draft, tokenizer, tmp, kept, report)
            publish(tmp, out)
    except BuildError as err:
        raise DistillError(str(err)) from None


def _progress(console, quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=quiet, transient=False)


# --- the command ----------------------------------------------------------------------------------------------------

RECIPE_KEYS = ("init", "prompts", "minutes", "max_new_tokens", "temperature", "loss", "draft_vocab",
               "samples_per_prompt", "sample_temperature", "generate_share", "heldout", "lr", "seed")


def recipe_from(config: dict, path) -> tuple[str, str, dict]:
    """(target, out, options) of a preset's ``distill:`` recipe: the draft folder is the preset's ``draft``."""
    recipe = config.get("distill")
    if not isinstance(recipe, dict):
        raise DistillError(f"{path} has no 'distill:' recipe (a mapping of draftsmith distill options)")
    unknown = sorted(set(recipe) - set(RECIPE_KEYS))
    if unknown:
        raise DistillError(f"{path}: unknown distill option(s) {unknown}; known: {list(RECIPE_KEYS)}")
    if not config.get("target") or not config.get("draft"):
        raise DistillError(f"{path} must name the target and, as 'draft', the folder the recipe distils into")
    return str(config["target"]), str(config["draft"]), dict(recipe)


def is_distilled(folder: Path) -> bool:
    """A finished distillation: save_draft writes the report after the weights."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", REPORT_FILE))


@click.command("distill")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A preset with a 'distill:' recipe: distil its target into its 'draft' folder with the recipe's "
                   "options (flags given here override them); a folder already distilled is kept unless --force.")
@click.option("--target", help="Target checkpoint: HF folder, .gguf file or pkg:<package>/<file>.")
@click.option("--init", "init", default="layers=4", show_default=True,
              help="layers=N (the target's first N layers, embeddings and head) or a draft checkpoint to start from.")
@click.option("--out", type=click.Path(), help="Folder for the draft (HF format, safetensors).")
@click.option("--prompts", type=click.Path(), default=None,
              help="Prompt file ('---'-separated blocks or one per line; '@completion' first line: raw text). "
                   "Default: the shipped corpus.")
@click.option("--minutes", type=float, default=15.0, show_default=True, help="Whole budget: generation + training.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True, help="Target tokens per prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="Target sampling temperature for the training continuations (0: greedy).")
@click.option("--loss", type=click.Choice(["kl", "tokens"]), default="kl", show_default=True,
              help="kl: KL(target || draft) on the target's top-k probabilities; tokens: cross-entropy on its tokens.")
@click.option("--draft-vocab", type=int, default=0, show_default=True,
              help="Keep only the N most frequent target tokens in the draft's head (0: full head).")
@click.option("--samples-per-prompt", type=int, default=1, show_default=True,
              help="Continuations per training prompt: the first at --temperature, the others sampled at "
                   "--sample-temperature while the generation share lasts (more distinct text, less overfitting).")
@click.option("--sample-temperature", type=float, default=1.0, show_default=True,
              help="Temperature of the extra continuations.")
@click.option("--generate-share", type=float, default=0.4, show_default=True,
              help="Share of the budget (after loading) for generating continuations; training gets the rest.")
@click.option("--heldout", type=float, default=0.1, show_default=True, help="Share of prompts held out.")
@click.option("--lr", type=float, default=5e-4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=0, show_default=True, help="torch threads (0: torch's default).")
@click.option("--force", is_flag=True, help="Replace the draft folder at --out (only a model folder, or an empty one).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def distill(ctx, config_path, target, init, out, prompts, minutes, max_new_tokens, temperature, loss, draft_vocab,
            samples_per_prompt, sample_temperature, generate_share, heldout, lr, seed, threads, force, as_json):
    """Train a draft to imitate TARGET on its own outputs; print acceptance before and after on held-out prompts."""
    from builder.checkpoint import CheckpointError
    options = dict(init=init, prompts=prompts, minutes=minutes, max_new_tokens=max_new_tokens, temperature=temperature,
                   loss=loss, draft_vocab=draft_vocab, samples_per_prompt=samples_per_prompt,
                   sample_temperature=sample_temperature, generate_share=generate_share, heldout=heldout, lr=lr,
                   seed=seed)
    if config_path is not None:
        from builder.cli import load_config
        try:
            recipe_target, recipe_out, recipe = recipe_from(load_config(config_path), config_path)
        except DistillError as err:
            raise click.ClickException(str(err)) from None
        given = {name for name in ctx.params
                 if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
        options.update({k: v for k, v in recipe.items() if k not in given})  # flags override the recipe
        target, out = target or recipe_target, out or recipe_out
        if is_distilled(Path(out)) and not force:
            click.echo(f"{out} already holds a distilled draft ({REPORT_FILE}); keeping it (--force redoes it)",
                       err=True)
            return
    if not target or not out:
        raise click.UsageError("give --target and --out, or --config PRESET with a 'distill:' recipe")
    try:
        report = distill_draft(target, options.pop("init"), out, threads=threads, force=force, **options)
    except (DistillError, CheckpointError) as err:
        raise click.ClickException(str(err)) from None
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    b, a = report["before"], report["after"]
    click.echo(f"held-out top-1 agreement: {b['top1_agreement']:.3f} -> {a['top1_agreement']:.3f} "
               f"({report['heldout_prompts']} prompts, {report['heldout_tokens']} target tokens)")
    for k in ("2", "3", "4"):
        click.echo(f"greedy acceptance k={k}: {b['greedy'][k]['acceptance']:.3f} -> {a['greedy'][k]['acceptance']:.3f}"
                   f"  (tokens/step {b['greedy'][k]['tokens_per_step']:.2f} -> {a['greedy'][k]['tokens_per_step']:.2f};"
                   f" per-position alpha {a['greedy'][k]['alpha']})")
    click.echo(f"time: {report['seconds']}")

