"""Triton Python model ``speculative`` (decoupled): draft-then-verify decoding of a Draftsmith bundle.

Triton's dynamic batcher hands ``execute`` the requests that queued while the previous batch ran. Requests with the
same decoding parameters are decoded together through the runtime's public ``SpeculativeGenerator.stream_batch``:
one loop over their prompts, so each step is one draft pass and one target verify call for the whole group. Each
request gets its own responses through its response sender: with ``stream`` true, one response per text piece as its
tokens are accepted, the last one flagged final; otherwise one final response with the whole text. The final
response carries the request's speculative statistics (``acceptance_rate``, ``total_accepted_draft_tokens``,
``total_draft_tokens``); a stream's intermediate pieces report zeros there.

The prompt arrives as text (``text_input``, after ``preprocessing`` has checked it and its length) and the text comes
out here, not from a separate postprocessing step: the runtime tokenizes, detokenizes incrementally (holding back half
a UTF-8 character) and applies stop strings with per-sequence state across steps, so the text equals
``SpeculativeGenerator.generate``'s for the same request.

A malformed request gets an error response (``pb_utils.TritonError``) and the others are served. Bounds come before
work: the prompt's size in bytes, the number and length of stop strings and ``max_tokens`` are checked before
anything is decoded or tokenized (this model can be called directly, without ``preprocessing``).

Cancellation stops the work: after every step each running request's response sender is asked whether its client
cancelled or went away; such a request leaves the loop at once (its cache row is freed, the other rows go on) and
gets its final response (a CANCELLED error, flagged final, as the Python backend requires of a decoupled model).
Through the ``ensemble`` this needs Triton's help, which 2.51 does not give: it checks an ensemble request for
cancellation only between steps, never passing it to the step that runs (triton-inference-server/server#6739), so a
cancelled ensemble request decodes on to its end (bounded by ``max_tokens_limit``). Clients that cancel call this
model directly (the same inputs; ``request_output_len`` for ``max_tokens``).

Seeds are per request: a batch decodes each request with a generator made from its own ``seed``, so a seeded
request samples the same text whatever it is batched with (with ``fallback`` on, the fallback state is shared by
the batch, and then so is its effect on sampling).

Metrics on Triton's ``/metrics``: draft tokens proposed and accepted, target calls (one per batch step), sequence
steps, tokens emitted, requests, cancelled requests, errors; gauges for the fallback state (1 while decoding
target-only because acceptance fell low) and the last batch size.

Written by ``draftsmith triton-repo``; parameters: ``bundle`` (relative to this model's folder or absolute),
``threads``, ``max_tokens_limit``, ``max_prompt_bytes``, ``max_stop_words``, ``max_stop_word_bytes``, ``fallback``.
"""

import json
import math
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.01  # ask about cancellation at most this often per request (each ask is a round trip to Triton)


class RequestInvalid(ValueError):
    pass


def _param(config: dict, key: str) -> str:
    try:
        return config["parameters"][key]["string_value"]
    except KeyError:
        raise ValueError(f"model config has no parameter {key!r}; regenerate the repository") from None


def _optional(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if name == "stop_words":
        return values
    if values.size != 1:
        raise RequestInvalid(f"input {name!r}: expected one value, received {values.size}")
    return values[0]


def _size(value) -> int:
    """A string input's size in UTF-8 bytes, without decoding it."""
    return len(value.encode("utf-8")) if isinstance(value, str) else len(value)


def _text(value, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestInvalid(f"input {name!r} is not valid UTF-8 ({err.reason} at byte {err.start})") from None


class Request:
    """One request's validated parameters and its response sender."""

    def __init__(self, sender, prompt, options, stream):
        self.sender, self.prompt, self.options, self.stream = sender, prompt, options, stream
        self.text = ""
        self.done = False  # its generation ended (finished, failed or cancelled)
        self.cancelled = False  # its client cancelled or went away: nobody reads its responses
        self.final_sent = False
        self.checked_at = float("-inf")  # when Triton was last asked whether it was cancelled

    @property
    def key(self):
        """Requests with equal keys decode together (their parameters are shared by one loop). The seed is not
        part of it: each row of a loop samples from its own request's seed."""
        opts = {k: v for k, v in self.options.items() if k != "seed"}
        return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))


class TritonPythonModel:
    def initialize(self, args):
        from runtime.api import SpeculativeGenerator
        config = json.loads(args["model_config"])
        bundle = Path(_param(config, "bundle"))
        if not bundle.is_absolute():
            bundle = Path(args.get("model_repository") or Path(__file__).resolve().parents[1]) / bundle
        self.generator = SpeculativeGenerator.from_bundle(
            bundle, threads=int(_param(config, "threads")),
            device_id=int(args.get("model_instance_device_id") or 0))  # the GPU Triton gave this instance
        self.max_tokens_limit = int(_param(config, "max_tokens_limit"))
        self.max_prompt_bytes = int(_param(config, "max_prompt_bytes"))
        self.max_stop_words = int(_param(config, "max_stop_words"))
        self.max_stop_word_bytes = int(_param(config, "max_stop_word_bytes"))
        self.fallback = _param(config, "fallback").lower() == "true"
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.vocab_size = self.generator.tokenizer.vocab_size
        labels = {"model": args["model_name"], "version": args["model_version"]}
        counters = {
            "draft_tokens": "Draft tokens proposed to the target",
            "accepted_tokens": "Draft tokens the target accepted",
            "target_calls": "Target engine calls (prefill and verify; one per step of a whole batch)",
            "sequence_steps": "Verify steps summed over sequences (> target calls when requests share a batch)",
            "emitted_tokens": "Tokens generated",
            "requests": "Requests completed",
            "requests_cancelled": "Requests whose client cancelled or went away; decoding stopped at the next step",
            "request_errors": "Requests refused or failed",
        }
        self.families, self.metrics = [], {}
        for name, help_text in counters.items():
            family = pb_utils.MetricFamily(name=f"draftsmith_{name}_total", description=help_text,
                                           kind=pb_utils.MetricFamily.COUNTER)
            self.families.append(family)
            self.metrics[name] = family.Metric(labels=labels)
        for name, help_text in {"fallback_active": "1 while decoding target-only because acceptance fell low",
                                "batch_size": "Requests decoded together by the last loop"}.items():
            family = pb_utils.MetricFamily(name=f"draftsmith_{name}", description=help_text,
                                           kind=pb_utils.MetricFamily.GAUGE)
            self.families.append(family)
            self.metrics[name] = family.Metric(labels=labels)
        self._count_target_calls()

    def _count_target_calls(self):
        """Count the target engine's forward calls: a batch step is one call, however many sequences it verifies."""
        target = self.generator.target
        forward, metric = target.forward, self.metrics["target_calls"]

        def counted(*args, **kwargs):
            metric.increment(1)
            return forward(*args, **kwargs)
        target.forward = counted

    # --- requests ---------------------------------------------------------------------------------------------------

    def execute(self, requests):
        parsed = []
        for request in requests:
            sender = request.get_response_sender()
            try:
                item = self._parse(request, sender)
            except Exception as err:  # noqa: BLE001 - any bad request gets its own error, the batch goes on
                self._fail(sender, err)
                continue
            if self._is_cancelled(item):  # cancelled while it queued: no work at all
                self._end_cancelled(item)
            else:
                parsed.append(item)
        groups = {}
        for item in parsed:
            groups.setdefault(item.key, []).append(item)
        for group in groups.values():
            try:
                self._decode(group)
            except Exception as err:  # noqa: BLE001 - an engine failure ends this group, never the model
                for item in group:
                    if not item.done:
                        item.done = True
                        self._fail(item.sender, RuntimeError(f"decoding failed: {err}"))
        return None

    def _fail(self, sender, err):
        self.metrics["request_errors"].increment(1)
        message = str(err) if isinstance(err, RequestInvalid) else f"{type(err).__name__}: {err}"
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message)),
                        flags=FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
            pass

    def _parse(self, request, sender) -> Request:
        prompt = _optional(request, "text_input")
        if prompt is None:
            raise RequestInvalid("input 'text_input' is required")
        if _size(prompt) > self.max_prompt_bytes:
            raise RequestInvalid(f"input 'text_input' is {_size(prompt)} bytes; this server's limit is "
                                 f"max_prompt_bytes={self.max_prompt_bytes}. Shorten the prompt")
        max_tokens = _optional(request, "request_output_len")
        if max_tokens is None or not 1 <= int(max_tokens) <= self.max_tokens_limit:
            raise RequestInvalid(f"input 'max_tokens': expected an integer in [1, {self.max_tokens_limit}] "
                                 f"(this server's max_tokens_limit), received {max_tokens}")
        stops = self._stop_words(_optional(request, "stop_words"))
        prompt = _text(prompt, "text_input")
        if not prompt:
            raise RequestInvalid("input 'text_input' is empty")
        temperature = _optional(request, "temperature")
        temperature = 0.0 if temperature is None else float(temperature)
        if not math.isfinite(temperature) or temperature < 0:
            raise RequestInvalid(f"input 'temperature': expected a finite number >= 0, received {temperature}")
        top_k = _optional(request, "top_k")
        top_k = None if top_k is None or int(top_k) == 0 else int(top_k)
        if top_k is not None and top_k < 0:
            raise RequestInvalid(f"input 'top_k': expected an integer >= 0 (0: off), received {top_k}")
        top_p = _optional(request, "top_p")
        top_p = None if top_p is None else float(top_p)
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise RequestInvalid(f"input 'top_p': expected a number in (0, 1], received {top_p}")
        if top_p == 1.0:
            top_p = None
        seed = _optional(request, "seed")
        if seed is None:
            seed = _optional(request, "random_seed")
        seed = None if seed is None else int(seed)
        k = _optional(request, "num_draft_tokens")
        mode, k = "speculative", (None if k is None else int(k))
        if k is not None and not 0 <= k <= self.generator.max_k:
            raise RequestInvalid(f"input 'num_draft_tokens': expected an integer in [0, {self.generator.max_k}] "
                                 f"(0: target only), received {k}")
        if k == 0:
            mode, k = "target", None
        end_id = _optional(request, "end_id")
        if end_id is not None and int(end_id) not in self.generator.eos_ids:
            raise RequestInvalid(f"input 'end_id': this model ends sequences at {list(self.generator.eos_ids)}; "
                                 f"another end id is not supported, received {end_id}")
        stream = _optional(request, "stream")
        if stream and not self.decoupled:
            raise RequestInvalid("input 'stream': this repository was written without streaming "
                                 "(draftsmith triton-repo --no-streaming); send stream=false or use a streaming one")
        options = dict(max_new_tokens=int(max_tokens), temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                       k=k, stop=stops, mode=mode)
        return Request(sender, prompt, options, bool(stream) if stream is not None else False)

    def _stop_words(self, values) -> list[str]:
        """The request's stop strings, after their count and sizes are checked (each is searched at every step)."""
        if values is None:
            return []
        if values.size > self.max_stop_words:
            raise RequestInvalid(f"input 'stop_words' has {values.size} entries; this server's limit is "
                                 f"max_stop_words={self.max_stop_words}")
        longest = max((_size(v) for v in values), default=0)
        if longest > self.max_stop_word_bytes:
            raise RequestInvalid(f"input 'stop_words' has an entry of {longest} bytes; this server's limit is "
                                 f"max_stop_word_bytes={self.max_stop_word_bytes}")
        return [s for s in (_text(v, "stop_words") for v in values) if s]

    # --- decoding ---------------------------------------------------------------------------------------------------

    def _decode(self, group):
        """Decode a group with the runtime's public batched stream; a request error splits the group up."""
        from runtime.errors import RequestError
        options = dict(group[0].options, seed=[r.options["seed"] for r in group])  # each row samples its own seed
        if self.fallback:
            options["fallback"] = True
        self.metrics["batch_size"].set(float(len(group)))
        started = False
        try:
            for index, piece, generation in self.generator.stream_batch(
                    [r.prompt for r in group], cancelled=lambda i: self._is_cancelled(group[i]), **options):
                started = True
                item = group[index]
                item.text += piece
                if generation is not None and generation.finish_reason == "cancelled":
                    self._count(generation.stats)
                    self._end_cancelled(item, generation.stats.num_steps)
                elif generation is not None:
                    self._finish(item, generation.stats, piece)
                elif item.stream and piece:
                    self._send(item, self._response(piece, None))
                self.metrics["fallback_active"].set(float(self.generator.metrics.fallback_active))
        except RequestError as err:
            if started or len(group) == 1:
                raise RequestInvalid(str(err)) from None
            for item in group:  # which request was it? decode each alone; the others are served
                try:
                    self._decode([item])
                except Exception as single:  # noqa: BLE001
                    item.done = True
                    self._fail(item.sender, single)
        finally:
            self.metrics["fallback_active"].set(0.0)

    def _count(self, stats):
        for name, value in (("draft_tokens", stats.num_draft_tokens), ("accepted_tokens", stats.num_accepted_tokens),
                            ("sequence_steps", stats.num_steps), ("emitted_tokens", stats.num_emitted_tokens)):
            self.metrics[name].increment(value)

    def _finish(self, item, stats, piece):
        item.done = True
        self._count(stats)
        self.metrics["requests"].increment(1)
        self._send(item, self._response(piece if item.stream else item.text, stats), flags=FINAL)

    def _is_cancelled(self, item) -> bool:
        """Has the client cancelled (or gone away)? Asked after every step (at most every ``CANCEL_CHECK_S``, so
        steps of a tiny model do not turn into round trips); a sender that fails counts as gone."""
        now = time.monotonic()
        if not item.cancelled and now - item.checked_at >= CANCEL_CHECK_S:
            item.checked_at = now
            try:
                item.cancelled = bool(item.sender.is_cancelled())
            except Exception:  # noqa: BLE001 - the request is gone
                item.cancelled = True
        return item.cancelled

    def _end_cancelled(self, item, steps: int = 0):
        """A cancelled request's last response: a CANCELLED error flagged final (Triton waits for the flag)."""
        item.done = True
        self.metrics["requests_cancelled"].increment(1)
        how = "sent"
        try:
            error = pb_utils.TritonError("request cancelled by its client", pb_utils.TritonError.CANCELLED)
            item.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        except Exception:  # noqa: BLE001 - the error response could not go out: the flag alone still must
            try:
                item.sender.send(flags=FINAL)
                how = "sent (flag only)"
            except Exception:  # noqa: BLE001 - a closed sender: the backend sent the flag when it saw the cancel
                how = "already sent by the backend"
        item.final_sent = True
        pb_utils.Logger.log_info(f"speculative: request cancelled by its client after {steps} steps; decoding "
                                 f"stopped, final response {how}")

    def _send(self, item, response, flags=0):
        """Send one response; a client that went away must not end the other requests of its batch. Intermediate
        pieces of a cancelled request are dropped; a final response is always attempted."""
        if item.final_sent or (item.cancelled and not flags & FINAL):
            return
        try:
            item.sender.send(response, flags=flags)
        except Exception:  # noqa: BLE001 - the request is gone; the batch goes on
            item.cancelled = True
        if flags & FINAL:
            item.final_sent = True

    @staticmethod
    def _response(text, stats):
        """One response; ``stats`` None (a stream's intermediate pieces) reports zeros: totals come with the last."""
        rate, accepted, drafted = ((stats.draft_acceptance_rate, stats.num_accepted_tokens, stats.num_draft_tokens)
                                   if stats is not None else (0.0, 0, 0))
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("acceptance_rate", np.array([[rate]], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], dtype=np.int32)),
        ])

    def finalize(self):
        self.generator = None
