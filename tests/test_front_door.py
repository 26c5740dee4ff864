"""The front door is one call for every caller (runtime/core/request.py ``FrontDoor.admit``): no module calls its
parts, every caller makes the call, and what the call owns (the order of its checks, the room, the refusals in the
protocol's names, token-id prompts, Triton's ``preprocessing`` on the same path) holds."""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.core.handles import Overloaded
from runtime.core.request import Asked, FrontDoor, Limits, decode_request
from runtime.errors import RequestError

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runtime", "triton_repo", "bench", "builder", "deploy", "scripts", "tests")
DOOR = "runtime/core/request.py"
# the door's steps, each a public method once, called in an order each caller chose; ``check_room`` is the
# scheduler's, which only the door asks now (its ``room``)
PARTS = {"checked", "check_room", "compile", "admit_tokens", "refusal", "check_tokens", "decode_config", "tokenize"}
CALLERS = (  # every module that admits requests: each makes the one call
    "runtime/api.py",
    "runtime/serving/openai_server.py",
    "triton_repo/models/speculative.py",
    "bench/sweep.py",
    "builder/draft_choice.py",
    "tests/door_path.py",
)


def _modules():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative != DOOR and ".venv" not in path.parts:
                yield relative, ast.parse(path.read_text(), relative)


def _is_door(node: ast.AST) -> bool:
    """``door`` or ``<anything>.door``: a front door, by the one name every caller gives it."""
    named = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return named == "door"


def _door_uses(tree: ast.AST) -> list[str]:
    """The attributes read on a front door in ``tree`` (called or handed on, as a server hands ``door.admit`` to a
    pool)."""
    return [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_door(node.value)]


def _part_calls(tree: ast.AST) -> list[str]:
    """Calls of a former door step anywhere (``x.check_room()``), or of anything on a door but ``admit``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if _is_door(node.func.value) and name != "admit":
                found.append(name)
            elif name in PARTS - {"compile"}:  # re.compile and a grammar compiler's are not the door's
                found.append(name)
    return found


def test_no_module_calls_the_doors_parts():
    """Outside runtime/core/request.py nothing calls a step of the door (nor ``check_room``): the door owns the
    order, a caller only chooses where the one call runs."""
    offenders = {path: calls for path, tree in _modules() if (calls := _part_calls(tree))}
    assert not offenders


def test_every_caller_makes_the_one_call():
    """Each module that admits requests uses ``door.admit`` and nothing else of the door."""
    trees = dict(_modules())
    for path in CALLERS:
        assert set(_door_uses(trees[path])) == {"admit"}, path
    public = {name for name in vars(FrontDoor) if not name.startswith("_")}
    assert public == {"admit"}


def test_the_ast_check_sees_a_part_called():
    tree = ast.parse("door.compile(request)\nscheduler.check_room()\nself.door.tokenize(p, False)\nre.compile('x')")
    assert _part_calls(tree) == ["compile", "check_room", "tokenize"]


# --- what the one call owns --------------------------------------------------------------------------------------


def _server_door(generator, room=None) -> FrontDoor:
    return FrontDoor(generator, Limits.for_context(generator.max_context), room=room)


def test_a_refusal_is_in_the_protocols_names_and_a_servers_is_counted(generator):
    names = {"max_new_tokens": "max_tokens", "k": "num_draft_tokens"}
    before = generator.metrics.refused
    with pytest.raises(RequestError) as raised:
        _server_door(generator).admit(Asked(["hi"], {"max_new_tokens": 0}, names=names))
    assert raised.value.field == "max_tokens" and str(raised.value).startswith("max_tokens: expected an integer")
    assert generator.metrics.refused == before + 1
    with pytest.raises(RequestError, match="^num_draft_tokens: expected an integer in"):
        _server_door(generator).admit(Asked(["hi"], {"max_new_tokens": 4, "k": 10**6}, names=names))
    with pytest.raises(RequestError, match="^k: "):  # the Python API's door: its own names, nothing counted
        generator.door.admit(Asked(["hi"], {"k": 10**6}))
    assert generator.metrics.refused == before + 2


def test_the_room_is_asked_after_the_checks_and_before_any_work(generator, monkeypatch):
    """A full queue refuses a good request before its tokenizing (Overloaded, as it is: not the request's fault,
    not counted as a refusal); a bad one is refused for what it is first."""
    calls = []
    monkeypatch.setattr(generator.tokenizer, "encode", lambda *a: calls.append(a) or [1, 2])

    def full():
        raise Overloaded("overloaded: retry later")

    door = _server_door(generator, room=full)
    with pytest.raises(RequestError, match="max_new_tokens") as raised:
        door.admit(Asked(["hi"], {"max_new_tokens": 0}))
    assert not isinstance(raised.value, Overloaded)
    before = generator.metrics.refused
    with pytest.raises(Overloaded):
        door.admit(Asked(["hi"], {"max_new_tokens": 4}))
    assert not calls and generator.metrics.refused == before


def test_token_id_prompts_take_the_same_call(generator):
    """The bench's prompts (ids and a DecodeRequest) and Triton's (text bounded by its size, ids from
    ``preprocessing``): checked as ids, the text not tokenized again."""
    request = decode_request(max_new_tokens=4, k=2)
    admitted = generator.door.admit(Asked.tokenized([[1, 2, 3], [4, 5]], request))
    assert admitted.prompts == [[1, 2, 3], [4, 5]] and admitted.config.k == 2
    with pytest.raises(RequestError, match="^prompt: token ids must be in"):
        generator.door.admit(Asked.tokenized([[generator.target.vocab_size]], request))
    triton = Asked(["not tokenized"], {"max_new_tokens": 4}, tokens=[[7, 8]])
    assert _server_door(generator).admit(triton).prompts == [[7, 8]]


def _fake_backend() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.get_input_tensor_by_name = lambda request, name: request.get(name)
    pb.TritonError = lambda message: SimpleNamespace(message=message)
    pb.InferenceResponse = lambda output_tensors, error=None: SimpleNamespace(outputs=output_tensors, error=error)
    pb.Tensor = lambda name, array: SimpleNamespace(name=name, array=array)
    return pb


def _tensor(value, dtype) -> SimpleNamespace:
    return SimpleNamespace(as_numpy=lambda: np.array([[value]], dtype=dtype))


def test_tritons_preprocessing_refuses_as_the_door_does(generator, monkeypatch):
    """``preprocessing`` tokenizes on the door's own path: each prompt it refuses, the ``speculative`` model's door
    refuses with the same words; a good one gets the ids the door makes."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_backend())
    spec = importlib.util.spec_from_file_location("preprocessing_model", ROOT / "triton_repo/models/preprocessing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    limits = Limits(64, 1 << 20)
    model.tokenizer, model.max_context, model.limits = generator.tokenizer, generator.max_context, limits
    door = FrontDoor(generator, limits)
    long = "for i in range(10): print(i * i)\n" * 40
    assert len(generator.tokenizer.encode(long)) >= generator.max_context
    for prompt in (b"", b"\xff\xfe", long.encode()):
        request = {"text_input": _tensor(prompt, object), "max_tokens": _tensor(4, np.int32)}
        (response,) = model.execute([request])
        with pytest.raises(RequestError) as raised:
            door.admit(Asked([prompt], {"max_new_tokens": 4}, names={"prompt": "text_input"}, form="input '{}'"))
        assert response.error.message == str(raised.value), prompt
    (response,) = model.execute([{"text_input": _tensor(b"hello there", object), "max_tokens": _tensor(4, np.int32)}])
    assert response.error is None
    ids = response.outputs[0].array.reshape(-1).tolist()
    assert ids == generator.door.admit(Asked(["hello there"], {"max_new_tokens": 4})).prompts[0]
