"""Triton Python model ``speculative`` (decoupled): draft-then-verify decoding of a Draftsmith bundle.

Longer than most modules: Triton's Python backend loads a model as this one file; the decoding is the runtime's
(runtime/core/scheduler.py), what is here is Triton's side of it (inputs, responses, cancellation, metrics).

Every request is handed to the runtime's in-flight batching scheduler (runtime/core/scheduler.py) as it arrives:
``execute`` only validates and submits, and returns. One scheduler loop owns both engines and, at every step, admits
waiting requests into the running batch, advances every row once (each with its own sampling parameters, k and seed) and
retires finished ones, so a new request starts at the next step whatever else runs, and a long request holds nobody
back. Each request gets its own responses through its response sender, sent from the scheduler's thread: with
``stream`` true, one response per text piece as its tokens are accepted, the last one flagged final; otherwise one
final response with the whole text. The final response carries the request's speculative statistics
(``acceptance_rate``, ``total_accepted_draft_tokens``, ``total_draft_tokens``); a stream's intermediate pieces report
zeros there. The scheduler's ``policy`` (model parameter) is "exact" (every answer bit for bit the same request's
alone) or "throughput" (batched target-only steps when they pay); see runtime/core/scheduler.py.

A repository written without streaming (not decoupled) submits the batch Triton gives ``execute`` and waits for it.

The prompt arrives as text (``text_input``, after ``preprocessing`` has checked it and its length) and the text comes
out here, not from a separate postprocessing step: the runtime tokenizes, detokenizes incrementally (holding back half
a UTF-8 character) and applies stop strings with per-sequence state across steps, so the text equals
``SpeculativeGenerator.generate``'s for the same request.

A malformed request gets an error response (``pb_utils.TritonError``) and the others are served. Bounds come before
work: the prompt's size in bytes, the number and length of stop strings and ``max_tokens`` are checked before
anything is decoded or tokenized (this model can be called directly, without ``preprocessing``).

Cancellation stops the work: a watcher thread asks each running request's response sender, every
``CANCEL_CHECK_S``, whether its client cancelled or went away, and cancels it in the scheduler, which drops the row
(and frees its cache row) at its next step; the request then gets its final response (a CANCELLED error, flagged
final, as the Python backend requires of a decoupled model). Through the ``ensemble`` this needs Triton's help, which
2.51 does not give: it checks an ensemble request for cancellation only between steps, never passing it to the step
that runs (triton-inference-server/server#6739), so a cancelled ensemble request decodes on to its end (bounded by
``max_tokens_limit``). Clients that cancel call this model directly (the same inputs; ``request_output_len`` for
``max_tokens``).

Seeds are per request: each row samples from a generator made from its own ``seed``, so a seeded request samples the
same text whatever it is batched with.

Metrics on Triton's ``/metrics``: the families of runtime/metric_families.py's one table, the OpenAI server's too,
through Triton's metric API (``TritonMetrics``; labelled ``model`` and ``version``). They are read from the bundle's
registry and the scheduler, where they are counted (the target's calls, the front door's refusals, the scheduler's
failures included), and exported after each request's last response or refusal, and during a stream at most every
``METRICS_EVERY_S`` (the running and waiting gauges): one reading per event at most, on the scheduler's thread.

Written by ``draftsmith triton-repo``; parameters: ``bundle`` (relative to this model's folder or absolute),
``threads``, ``max_tokens_limit``, ``max_prompt_bytes``, ``max_stop_words``, ``max_stop_word_bytes``, ``policy``,
``max_batch``, ``max_queue``, ``plan``.
"""

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.01  # ask about cancellation at most this often per request (each ask is a round trip to Triton)
METRICS_EVERY_S = 1.0  # a stream's pieces export the metrics at most this often (a request's end always does)


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


GENERIC_FAILURE = "the server failed while decoding this request; retry later"


def _error(err):
    """The TritonError a client gets for ``err``: ``_message``'s text, with UNAVAILABLE where the server has no
    room now (its queue is full) or is stopping: the code Triton's own full queue answers with
    (triton-inference-server/core src/scheduler_utils.cc, ``PriorityQueue::PolicyQueue::Enqueue``: UNAVAILABLE
    "Exceeds maximum queue size"; stored commit 05295b70), which a client reads as "retry", not as its own fault.
    Anything else keeps the default code."""
    from runtime.core.handles import Overloaded, is_stopping

    if isinstance(err, Overloaded) or is_stopping(err):
        return pb_utils.TritonError(_message(err), pb_utils.TritonError.UNAVAILABLE)
    return pb_utils.TritonError(_message(err))


def _message(err) -> str:
    """A client's error text: what this model and the runtime say to clients (a bad request, overloaded, stopping)
    as it is; anything else is logged here and answered generically, as the OpenAI server's 500 is: an engine's
    error names its graph's nodes and this machine's paths, which are nobody's business but the operator's."""
    from runtime.errors import RequestError
    from runtime.core.handles import is_stopping

    if isinstance(err, (RequestInvalid, RequestError)):
        return str(err)
    if is_stopping(err):
        return "the server is shutting down; retry on another"
    pb_utils.Logger.log_error(f"speculative: a request failed: {type(err).__name__}: {err}")
    return GENERIC_FAILURE


# this model's tensor names for the front door's fields (runtime/core/request.py), in its errors' words
NAMES = {
    "prompt": "text_input",
    "max_new_tokens": "max_tokens",
    "k": "num_draft_tokens",
    "stop": "stop_words",
    "response_format": "guided_decoding_guide",
}
FORM = "input '{}'"


class Request:
    """One admitted request (runtime/core/request.py's ``Admitted``), its response sender and its scheduler handle."""

    def __init__(self, sender, admitted, stream):
        self.sender, self.admitted, self.stream = sender, admitted, stream
        self.handle = None
        self.cancelled = False  # its client cancelled or went away: nobody reads its responses
        self.final_sent = False
        self.finished = threading.Event()  # its last response went out (or could not)
        # held while asking Triton about cancellation and while sending the final response: after the final one the
        # sender's response factory is freed, and asking it then crashes the server (TRITONBACKEND_ResponseFactory-
        # IsCancelled on a freed factory, seen with Triton 2.51)
        self.lock = threading.Lock()


class TritonPythonModel:
    def initialize(self, args):
        from runtime.core.loaded import LoadedBundle

        config = json.loads(args["model_config"])
        bundle = Path(_param(config, "bundle"))
        if not bundle.is_absolute():
            bundle = Path(args.get("model_repository") or Path(__file__).resolve().parents[1]) / bundle
        self.bundle = LoadedBundle.open(
            bundle, threads=int(_param(config, "threads")), device_id=int(args.get("model_instance_device_id") or 0)
        )  # the GPU Triton gave this instance
        from runtime.core.request import FrontDoor, Limits

        from runtime.core.scheduler import Scheduler

        self.scheduler = Scheduler(
            self.bundle,
            max_batch=int(_param(config, "max_batch")),
            max_queue=int(_param(config, "max_queue")),
            policy=_param(config, "policy"),
            plan=_param(config, "plan").lower() == "true",
        )
        bounds = ("max_tokens_limit", "max_prompt_bytes", "max_stop_words", "max_stop_word_bytes")
        limits = Limits.for_context(self.bundle.max_context, **{n: int(_param(config, n)) for n in bounds})
        # every request's checks, as the OpenAI server's, its room included: a full queue refuses before any work
        self.door = FrontDoor(self.bundle, limits, room=self.scheduler.check_room)
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        self.vocab_size = self.bundle.tokenizer.vocab_size
        self.scheduler.start()
        from runtime.metric_families import TritonMetrics

        self.model_name = args["model_name"]
        self.exported = TritonMetrics(pb_utils, {"model": self.model_name, "version": args["model_version"]})
        self.exported_at = 0.0
        self._export()
        self.active: dict[int, Request] = {}  # submitted, final response not sent yet: the watcher's list
        self.active_lock = threading.Lock()
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, name="speculative-cancel", daemon=True)
        self.watcher.start()

    def _export(self, final: bool = True):
        """Triton's metrics from one reading of the registry and the scheduler (runtime/metric_families.py): always
        at a request's end or refusal (``final``), else (a stream's piece) at most every METRICS_EVERY_S. Never
        raises: a metric that fails must not fail a request."""
        from runtime.metric_families import read

        now = time.monotonic()
        if final or now - self.exported_at >= METRICS_EVERY_S:
            self.exported_at = now
            try:
                self.exported.update(read(self.bundle.metrics, self.scheduler, self.model_name))
            except Exception as err:  # noqa: BLE001 - logged; the requests go on
                pb_utils.Logger.log_error(f"speculative: exporting the metrics failed: {err!r}")

    # --- requests ---------------------------------------------------------------------------------------------------

    def execute(self, requests):
        """Validate and submit each request; decoupled: return at once (responses go out from the scheduler's
        thread), else wait for this batch and return its responses in order."""
        submitted = []
        for request in requests:
            sender = request.get_response_sender() if self.decoupled else None
            try:
                item = self._parse(request, sender)
                self._submit(item)
            except Exception as err:  # noqa: BLE001 - any bad request gets its own error, the batch goes on
                item = None
                self._export()  # its refusal counted (the front door's, the scheduler's)
                if self.decoupled:
                    self._fail(sender, err)
                else:
                    submitted.append(err)
                continue
            submitted.append(item)
        if self.decoupled:
            return None
        return [self._answer(item) for item in submitted]

    def _submit(self, item):
        from runtime.core.handles import Overloaded
        from runtime.errors import RequestError

        try:
            item.handle = self.scheduler.enqueue(item.admitted, sink=lambda event: self._on_event(item, event))[0]
        except Overloaded:
            raise  # filled up since the door's check
        except RequestError as err:
            raise RequestInvalid(str(err)) from None
        if self.decoupled:
            with self.active_lock:
                self.active[item.handle.id] = item

    def _answer(self, item):
        """Not decoupled: the final response (or error) of one request of this batch."""
        if isinstance(item, Exception):
            return pb_utils.InferenceResponse(output_tensors=[], error=_error(item))
        item.finished.wait()
        return item.response

    def _on_event(self, item, event):
        """The scheduler's sink (its thread): one event of one request → its responses. Must not raise."""
        try:
            self._export(event.error is not None or event.final is not None)  # before its client hears of it
            if event.error is not None:
                self._done(item, error=event.error)
            elif event.final is not None:
                generation = event.final
                if generation.finish_reason == "cancelled":
                    self._end_cancelled(item, generation.stats.num_steps)
                else:
                    text = event.piece if item.stream else generation.text
                    self._done(item, response=self._response(text, generation.stats))
            elif item.stream and event.piece:
                self._send(item, self._response(event.piece, None))
        except Exception as err:  # noqa: BLE001 - never break the scheduler's loop
            pb_utils.Logger.log_error(f"speculative: sending a response failed: {err}")

    def _done(self, item, response=None, error=None):
        """The request's last response: sent (decoupled) or kept for ``execute`` to return."""
        with self.active_lock:
            if item.handle is not None:
                self.active.pop(item.handle.id, None)
        if error is not None:
            response = pb_utils.InferenceResponse(output_tensors=[], error=_error(error))
        if self.decoupled:
            self._send(item, response, flags=FINAL)
        else:
            item.response = response
        item.finished.set()

    def _watch_cancellations(self):
        """Ask Triton, every CANCEL_CHECK_S, whether each running request's client cancelled or went away."""
        while not self.stopping.wait(CANCEL_CHECK_S):
            with self.active_lock:
                items = list(self.active.values())
            for item in items:
                with item.lock:
                    if item.final_sent:
                        continue
                    try:
                        gone = bool(item.sender.is_cancelled())
                    except Exception:  # noqa: BLE001 - the request is gone
                        gone = True
                if gone:
                    item.cancelled = True
                    item.handle.cancel()

    def _fail(self, sender, err):
        error = _error(err)
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing left to tell it
            pass

    def _parse(self, request, sender) -> Request:
        """A request's tensors in the front door's names (``_asked``), then the door's checks, before any work: its
        bounds, its text, its tokens (``input_ids`` from ``preprocessing`` when the ensemble sends them: tokenized
        once), the bundle's bounds, its drafter. The scheduler's room is asked after the cheap checks and before
        the tokenizing, so a full queue refuses before any work (Overloaded, answered as ``_error`` says)."""
        from runtime.core.handles import Overloaded
        from runtime.errors import RequestError

        asked = self._asked(request)
        stream = _optional(request, "stream")
        if stream and not self.decoupled:
            raise RequestInvalid(
                "input 'stream': this repository was written without streaming "
                "(draftsmith triton-repo --no-streaming); send stream=false or use a streaming one"
            )
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids is not None:
            asked = dataclasses.replace(asked, tokens=[ids.as_numpy().reshape(-1).tolist()])
        try:
            admitted = self.door.admit(asked)
        except Overloaded:
            raise  # no room now (the scheduler's queue is full): not the request's fault (``_error``)
        except RequestError as err:
            raise RequestInvalid(str(err)) from None
        return Request(sender, admitted, bool(stream))

    def _asked(self, request):
        """The request's tensors mapped to the front door's fields (TensorRT-LLM's conventions: 0 turns top_k,
        top_p and num_draft_tokens off, ``random_seed`` is ``seed``'s other name); nothing checked here but what only
        a tensor means (``end_id``)."""
        from runtime.core.request import Asked

        prompt = _optional(request, "text_input")
        if prompt is None:
            raise RequestInvalid("input 'text_input' is required")
        max_tokens = _optional(request, "request_output_len")
        if max_tokens is None:
            raise RequestInvalid("input 'request_output_len' is required")
        end_id = _optional(request, "end_id")
        if end_id is not None and int(end_id) not in self.bundle.eos_ids:
            raise RequestInvalid(
                f"input 'end_id': this model ends sequences at {list(self.bundle.eos_ids)}; "
                f"another end id is not supported, received {end_id}"
            )
        temperature, top_k, top_p = (_optional(request, n) for n in ("temperature", "top_k", "top_p"))
        seed = _optional(request, "seed")
        k = _optional(request, "num_draft_tokens")
        stops = _optional(request, "stop_words")
        fields = dict(
            max_new_tokens=int(max_tokens),
            temperature=0.0 if temperature is None else temperature,
            top_k=None if top_k is None or top_k == 0 else top_k,
            top_p=None if top_p is None or top_p == 1 else top_p,
            seed=_optional(request, "random_seed") if seed is None else seed,
            k=None if k is None or int(k) == 0 else k,
            mode="target" if k is not None and int(k) == 0 else "speculative",
            stop=[] if stops is None else [s for s in stops if len(s)],
            **self._guide(request),
        )
        return Asked([prompt], fields, names=NAMES, form=FORM)

    def _guide(self, request) -> dict:
        """Constrained output from tensorrtllm_backend's guided-decoding inputs (runtime/decoding/grammar.py
        trtllm_guide): the schema, regex or grammar is bounded in size before it is decoded, and compiled at the
        front door."""
        from runtime.decoding.grammar import MAX_SOURCE_BYTES, trtllm_guide
        from runtime.errors import RequestError
        from runtime.core.request import as_text, text_bytes

        kind, guide = _optional(request, "guided_decoding_guide_type"), _optional(request, "guided_decoding_guide")
        if guide is not None and text_bytes(guide) > MAX_SOURCE_BYTES:
            raise RequestInvalid(
                f"input 'guided_decoding_guide' is {text_bytes(guide)} bytes; the limit is {MAX_SOURCE_BYTES}"
            )
        try:
            constraint = trtllm_guide(
                None if kind is None else as_text(kind, "guided_decoding_guide_type"),
                None if guide is None else as_text(guide, "guided_decoding_guide"),
            )
        except RequestError as err:
            raise RequestInvalid(str(err)) from None
        return {} if constraint is None else {"response_format": constraint}

    # --- responses --------------------------------------------------------------------------------------------------

    def _end_cancelled(self, item, steps: int = 0):
        """A cancelled request's last response: a CANCELLED error flagged final (Triton waits for the flag)."""
        with self.active_lock:
            self.active.pop(item.handle.id, None)
        error = pb_utils.TritonError("request cancelled by its client", pb_utils.TritonError.CANCELLED)
        if not self.decoupled:
            item.response = pb_utils.InferenceResponse(output_tensors=[], error=error)
            item.finished.set()
            return
        how = "sent"
        with item.lock:
            try:
                item.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
            except Exception:  # noqa: BLE001 - the error response could not go out: the flag alone still must
                try:
                    item.sender.send(flags=FINAL)
                    how = "sent (flag only)"
                except Exception:  # noqa: BLE001 - a closed sender: the backend sent the flag when it saw the cancel
                    how = "already sent by the backend"
            item.final_sent = True
        item.finished.set()
        pb_utils.Logger.log_info(
            f"speculative: request cancelled by its client after {steps} steps; decoding stopped, final response {how}"
        )

    def _send(self, item, response, flags=0):
        """Send one response; a client that went away must not end the other requests of its batch. Intermediate
        pieces of a cancelled request are dropped; a final response is always attempted."""
        if item.final_sent or (item.cancelled and not flags & FINAL):
            return
        if not flags & FINAL:
            try:
                item.sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - the request is gone; the batch goes on
                item.cancelled = True
            return
        with item.lock:
            try:
                item.sender.send(response, flags=flags)
            except Exception:  # noqa: BLE001 - the request is gone; the batch goes on
                item.cancelled = True
            item.final_sent = True

    @staticmethod
    def _response(text, stats):
        """One response; ``stats`` None (a stream's intermediate pieces) reports zeros: totals come with the last."""
        rate, accepted, drafted = (
            (stats.draft_acceptance_rate, stats.num_accepted_tokens, stats.num_draft_tokens)
            if stats is not None
            else (0.0, 0, 0)
        )
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
                pb_utils.Tensor("acceptance_rate", np.array([[rate]], dtype=np.float32)),
                pb_utils.Tensor("total_accepted_draft_tokens", np.array([[accepted]], dtype=np.int32)),
                pb_utils.Tensor("total_draft_tokens", np.array([[drafted]], dtype=np.int32)),
            ]
        )

    def finalize(self):
        self.stopping.set()
        self.scheduler.stop()  # what still runs or waits gets an error response
        self.bundle = None
