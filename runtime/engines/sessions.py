"""ONNX Runtime sessions: where a bundle can run (execution providers by device) and the process's thread pool.

Every session the runtime makes comes from ``make_session`` with ``session_options``; runtime/engines/onnx.py and
fused.py run them.
"""

from __future__ import annotations

import os


# Where the runtime can run an ONNX bundle, and the execution providers for each (tensorrt: TensorRT EP over CUDA)
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
DEVICES = tuple(PROVIDERS)


class DeviceError(RuntimeError):
    """The requested device has no ONNX Runtime execution provider here; the message says what to install."""


def providers_for(device: str, available: list[str] | None = None, device_id: int = 0) -> list:
    """ONNX Runtime execution providers for ``device``, in priority order (GPU ones with their ``device_id``); CPU
    last for the ops a GPU provider leaves out. Fails early, with what to install, when onnxruntime here lacks the
    device's provider."""
    if device not in PROVIDERS:
        raise DeviceError(f"device must be one of {DEVICES}, received {device!r}")
    if available is None:
        import onnxruntime

        available = onnxruntime.get_available_providers()
    missing = [p for p in PROVIDERS[device][:-1] if p not in available]
    if missing:
        raise DeviceError(
            f"device {device!r} needs ONNX Runtime's {' and '.join(missing)}, but this onnxruntime offers only "
            f"{sorted(available)}. Install the GPU build in place of the CPU one (pip uninstall -y onnxruntime && "
            "pip install onnxruntime-gpu; CUDA 12 and cuDNN 9 must be present), or run on the CPU with device 'cpu' "
            "(a CUDA bundle's fp16 engines run there too, more slowly)."
        )
    return [name if name == "CPUExecutionProvider" else (name, {"device_id": device_id}) for name in PROVIDERS[device]]


POOL_ENV = "DRAFTSMITH_ORT_POOL"  # "session": a pool per session, spinning off (the older setting)
_pool: dict = {}  # the process-wide ONNX Runtime thread pool, once made: {"threads": n}


def session_options(threads: int = 0):
    """SessionOptions for this process's thread pool. Every session the runtime makes uses them (a session made
    with ONNX Runtime's defaults fails once the global pool exists).

    By default all sessions share one global intra-op pool whose threads spin: a decoding call runs hundreds of
    short operators, and waking sleeping threads for each costs more than the work, while per-session spinning
    pools fight over the cores when a draft and a target take turns (on the default bundle, 2 cores: +20-25%
    speculative and +25-30% target-only tok/s against per-session pools with spinning off; shared/FACTS.md,
    "Thread spinning, measured again"). The first session's ``threads`` (0: one per core) sizes the pool for the
    whole process. ``DRAFTSMITH_ORT_POOL=session`` gives each session its own pool of ``threads``, spinning off.
    The GGUF kernel library (runtime.engines.gguf_ops) is registered where it is built; its operator runs on the
    same pool.
    """
    import onnxruntime as ort

    from runtime.engines import gguf_ops

    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    gguf_ops.register(options)  # the GGUF-block matmul, where it is built (a graph that needs it is checked apart)
    if os.environ.get(POOL_ENV, "global") == "session" and not _pool:
        options.inter_op_num_threads = 1  # thread counts on a session are refused (warned) under a global pool
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return options
    if not _pool:
        from onnxruntime.capi import _pybind_state

        size = threads or os.cpu_count() or 1
        _pybind_state.set_global_thread_pool_sizes(size, 1)
        _pool["threads"] = size
    options.use_per_session_threads = False
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return options


def make_session(
    model: str | os.PathLike | bytes,
    threads: int = 0,
    providers: list | None = None,
    external_data: dict[str, bytes] | None = None,
    options=None,
):
    """An ONNX Runtime session on this process's thread pool (``session_options``).

    ``model`` is a path or the graph's bytes; a bundle's loader passes the bytes it verified, with ``external_data``
    (each external-data file's bytes by the location the graph names), so what runs is what was hashed.
    """
    import onnxruntime as ort

    options = options or session_options(threads)
    if external_data:  # ONNX Runtime copies them while the session is made
        if not hasattr(options, "add_external_initializers_from_files_in_memory"):
            raise RuntimeError(
                f"onnxruntime {ort.__version__} cannot take a graph's external data from memory; "
                "upgrade it (pip install -U onnxruntime; 1.32 can)"
            )
        names = list(external_data)
        options.add_external_initializers_from_files_in_memory(
            names, [external_data[n] for n in names], [len(external_data[n]) for n in names]
        )
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=providers or ["CPUExecutionProvider"])
