"""Text side of generation: tokenizer loading, incremental detokenization and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

from runtime.text.chat_template import render_chat_template
from runtime.text.stop_matcher import ROOT, stop_automaton
from runtime.text.tokenizer_growth import growth_refusal


class UnsafeTokenizer(ValueError):
    """A tokenizer.json whose normalizer, pre-tokenizer or decoder can grow a text without bound."""


class Tokenizer:
    """The bundle's tokenizer (tokenizers' fast tokenizer.json) plus its chat template."""

    def __init__(self, folder: Path, name: str | None = None):
        """``name``: what to call the tokenizer.json in errors (default: its path). A file whose steps can grow a
        text past runtime/text/tokenizer_growth.py's limits is refused (UnsafeTokenizer) before anything is
        encoded: every prompt goes through it (a cross-tokenizer draft's, on the scheduler thread)."""
        from tokenizers import Tokenizer as Fast

        path = folder / "tokenizer.json"
        text = path.read_text(encoding="utf-8")
        refusal = growth_refusal(text)
        if refusal:
            raise UnsafeTokenizer(f"{name or path}: {refusal}")
        self.fast = Fast.from_str(text)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        self.chat_template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if not self.chat_template and template_file.is_file():
            self.chat_template = template_file.read_text(encoding="utf-8")
        self.special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        self.vocab_size = self.fast.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.fast.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.fast.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes: one may end inside a UTF-8 character, which ``decode`` shows as U+FFFD (OpenAI's
        logprobs carry them as ``bytes`` for that reason). llguidance reads them from the vocabulary, once;
        BytesUnavailable where it cannot (``bytes_problem`` says so without raising)."""
        reader = self._byte_reader()
        if isinstance(reader, str):
            raise BytesUnavailable(reader)
        return reader.decode_bytes([int(token)])

    def bytes_problem(self) -> str:
        """Why this tokenizer's token bytes cannot be read ("" when they can), found once: a server says it at start
        and refuses per request what needs them, rather than failing mid-response."""
        reader = self._byte_reader()
        return reader if isinstance(reader, str) else ""

    def _byte_reader(self):
        """llguidance's reader of the token bytes, or why there is none (a string), made once."""
        if getattr(self, "_raw", None) is None:
            try:
                self._raw = read_bytes(self.fast.to_str())
            except BytesUnavailable as err:
                self._raw = str(err)
        return self._raw

    def apply_chat_template(self, prompt: str | list[dict]) -> str:
        """Render a user message (or a list of messages) with the model's chat template, ready for generation."""
        if not self.chat_template:
            raise ValueError("this bundle's tokenizer has no chat template; pass the prompt without --chat")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return render_chat_template(self.chat_template, messages, **{k: v or "" for k, v in self.special.items()})

    def encode_chat(self, prompt: str | list[dict]) -> list[int]:
        """Token ids of the rendered chat prompt. The template writes its own special tokens (BOS included, where the
        model wants one), so the tokenizer adds none: adding them again would put BOS twice (transformers does the
        same in ``apply_chat_template(tokenize=True)``)."""
        return self.encode(self.apply_chat_template(prompt), add_special_tokens=False)


class BytesUnavailable(ValueError):
    """llguidance cannot read a tokenizer's token bytes: it is not installed, or it does not know the tokenizer's
    decoder (a WordPiece one: "can't determine decoder type"). What needs the bytes (structured output, chat
    logprobs) is unavailable; the rest decodes as ever."""


def read_bytes(tokenizer_json: str, **options):
    """llguidance's LLTokenizer over a tokenizer.json (``options``: its own), or BytesUnavailable saying why not in
    words that name what to do, not only llguidance's."""
    try:
        import llguidance
    except ImportError as err:
        raise BytesUnavailable(f"llguidance is not installed ({err}; pip install llguidance)") from None
    try:
        return llguidance.LLTokenizer(tokenizer_json, **options)
    except ValueError as err:
        raise BytesUnavailable(
            f"llguidance cannot read this bundle's tokenizer ({err}); it reads byte-level BPE, SentencePiece and "
            "byte-fallback tokenizers"
        ) from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class IncrementalDecoder:
    """Turns a growing token list into text pieces that never split a multi-byte character.

    Byte-level tokenizers can emit half of a UTF-8 character. tokenizers' ``DecodeStream`` re-decodes a few recent
    tokens with each new one and holds such a tail back until the next tokens complete it (O(window) a step).
    ``flush`` decodes the whole sequence once at the end, so a character left truncated is replaced (U+FFFD) rather
    than dropped, as the stream alone would.
    """

    def __init__(self, tokenizer: Tokenizer):
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._stream = DecodeStream(skip_special_tokens=True)  # as Tokenizer.decode

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self._stream is not None:
            try:
                piece = self._stream.step(self.tokenizer.fast, list(ids)) or ""
            except Exception:  # noqa: BLE001 - its "invalid prefix": earlier text changed; decode whole from here on
                self._stream = None
        if self._stream is None:
            piece = self._rest(hold_partial=True)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Whatever is still held back at the end (a truncated character is replaced, not dropped)."""
        piece = self._rest(hold_partial=False)
        self.text += piece
        return piece

    def _rest(self, hold_partial: bool) -> str:
        full = self.tokenizer.decode(self.ids)
        if (hold_partial and full.endswith("\ufffd")) or not full.startswith(self.text):
            return ""
        return full[len(self.text) :]


class StopText:
    """A sequence's text as it is sent, with its stop strings applied. Text that could still be the start of a stop
    string is held back until a later piece says whether it is one, so a stop string that straddles two steps never
    leaks its first part (a step ends wherever the draft's acceptance ends it). ``text``: what was sent.

    The stops are found by an automaton whose state the sequence carries (runtime/text/stop_matcher.py): a push costs
    its new characters, not the text so far nor the stops' number and length."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self._sent, self._held = tuple(s for s in stops if s), [], ""
        self._stops = stop_automaton(self.stops) if self.stops else None
        self._state = ROOT  # the automaton's state after the text sent and held

    @property
    def text(self) -> str:
        """What was sent (kept as pieces, joined when read: appending to one string would copy it every step)."""
        if len(self._sent) > 1:
            self._sent[:] = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    def push(self, piece: str) -> tuple[str, bool]:
        """(the text to send now, whether a stop string ended the sequence)."""
        joined = self._held + piece
        if self._stops is None:
            out, stopped, hold = joined, False, 0
        else:
            self._state, start = self._stops.feed(self._state, piece)
            stopped = start is not None
            out = joined[: max(0, len(self._held) + start)] if stopped else joined
            hold = 0 if stopped else self._stops.depth[self._state]
        self._held = out[len(out) - hold :] if hold else ""
        out = out[: len(out) - hold]
        self._sent.append(out)
        if stopped:  # the text ends before the stop: the state is the sent text's, not what followed it
            self._state = self._stops.state_of(self.text)
        return out, stopped

    def flush(self) -> str:
        """The held text, sent when the sequence ends otherwise (EOS, length, cancelled): no stop can follow."""
        out, self._held = self._held, ""
        self._sent.append(out)
        return out
