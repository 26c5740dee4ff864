"""The two clients ``draftsmith load`` drives a Triton server with, and what they record of each request: HTTP
``/v2/models/ensemble/generate`` and a gRPC bidirectional stream (text piece by piece). Each request ends answered,
failed or lost (see bench/load.py); an answer counts only when well formed.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field


@dataclass
class Record:
    """One request and how it ended."""

    client: int
    kind: str  # "grpc-stream" or "http"
    prompt_class: str
    started: float  # seconds since the load began
    ended: float = 0.0
    outcome: str = "lost"  # answered / failed / lost
    latency: float = 0.0
    ttft: float | None = None
    error: str = ""
    body: dict = field(default_factory=dict)  # what was sent
    text: str = ""  # what came back


def well_formed(text, rate, accepted, drafted) -> str:
    """'' when a final answer is well formed, else what is wrong with it."""
    if not isinstance(text, str):
        return f"text_output is {type(text).__name__}, not a string"
    if not isinstance(rate, (int, float)) or not 0.0 <= float(rate) <= 1.0:
        return f"acceptance_rate {rate!r} outside [0, 1]"
    if not isinstance(accepted, int) or not isinstance(drafted, int) or not 0 <= accepted <= drafted:
        return f"accepted {accepted!r} / drafted {drafted!r} inconsistent"
    return ""


def http_request(url: str, body: dict, timeout: float, record: Record, t0: float) -> None:
    request = urllib.request.Request(
        f"{url}/v2/models/ensemble/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as err:
        record.outcome, record.error = "failed", f"HTTP {err.code}: {err.read()[:300].decode(errors='replace')}"
        return
    except TimeoutError:
        record.outcome, record.error = "lost", f"no answer in {timeout:.0f} s"
        return
    except (urllib.error.URLError, ConnectionError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, TimeoutError):
            record.outcome, record.error = "lost", f"no answer in {timeout:.0f} s"
        else:
            record.outcome, record.error = "failed", f"connection: {reason}"
        return
    finally:
        record.ended = time.perf_counter() - t0
    problem = well_formed(
        answer.get("text_output"),
        answer.get("acceptance_rate"),
        answer.get("total_accepted_draft_tokens"),
        answer.get("total_draft_tokens"),
    )
    record.latency = time.perf_counter() - began
    record.outcome, record.error = ("lost", "malformed answer: " + problem) if problem else ("answered", "")
    record.text = answer.get("text_output") or ""


class GrpcStreamClient:
    """One gRPC bidirectional stream, re-opened after any stream-level error (a server restart, a timeout)."""

    def __init__(self, grpc_url: str):
        self.grpc_url = grpc_url
        self.client = None
        self.results: queue.Queue = queue.Queue()

    def _open(self):
        import tritonclient.grpc as grpcclient

        self.results = queue.Queue()
        results = self.results
        self.client = grpcclient.InferenceServerClient(self.grpc_url)
        self.client.start_stream(callback=lambda result, error: results.put((result, error)))

    def close(self):
        if self.client is not None:
            try:
                self.client.stop_stream(cancel_requests=True)
                self.client.close()
            except Exception:  # noqa: BLE001 - a broken stream may refuse to close cleanly
                pass
            self.client = None

    def request(self, body: dict, timeout: float, record: Record, t0: float) -> None:
        import numpy as np
        import tritonclient.grpc as grpcclient

        began = time.perf_counter()
        deadline = began + timeout
        try:
            if self.client is None:
                self._open()
            arrays = {
                "text_input": (np.array([[body["text_input"].encode()]], dtype=object), "BYTES"),
                "max_tokens": (np.array([[body["max_tokens"]]], dtype=np.int32), "INT32"),
                "stream": (np.array([[True]], dtype=bool), "BOOL"),
            }
            for name, dtype, np_type in (
                ("temperature", "FP32", np.float32),
                ("top_p", "FP32", np.float32),
                ("top_k", "INT32", np.int32),
                ("num_draft_tokens", "INT32", np.int32),
                ("seed", "UINT64", np.uint64),
            ):
                if name in body:
                    arrays[name] = (np.array([[body[name]]], dtype=np_type), dtype)
            if "stop_words" in body:
                arrays["stop_words"] = (np.array([[s.encode() for s in body["stop_words"]]], dtype=object), "BYTES")
            inputs = []
            for name, (array, dtype) in arrays.items():
                tensor = grpcclient.InferInput(name, list(array.shape), dtype)
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            request_id = uuid.uuid4().hex
            self.client.async_stream_infer("ensemble", inputs, request_id=request_id, enable_empty_final_response=True)
            text, last = "", None
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise queue.Empty
                result, error = self.results.get(timeout=left)
                if error is not None:
                    record.outcome, record.error = "failed", f"gRPC: {error}"
                    if "StatusCode" in str(error) or "Socket closed" in str(error):
                        self.close()  # the stream itself broke
                    return
                response = result.get_response()
                if response.id and response.id != request_id:
                    continue  # a late response of an abandoned request
                piece = result.as_numpy("text_output")
                if piece is not None:
                    chunk = piece.reshape(-1)[0]
                    chunk = chunk.decode("utf-8") if isinstance(chunk, bytes) else chunk
                    if chunk and record.ttft is None:
                        record.ttft = time.perf_counter() - began
                    text += chunk
                    last = result
                if response.parameters["triton_final_response"].bool_param:
                    break
            if last is not None:
                rate = float(last.as_numpy("acceptance_rate").reshape(-1)[0])
                accepted = int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
                drafted = int(last.as_numpy("total_draft_tokens").reshape(-1)[0])
            else:
                rate = accepted = drafted = None  # no text_output at all: not well formed
            problem = well_formed(text, rate, accepted, drafted)
            record.latency = time.perf_counter() - began
            record.outcome, record.error = ("lost", "malformed answer: " + problem) if problem else ("answered", "")
            record.text = text
        except queue.Empty:
            record.outcome, record.error = "lost", f"no final response in {timeout:.0f} s"
            self.close()
        except Exception as err:  # noqa: BLE001 - connection refused, stream closed: the request failed
            record.outcome, record.error = "failed", f"gRPC: {type(err).__name__}: {err}"
            self.close()
        finally:
            record.ended = time.perf_counter() - t0
