"""One decoding loop for every engine: the scheduler's (runtime/core/scheduler.py), over ONNX Runtime's
engines and TensorRT-LLM's alike. An AST scan of the packages finds every other loop that decodes: a ``while`` or
``for`` loop (or comprehension) whose body, through the functions it calls, both calls an engine and decides when
a sequence ends (compares against ``max_new_tokens`` or tests for an EOS id). Loops inside one step, such as a
draft model's k draft calls, end no sequence and are not decoding loops; a loop that drives the scheduler's step
(the Python API, the bench) decodes nothing itself, because the scan does not enter the scheduler.

The one exception, named: the distillation's teacher (``generate_with_engine``), which continues prompts one
token a call with the target's ONNX engine, filling each sample's teacher rows from the same calls (its logits at
every position, which no step of the scheduler keeps)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("builder", "runtime", "triton_repo", "bench", "deploy")
SCHEDULER = "runtime/core/scheduler.py"
TEACHER = "builder/distill/continuations.py:generate_with_engine"
# an engine's calls: the contract's (runtime/engines/base.py) and the TensorRT-LLM executor's (runtime/trtllm/)
ENGINE_CALLS = {
    "forward",
    "prefill",
    "prefill_rows",
    "admit_rows",
    "generate_tokens",
    "enqueue_requests",
    "await_responses",
}
ENDS = {"max_new_tokens", "eos_ids", "eos"}  # what a sequence's end is decided by


@dataclass
class Function:
    where: str  # path:qualname
    path: str
    node: ast.AST


class Module:
    """One source file: its functions and methods by name, and the names it imports from the other files."""

    def __init__(self, path: str, text: str, paths: set[str]):
        self.path, self.tree = path, ast.parse(text)
        self.functions: dict[str, list[Function]] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # alias -> (path, name)
        self._collect(self.tree, "")
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                source = node.module.replace(".", "/") + ".py"
                if source in paths:
                    self.imported.update({a.asname or a.name: (source, a.name) for a in node.names})

    def _collect(self, node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    function = Function(f"{self.path}:{prefix}{child.name}", self.path, child)
                    self.functions.setdefault(child.name, []).append(function)
                self._collect(child, f"{prefix}{child.name}.")
            else:
                self._collect(child, prefix)


def calls(node: ast.AST) -> list[ast.Call]:
    return [sub for sub in ast.walk(node) if isinstance(sub, ast.Call)]


def decides_ends(node: ast.AST) -> bool:
    """Whether ``node`` compares anything against one of ENDS (``t in eos_ids``, ``len(x) >= max_new_tokens``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare):
            for part in ast.walk(sub):
                if (part.attr if isinstance(part, ast.Attribute) else getattr(part, "id", None)) in ENDS:
                    return True
    return False


class Reach:
    """What a call may run: an engine call (an attribute call named in ENGINE_CALLS), or the functions it names in
    its own module (a method of any class there, a function, one imported from another file), the scheduler's
    never entered (calling its step is using the one loop)."""

    def __init__(self, sources: dict[str, str]):
        self.modules = {path: Module(path, text, set(sources)) for path, text in sources.items()}
        self.memo: dict[tuple[str, str], tuple[bool, bool]] = {}

    def targets(self, module: Module, call: ast.Call) -> list[Function]:
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        found = list(module.functions.get(name, []))
        if isinstance(func, ast.Name) and name in module.imported:
            path, original = module.imported[name]
            found += self.modules[path].functions.get(original, [])
        return [f for f in found if f.path != SCHEDULER]

    def of_nodes(self, module: Module, nodes: list[ast.AST]) -> tuple[bool, bool]:
        """(calls an engine, decides a sequence's end), for code in ``module``, through what it calls."""
        engine = ends = False
        for node in nodes:
            ends = ends or decides_ends(node)
            for call in calls(node):
                func = call.func
                engine = engine or (isinstance(func, ast.Attribute) and func.attr in ENGINE_CALLS)
                for target in self.targets(module, call):
                    e, d = self.of_function(target)
                    engine, ends = engine or e, ends or d
        return engine, ends

    def of_function(self, function: Function) -> tuple[bool, bool]:
        key = (function.where, "")
        if key not in self.memo:
            self.memo[key] = (False, False)  # a cycle adds nothing
            self.memo[key] = self.of_nodes(self.modules[function.path], [function.node])
        return self.memo[key]


def loops(node: ast.AST) -> list[ast.AST]:
    """The loops written in a function (not in the functions it defines): their bodies run again and again."""
    out, stack = [], list(ast.iter_child_nodes(node))
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(
            sub, (ast.While, ast.For, ast.AsyncFor, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        ):
            out.append(sub)
        stack.extend(ast.iter_child_nodes(sub))
    return out


def repeated(loop: ast.AST) -> list[ast.AST]:
    """The parts of a loop that run at every turn (a ``for``'s iterable is evaluated once)."""
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        return loop.body + loop.orelse
    if isinstance(loop, ast.While):
        return [loop.test, *loop.body]
    return [loop]


def decoding_loops(sources: dict[str, str]) -> set[str]:
    """path:qualname of every function outside the scheduler with a decoding loop (see the module docstring)."""
    reach = Reach(sources)
    out = set()
    for module in reach.modules.values():
        if module.path == SCHEDULER:
            continue
        for functions in module.functions.values():
            for function in functions:
                if any(all(reach.of_nodes(module, repeated(loop))) for loop in loops(function.node)):
                    out.add(function.where)
    return out


def package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text(encoding="utf-8")
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def test_the_scheduler_runs_the_only_decoding_loop_but_the_teachers():
    assert decoding_loops(package_sources()) == {TEACHER}, (
        "a second decoding loop: decode through the scheduler (runtime/core/scheduler.py), whose step calls every "
        "engine (runtime/engines/base.py: one that returns logits, or tokens: TensorRT-LLM's)"
    )


# the runtime's own second loop (runtime/trtllm/engine.py) before TensorRT-LLM's engines came under the scheduler,
# cut to its shape
OLD_TENSORRT_LLM_LOOP = """
class ExecutorSession:
    def generate(self, histories, max_tokens, drafts=None):
        ids = self.executor.enqueue_requests(requests)
        while len(done) < len(ids):
            for response in self.executor.await_responses():
                done[response.request_id] = response


class ExternalDraftGenerator:
    def generate(self, prompts, max_new_tokens=128, k=None):
        rows = [_Row(self._encode(p), max_new_tokens) for p in prompts]
        while any(not row.finished for row in rows):
            self._step([row for row in rows if not row.finished], k)

    def _step(self, rows, k):
        proposed = self.draft.generate(histories, lengths)
        outputs = self.target.generate(histories, lengths, drafts)
        for row, new in zip(rows, outputs):
            row.take(new, self.eos_ids)


class _Row:
    def take(self, new, eos_ids):
        stop = next((i for i, t in enumerate(new) if t in eos_ids), None)
"""


def test_the_scan_finds_a_second_loop_like_the_one_tensorrt_llm_had():
    found = decoding_loops({"runtime/trtllm/engine.py": OLD_TENSORRT_LLM_LOOP})
    assert found == {"runtime/trtllm/engine.py:ExternalDraftGenerator.generate"}


def test_the_scan_finds_a_loop_that_drives_the_decode_step_outside_the_scheduler():
    sources = {
        "runtime/decoding/step.py": (ROOT / "runtime/decoding/step.py").read_text(encoding="utf-8"),
        "runtime/decoding/calls.py": (ROOT / "runtime/decoding/calls.py").read_text(encoding="utf-8"),
        "runtime/own_loop.py": (
            "from runtime.decoding.step import decode_step\n\n\n"
            "def run(target, cache, rows, groups, plan):\n"
            "    while rows:\n"
            "        decode_step(target, cache, rows, groups, plan)\n"
        ),
    }
    assert decoding_loops(sources) == {"runtime/own_loop.py:run"}
