"""A feature-level draft (EAGLE-style): one decoder layer that drafts from the target's own final hidden states.

Longer than most modules: the model (its config, the torch module, its saved form) and its graph
(``export_feature_draft``, checked against the module) are kept together so the two stay in step, and so the build
reads one feature-draft module (a module of its own for the graph sent the build back to a module it had left once
more). Its training is builder/distill/training.py's (``train_feature_draft``, beside the other draft kinds'
``train``, sharing their rate and step).

At draft position i it reads [embedding(token_{i+1}), f_i], where f_i is the target's final hidden state after
token i (the vector its head reads, which every target call already computes and the fused graph returns as
``hidden``), and predicts f_{i+1}; the target's own head rows over the kept vocabulary turn that into next-token
logits. Further draft tokens chain on the draft's predicted features. A truncated-layer draft must rebuild the
target's representation from tokens; this one starts from it, which is why it is accepted more often for less work.

Training (``train_feature_draft``) teacher-forces the true features and also unrolls the draft on its own predicted
features (``unroll`` levels, EAGLE-3's training-time test): a level-s query at position i attends to the true pairs
up to i and to its own chain at i, exactly what it sees at run time after s-1 drafted tokens. Losses per level:
smooth-L1 on the feature plus cross-entropy against the target's distribution over the kept ids, softmax(H f_{i+s}),
computed from the stored features with the same head (no teacher rows needed).

Saved as ``feature_draft.safetensors`` + ``feature_draft.json`` (shapes, the kept ids, the target it was trained on)
in the draft folder; ``build-engines`` writes it as a fused graph with a ``features`` input (builder.graph) and the
runtime drives it with runtime.drafters.feature.FeatureDrafter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from builder.distill.corpus import DistillError

WEIGHTS_FILE = "feature_draft.safetensors"
CONFIG_FILE = "feature_draft.json"
WEIGHT_NAMES = ("fc", "attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down", "final_norm")


@dataclass(frozen=True)
class FeatureConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    max_positions: int
    target_sha256: str = ""  # the target whose features it was trained on (build-engines refuses another)

    @classmethod
    def of_target(cls, config, target_sha256: str = "", intermediate: int = 0) -> "FeatureConfig":
        """The draft layer's shapes for ``config`` (a transformers config). The layer is always a plain Llama-style
        one (RMSNorm, SiLU MLP, default rotary, full attention) whatever the target's family: it is the draft's own
        model, trained and run with the same tables, and only its sizes come from the target. ``intermediate``: the
        MLP's width (0: the target's; narrower costs less a draft call and trains faster, ``check_width``)."""
        check_target(config)
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=check_width(intermediate, config.intermediate_size) or config.intermediate_size,
            eps=float(config.rms_norm_eps),
            rope_theta=float(draft_rope_theta(config)),
            max_positions=int(config.max_position_embeddings),
            target_sha256=target_sha256,
        )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each weight's shape, in WEIGHT_NAMES order: the one table the torch module is made from and a saved
        draft's weights are checked against (``load_feature_weights``), so the two never disagree."""
        h, d, i = self.hidden, self.head_dim, self.intermediate
        return {
            "fc": (h, 2 * h),
            "attn_norm": (h,),
            "q": (self.heads * d, h),
            "k": (self.kv_heads * d, h),
            "v": (self.kv_heads * d, h),
            "o": (h, self.heads * d),
            "mlp_norm": (h,),
            "gate": (i, h),
            "up": (i, h),
            "down": (h, i),
            "final_norm": (h,),
        }


def check_width(intermediate: int, target_intermediate: int) -> int:
    """``intermediate`` if it is a width a draft layer may have: 0 (the target's) or 1 .. the target's own MLP width
    (a saved draft's config is data: it must not size a graph past the target's)."""
    if (
        isinstance(intermediate, bool)
        or not isinstance(intermediate, int)
        or not 0 <= intermediate <= target_intermediate
    ):
        raise DistillError(
            f"draft_intermediate must be in [0, {target_intermediate}] (0: the target's MLP width), "
            f"received {intermediate}"
        )
    return intermediate


def draft_rope_theta(config) -> float:
    """The base of the draft layer's rotary table. Its layer attends to the whole context, so where the target has
    one rotary setting per layer type (Gemma 3: ``rope_parameters`` {"sliding_attention": ..., "full_attention":
    ...}) it takes the full-attention layers' base; a target's rotary scaling (llama3, yarn, longrope) is not copied:
    the draft is trained at short lengths with the plain table, and runs with the same one."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    elif params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def check_target(config) -> None:
    """Refuse a target whose next-token logits are not its head times its final hidden state (what the draft is
    trained against and what it predicts): a capped or scaled output (Gemma 2's final_logit_softcapping, Cohere's
    logit_scale, Granite's logits_scaling)."""
    from builder.distill.draft import output_transform

    problem = output_transform(config)
    if problem:
        raise DistillError(
            f"a feature draft needs a target whose logits are its head times its final hidden state; "
            f"this one has {problem}. Use --init layers=N or an int4 self-draft (--draft self)"
        )


def _module():
    import torch

    class FeatureDraft(torch.nn.Module):
        """fc([emb, f]) -> one pre-norm decoder layer -> final norm = predicted feature; logits = head @ feature."""

        def __init__(self, cfg: FeatureConfig, embedding, head, layer: dict | None = None):
            super().__init__()
            h, d = cfg.hidden, cfg.head_dim
            self.cfg = cfg
            self.register_buffer("embedding", embedding.detach().float().clone(), persistent=False)
            self.register_buffer("head", head.detach().float().clone(), persistent=False)  # [K, H] kept rows
            generator = torch.Generator().manual_seed(0)
            for name, shape in cfg.weight_shapes().items():
                if layer and name in layer:
                    value = torch.as_tensor(np.asarray(layer[name]), dtype=torch.float32).clone()
                elif len(shape) == 1:
                    value = torch.ones(shape)
                else:
                    value = torch.randn(shape, generator=generator) * (0.5 / math.sqrt(shape[1]))
                self.register_parameter(name, torch.nn.Parameter(value))
            inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
            self.register_buffer("inv_freq", inv.float(), persistent=False)
            # input scales (folded into fc when saved): both halves of the fc's input at unit RMS while training
            self.register_buffer("input_scale", torch.ones(2 * h), persistent=False)
            self.matmul_dtype, self._head_low = torch.float32, None

        def set_matmul_dtype(self, dtype) -> None:
            """The type the layer's and the head's matrix products read their inputs in (they accumulate in fp32
            either way): float32, or bfloat16 while training on a CPU that multiplies it natively
            (``matmul_dtype``: a training step of the 1.5B's draft, 2,048 tokens, took 4.4 s against 6.8 in
            float32 on 2 loaded AVX-512 BF16 cores); the weights, their gradients and AdamW's state stay float32,
            and so does what is measured and saved."""
            self.matmul_dtype = dtype
            if dtype != torch.float32 and (self._head_low is None or self._head_low.dtype != dtype):
                self._head_low = self.head.to(dtype)  # the head is frozen: cast once, not every step

        def _mm(self, x, weight):
            if self.matmul_dtype == torch.float32:
                return x @ weight.T
            return (x.to(self.matmul_dtype) @ weight.to(self.matmul_dtype).T).float()

        def head_logits(self, features):
            """``features`` [..., H] times the kept head rows: next-token logits over the kept ids."""
            if self.matmul_dtype == torch.float32:
                return features @ self.head.T
            return (features.to(self.matmul_dtype) @ self._head_low.T).float()

        def _norm(self, x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.eps) * weight

        def _rotate(self, x, positions):
            angles = positions[..., None].float() * self.inv_freq  # [B, S, D/2]
            cos, sin = angles.cos()[:, None], angles.sin()[:, None]
            half = x.shape[-1] // 2
            a, b = x[..., :half], x[..., half:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

        def level(self, tokens, features, positions, past: list, mask):
            """One level of the unrolled draft. tokens/positions [B, S], features [B, S, H]; ``past``: the (k, v) of
            earlier levels, [B, Hkv, S, D] each; level 0 attends causally to itself under ``mask`` [B, S] (padding 0),
            a later level to level 0 causally and to each later level (and itself) on the diagonal only.
            Returns (predicted features [B, S, H], logits [B, S, K], (k, v))."""
            cfg = self.cfg
            b, s, _ = features.shape
            mm = self._mm
            x = mm(torch.cat([self.embedding[tokens], features], dim=-1) * self.input_scale, self.fc)
            normed = self._norm(x, self.attn_norm)
            q = mm(normed, self.q).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = mm(normed, self.k).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = mm(normed, self.v).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = self._rotate(q, positions), self._rotate(k, positions)
            attn = _attention(cfg, q, k, v, past, mask)
            x = x + mm(attn, self.o)
            normed = self._norm(x, self.mlp_norm)
            x = x + mm(torch.nn.functional.silu(mm(normed, self.gate)) * mm(normed, self.up), self.down)
            predicted = self._norm(x, self.final_norm)
            return predicted, self.head_logits(predicted), (k, v)

    return FeatureDraft


def _attention(cfg: FeatureConfig, q, k, v, past: list, mask):
    """A level's attention output [B, S, heads * D]: to level 0's keys causally (under ``mask``) and to each later
    level's own key on the diagonal (see ``FeatureDraft.level``); q [B, heads, S, D], k and v [B, Hkv, S, D]."""
    import torch

    b, _, s, _ = q.shape
    group = cfg.heads // cfg.kv_heads
    q = q.view(b, cfg.kv_heads, group, s, cfg.head_dim)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    base_k, base_v = (k, v) if not past else past[0]
    scores = torch.einsum("bhgsd,bhtd->bhgst", q, base_k) * scale
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None] & mask[:, None, :].bool()
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    diagonal = [(pk, pv) for pk, pv in past[1:]] + ([(k, v)] if past else [])
    diag_scores = [torch.einsum("bhgsd,bhsd->bhgs", q, dk)[..., None] * scale for dk, _ in diagonal]
    weights = torch.softmax(torch.cat([scores] + diag_scores, dim=-1), dim=-1)
    out = torch.einsum("bhgst,bhtd->bhgsd", weights[..., :s], base_v)
    for j, (_, dv) in enumerate(diagonal):
        out = out + weights[..., s + j : s + j + 1] * dv[:, :, None]
    return out.reshape(b, cfg.heads, s, cfg.head_dim).transpose(1, 2).reshape(b, s, -1)


def init_feature_draft(target_model, kept: np.ndarray | None, target_sha256: str = "", intermediate: int = 0):
    """A fresh feature draft for ``target_model``: a randomly initialised layer (measured: 0.37 held-out top-1
    after 150 s against 0.28 from a copy of the target's last layer), the final norm from the target's, the
    embeddings and head rows (kept ids) the target's, frozen. Both fc inputs are scaled to unit RMS: the features
    divided by the target's final-norm weight, the embeddings by their RMS (they are ~10x smaller).
    ``target_model`` needs only the embedding, final norm and head: a GGUF target's first layers
    (builder.gguf.stream.Streamed.reference) serve. ``intermediate``: the layer's MLP width (0: the target's)."""
    import torch

    cfg = FeatureConfig.of_target(target_model.config, target_sha256, intermediate)
    embedding = target_model.get_input_embeddings().weight.detach().float()  # no copy of an fp32 weight
    head = target_model.get_output_embeddings().weight.detach().float()  # the embedding itself where tied
    if kept is not None:
        head = head[torch.as_tensor(kept)]
    if getattr(target_model.get_output_embeddings(), "bias", None) is not None:
        raise DistillError(
            "a feature draft needs a target whose output head has no bias (the draft's logits are "
            "its head rows times its predicted feature); use --init layers=N"
        )
    gamma = effective_norm_weight(target_model.model.norm, cfg.hidden, cfg.eps)
    h = cfg.hidden
    fc = torch.cat(
        [torch.randn(h, h, generator=torch.Generator().manual_seed(1)) * (0.5 / math.sqrt(h)), torch.eye(h)], dim=1
    )  # the layer starts from the feature itself, plus a little of the token
    draft = _module()(cfg, embedding, head, {"final_norm": gamma.numpy(), "fc": fc.numpy()})
    scale = torch.cat(
        [torch.full((cfg.hidden,), float(embedding.pow(2).mean().rsqrt())), 1.0 / gamma.abs().clamp(min=1e-3)]
    )
    draft.input_scale.copy_(scale)
    return draft


def effective_norm_weight(norm, hidden: int, eps: float):
    """The per-channel scale an RMSNorm module applies, whatever its convention (Llama: x * w; Gemma: x * (1 + w)):
    its output for an input of all ones (RMS 1) times sqrt(1 + eps)."""
    import torch

    with torch.no_grad():
        out = norm(torch.ones(1, 1, hidden, dtype=torch.float32))
    return (out.reshape(hidden).double() * math.sqrt(1.0 + eps)).float()


# --- saving and the graph -------------------------------------------------------------------------------------------


def saved_weights(draft) -> dict[str, np.ndarray]:
    """The weights as saved: the input scales folded into fc (a loaded draft has unit scales)."""
    weights = {name: getattr(draft, name).detach().numpy().astype(np.float32) for name in WEIGHT_NAMES}
    weights["fc"] = weights["fc"] * draft.input_scale.numpy()[None, :]
    return weights


def save_feature_draft(draft, folder: Path) -> None:
    from safetensors.numpy import save_file

    save_file(saved_weights(draft), str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"kind": "feature", **asdict(draft.cfg)}, indent=2), encoding="utf-8")


def is_feature_draft(folder: Path) -> bool:
    return (Path(folder) / CONFIG_FILE).is_file()


def load_feature_weights(folder: Path) -> tuple[FeatureConfig, dict[str, np.ndarray]]:
    """The config and weights of a saved feature draft, checked for every name and shape (safetensors: no code)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    try:
        data = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.pop("kind", None) != "feature":
            raise ValueError(f'{CONFIG_FILE} must be an object with "kind": "feature"')
        cfg = FeatureConfig(**data)
        weights = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError, TypeError) as err:
        raise DistillError(f"{folder}: not a readable feature draft ({err}); distill it again") from None
    for name, shape in cfg.weight_shapes().items():
        if name not in weights or tuple(weights[name].shape) != shape:
            raise DistillError(
                f"{folder / WEIGHTS_FILE}: {name} must be {shape}, found "
                f"{None if name not in weights else tuple(weights[name].shape)}"
            )
    return cfg, weights


def feature_decoder(cfg: FeatureConfig, weights: dict[str, np.ndarray], embedding: np.ndarray, head: np.ndarray):
    """The draft as a builder.graph Decoder (one layer, a ``features`` input, head rows ``head`` [K, H])."""
    from builder.decoder import Decoder, Layer, Linear

    w = weights
    layer = Layer(
        attn_norm=w["attn_norm"],
        qkv=Linear(np.concatenate([w["q"], w["k"], w["v"]]).T),
        o=Linear(w["o"].T),
        mlp_norm=w["mlp_norm"],
        gate_up=Linear(np.concatenate([w["gate"], w["up"]]).T),
        down=Linear(w["down"].T),
    )
    return Decoder(
        hidden=cfg.hidden,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate,
        vocab=int(head.shape[0]),
        eps=cfg.eps,
        rope_theta=cfg.rope_theta,
        max_positions=cfg.max_positions,
        embedding=np.asarray(embedding, np.float32),
        layers=[layer],
        final_norm=w["final_norm"],
        head=Linear(np.ascontiguousarray(np.asarray(head, np.float32).T)),
        feature_fc=np.ascontiguousarray(w["fc"].T),
    )


def shell_config(cfg: FeatureConfig, target_config):
    """A one-layer Llama config of the draft's shapes, with the target's vocabulary, special token ids and context:
    a Llama layer is what the draft's layer is (feature_decoder), whatever the target's family."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=1,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.eps,
        max_position_embeddings=cfg.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        **{key: getattr(target_config, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )


def as_transformers(draft, target_config):
    """The draft's layer, final norm and the target's embeddings as a one-layer Llama model (``shell_config``): the
    folder is then an ordinary checkpoint for pairing, hashing and the builder's loaders; the fc and kind live beside
    it."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    torch.manual_seed(0)
    with no_init_weights():  # every weight is replaced below: a random 151,936-row table would cost a copy more
        shell = LlamaForCausalLM(shell_config(draft.cfg, target_config))
    names = {
        "model.layers.0.input_layernorm.weight": "attn_norm",
        "model.layers.0.post_attention_layernorm.weight": "mlp_norm",
        "model.norm.weight": "final_norm",
        **{f"model.layers.0.self_attn.{x}_proj.weight": x for x in "qkvo"},
        **{f"model.layers.0.mlp.{x}_proj.weight": x for x in ("gate", "up", "down")},
    }
    state = {key: getattr(draft, name).detach().clone() for key, name in names.items()}
    state["model.embed_tokens.weight"] = draft.embedding  # the draft's own table (frozen), not a copy
    missing, _ = shell.load_state_dict(state, strict=False, assign=True)
    shell.tie_weights()  # the head is the (assigned) embedding, as the config says
    missing = [m for m in missing if m != "lm_head.weight" and not m.endswith("rotary_emb.inv_freq")]
    if missing:
        raise DistillError(f"the feature draft's Llama shell has weights the draft lacks: {missing[:4]}")
    return shell


def module_from(cfg: FeatureConfig, weights: dict[str, np.ndarray], embedding: np.ndarray, head: np.ndarray):
    import torch

    return _module()(
        cfg,
        torch.from_numpy(np.asarray(embedding, np.float32)),
        torch.from_numpy(np.asarray(head, np.float32)),
        weights,
    )


def check_against_trained(path: Path, info, module, tolerance: float, seed: int = 0) -> dict:
    """The draft graph (through the runtime's FusedEngine) against the torch module it was trained as: five true
    pairs in one call, then two chained one-pair calls on the graph's own predicted features. Max |logit diff| per
    case; raises builder.export.ExportError past ``tolerance``."""
    import torch
    from builder.export import compare_cases
    from runtime.engines.onnx import new_engine

    engine = new_engine("fused", path, info, 32, initial_slots=8)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, module.embedding.shape[0], (1, 7))
    feats = rng.standard_normal((1, 5, module.cfg.hidden)).astype(np.float32)
    cache = engine.new_cache(1)
    first = engine.forward(cache, tokens[:, :5], features=feats)
    chain, chain_ref, past = [], [], []
    with torch.no_grad():
        mask = torch.ones(1, 5, dtype=torch.long)
        positions = torch.arange(5)[None]
        pred, ref, kv = module.level(torch.from_numpy(tokens[:, :5]), torch.from_numpy(feats), positions, [], mask)
        own, own_ref = cache.extra["hidden"][:, -1:], pred[:, -1:]
        past.append(kv)
        for step in range(2):  # chained: the last position's predicted feature with the next token
            chain.append(engine.forward(cache, tokens[:, 5 + step : 6 + step], features=own)[0, 0])
            own = cache.extra["hidden"]
            # the torch chain: a level over every index, read at the last one (its own diagonal chain)
            level_tokens = torch.from_numpy(tokens[:, 1 + step : 6 + step])  # index 4 holds token 5 + step
            ins = torch.nn.functional.pad(own_ref, (0, 0, 4, 0))
            p, lg, kv = module.level(level_tokens, ins, positions + step + 1, past, mask)
            past.append(kv)
            chain_ref.append(lg[0, -1].numpy())
            own_ref = p[:, -1:]
    cases = {
        "pairs": (first[0], ref[0].numpy()),
        "chain_1": (chain[0][None], chain_ref[0][None]),
        "chain_2": (chain[1][None], chain_ref[1][None]),
    }
    return compare_cases(cases, tolerance, info.vocab_size)


def export_feature_draft(target_model, target_ckpt, draft_ckpt, kept, path: Path, engine_graph: str):
    """The build's draft engine of a feature draft (``draftsmith distill --init feature``): a fused graph over the
    target's embeddings and head rows (``target_model``: builder.model_surgery.Model), with a ``features`` input,
    checked against the torch module it was trained as: (GraphInfo, check report, its float Decoder: what the
    engine on Draftsmith's kernel is re-quantized from, builder.gguf.float_draft.on_kernel). Refused (BuildError)
    where the draft was trained for another target or its shapes are not the target's."""
    from builder import graph
    from builder.errors import BuildError

    if engine_graph != "fused":
        raise BuildError(f"{draft_ckpt.source} is a feature draft: it runs only as the fused graph (--graph fused)")
    try:
        cfg, weights = load_feature_weights(draft_ckpt.folder)
        # refuses a target a feature draft cannot follow, and an MLP wider than the target's
        own = FeatureConfig.of_target(target_ckpt.config, intermediate=cfg.intermediate)
    except DistillError as err:
        raise BuildError(f"{draft_ckpt.source}: {err}") from None
    if cfg.target_sha256 and cfg.target_sha256 != target_ckpt.sha256():
        raise BuildError(
            f"{draft_ckpt.source} was trained on the hidden states of another target "
            f"(sha256 {cfg.target_sha256[:12]}...); distill it again for {target_ckpt.source}"
        )
    # every shape and setting must be the target's (the file is data: its numbers size the graph we write)
    expected = dataclasses.replace(own, target_sha256=cfg.target_sha256)
    if cfg != expected:
        wrong = {k: v for k, v in dataclasses.asdict(cfg).items() if dataclasses.asdict(expected)[k] != v}
        raise BuildError(f"{draft_ckpt.source}: feature_draft.json does not match the target's config: {wrong}")
    embedding, head = target_model.embedding_and_head()
    head = head[kept] if kept is not None else head
    decoder = feature_decoder(cfg, weights, embedding, head)
    graph.build(decoder, path)
    info = graph.info_of(decoder)
    module = module_from(cfg, weights, embedding, head)
    return info, check_against_trained(path, info, module, target_ckpt.architecture.tolerance), decoder
