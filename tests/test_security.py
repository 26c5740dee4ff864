"""Security review, one test per claim: no pickle or code execution from user files, nothing escapes the repository,
loopback by default, no build-machine paths or secrets in the repository, dependencies without known advisories.

Already covered elsewhere (not repeated): pickled weights refused without --allow-pickle and remote code without
--trust-remote-code, tampered bundles refused, no build-machine paths in the bundle (tests/test_builder.py); model
names with '../', '/', odd characters refused (tests/test_triton_repo.py::test_check_name_rejects); the running
server's sockets on 127.0.0.1 (tests/test_triton_server_faults.py::test_server_sockets_bind_loopback_only);
the OpenAI server's Host names, API key and loopback addresses (tests/test_server_addresses.py).
"""

from __future__ import annotations

import ast
import inspect
import os
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_repo import pbtxt
from triton_repo.generate import RepoOptions, RepositoryError, _inside, check_name, write_repository

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("bench", "builder", "runtime", "triton_repo", "scripts", "tests")


# --- nothing escapes the repository -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_accepted_model_name_is_one_harmless_path_component(name):
    try:
        check_name(name)
    except RepositoryError:
        return
    assert name not in (".", "..") and ".." not in name
    assert not any(c in name for c in "/\\\0\n\r\t :*?\"'<>|$`")
    assert Path(name).name == name and not os.path.isabs(name)


@pytest.mark.parametrize(
    "name",
    ["a\0b", "ｅnsemble", "tab\there", "..hidden", "x/..", "C:\\x", "~root", "$HOME", "name;rm -rf", "ensemble\r"],
)
def test_more_odd_model_names_are_refused(name):
    with pytest.raises(RepositoryError):
        check_name(name)


def test_a_symbolic_link_cannot_lead_out_of_the_repository(tmp_path):
    root, outside = tmp_path / "repo", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(RepositoryError, match="escapes"):
        _inside(root, "link/config.pbtxt")


@pytest.mark.parametrize("mount", ['/b/x"\nbackend: "evil', '/b/x\n}\nname: "other', "/b/\\x"])
def test_a_hostile_bundle_mount_cannot_inject_config(tiny_bundle, mount):
    """Quotes and newlines in a user-chosen path are escaped by protobuf's printer: they stay one string value."""
    from runtime.bundle import load_manifest
    from triton_repo.generate import speculative_config

    options = RepoOptions(bundle_mount=mount, copy_bundle=False)
    config = pbtxt.parse(pbtxt.render(speculative_config(options, load_manifest(tiny_bundle), mount)))
    assert config.parameters["bundle"].string_value == mount
    assert config.name == "speculative" and config.backend == "python"


def test_written_repository_stays_inside_its_folder(tiny_bundle, tmp_path):
    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(threads=1))
    for path in repo.rglob("*"):
        assert path.resolve().is_relative_to(repo.resolve()), path
        assert not path.is_symlink(), path  # the default copies (hard links), nothing points elsewhere


# --- loopback by default ----------------------------------------------------------------------------------------


def test_servers_bind_loopback_by_default():
    from triton_repo.cli import serve
    from triton_repo.server import server_command, start_server

    assert inspect.signature(start_server).parameters["host"].default == "127.0.0.1"
    host = next(p for p in serve.params if p.name == "host")
    assert host.default == "127.0.0.1"
    fake = Path("/nonexistent")
    try:
        command = server_command(fake, fake, "127.0.0.1", 1, 2, 3)
    except Exception:  # noqa: BLE001 - no tritonserver here: the flags are still checked by the source below
        command = None
    if command is not None:
        for flag in ("--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"):
            assert flag in command
    source = inspect.getsource(server_command)
    assert all(f"--{kind}-address={{host}}" in source for kind in ("http", "grpc", "metrics"))


def test_load_command_starts_its_server_on_loopback():
    from bench import load

    source = inspect.getsource(load.load.callback)
    assert "start_server(repo)" in source  # the default host: 127.0.0.1
    assert "0.0.0.0" not in inspect.getsource(load)


# --- no build-machine paths or secrets in the repository --------------------------------------------------------


def _text_files(repo: Path):
    for path in repo.rglob("*"):
        if path.is_file() and "bundle" not in path.relative_to(repo).parts:  # the bundle: tests/test_builder.py
            yield path, path.read_text(encoding="utf-8", errors="replace")


def test_no_build_machine_paths_or_secrets_in_the_repository(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRETshouldneverleak123")
    repo = write_repository(tiny_bundle, tmp_path / "repo", RepoOptions(threads=1))
    forbidden = [
        str(tmp_path),
        str(tiny_bundle),
        str(tiny_bundle.resolve()),
        str(Path.home()),
        str(ROOT),
        "hf_SECRETshouldneverleak123",
    ]
    for path, text in _text_files(repo):
        for needle in forbidden:
            assert needle not in text, f"{path.relative_to(repo)} contains {needle!r}"
    for name in ("preprocessing", "speculative", "postprocessing", "ensemble"):
        config = pbtxt.parse((repo / name / "config.pbtxt").read_text())
        for key, value in config.parameters.items():
            assert not value.string_value.startswith("/"), (name, key, value.string_value)


def test_only_the_chosen_mount_path_is_absolute(tiny_bundle, tmp_path):
    repo = write_repository(
        tiny_bundle, tmp_path / "repo", RepoOptions(bundle_mount="/bundles/tiny", copy_bundle=False)
    )
    for name in ("preprocessing", "speculative", "postprocessing", "ensemble"):
        config = pbtxt.parse((repo / name / "config.pbtxt").read_text())
        for key, value in config.parameters.items():
            if value.string_value.startswith("/"):
                assert value.string_value.startswith("/bundles/tiny"), (name, key, value.string_value)
    for path, text in _text_files(repo):
        assert str(tmp_path) not in text and str(tiny_bundle) not in text, path


# --- no pickle, no code from data -------------------------------------------------------------------------------


def _python_files():
    for folder in SOURCE_DIRS:
        yield from (ROOT / folder).rglob("*.py")
    yield from ROOT.glob("*.py")


def _unsafe_calls(tree: ast.AST) -> list[str]:
    """Calls that deserialize with pickle or run code from data."""
    found = []
    unsafe_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {n}" for n in names if n.split(".")[0] in unsafe_modules]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        keywords = {k.arg: k.value for k in node.keywords}

        def is_true(key, keywords=keywords):
            return isinstance(keywords.get(key), ast.Constant) and keywords[key].value is True

        if owner == "torch" and name == "load" and not is_true("weights_only"):
            found.append("torch.load without weights_only=True")
        if owner in ("np", "numpy") and name == "load" and is_true("allow_pickle"):
            found.append("np.load(allow_pickle=True)")
        if owner == "yaml" and (
            name in ("unsafe_load", "full_load", "unsafe_load_all")
            or (name == "load" and "Loader" not in keywords and len(node.args) < 2)
        ):
            found.append(f"yaml.{name} (not safe_load)")
        if isinstance(func, ast.Name) and name in ("eval", "exec"):
            found.append(f"builtin {name}()")
        if is_true("trust_remote_code"):
            found.append("trust_remote_code=True hard-coded")
        if is_true("shell"):
            found.append("subprocess with shell=True")
    return found


def test_no_pickle_or_code_execution_in_the_code_base():
    files = list(_python_files())
    assert len(files) > 20
    problems = {}
    for path in files:
        calls = _unsafe_calls(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        if calls:
            problems[str(path.relative_to(ROOT))] = calls
    assert not problems, problems


def test_the_scan_finds_what_it_looks_for():
    bad = (
        "import pickle\ntorch.load(f)\ntorch.load(f, weights_only=False)\nnp.load(f, allow_pickle=True)\n"
        "yaml.load(s)\neval(s)\nm(trust_remote_code=True)\nsubprocess.run(c, shell=True)\n"
    )
    assert len(_unsafe_calls(ast.parse(bad))) == 8
    good = "torch.load(f, weights_only=True)\nyaml.safe_load(s)\nmodel.eval()\nnp.load(f)\n"
    assert _unsafe_calls(ast.parse(good)) == []


# --- dependencies -----------------------------------------------------------------------------------------------

# package -> (first version without the advisories below, what they were). Checked against public advisories
# (GitHub/NVD); a package missing here had no advisory affecting the installed line that we could find.
FIXED_IN = {
    "torch": ("2.6.0", "CVE-2025-32434: torch.load(weights_only=True) could still run code"),
    "transformers": ("4.53.0", "CVE-2024-11392/3/4 deserialization; 2025 ReDoS advisories"),
    "jinja2": ("3.1.6", "CVE-2025-27516 sandbox escape via |attr (chat templates are Jinja)"),
    "urllib3": ("2.5.0", "CVE-2025-50181/50182 redirect handling"),
    "requests": ("2.32.4", "CVE-2024-47081 .netrc credential leak"),
    "protobuf": ("4.25.8", "CVE-2025-4565 recursion DoS in the pure-Python parser (fixed 4.25.8/5.29.5/6.31.1)"),
    "aiohttp": ("3.12.14", "CVE-2025-53643 request smuggling"),
    "onnx": ("1.17.0", "CVE-2024-5187 path traversal in external data / tar extraction"),
    "pyyaml": ("5.4", "CVE-2020-14343 full_load code execution"),
    "grpcio": ("1.53.2", "CVE-2023-4785/33953 DoS"),
    "numpy": ("1.22.0", "CVE-2021-41495/41496"),
}


def _version(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


@pytest.mark.parametrize("package", sorted(FIXED_IN))
def test_installed_dependency_has_no_known_advisory(package):
    try:
        installed = metadata.version(package)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{package} is not installed")
    fixed, what = FIXED_IN[package]
    if package == "protobuf" and _version(installed)[0] == 5:
        fixed = "5.29.5"
    if package == "protobuf" and _version(installed)[0] >= 6:
        fixed = "6.31.1"
    assert _version(installed) >= _version(fixed), f"{package} {installed} < {fixed}: {what}"


def test_bundled_tritonserver_advisories_are_documented():
    """nvidia-pytriton <= 0.7.0 ships tritonserver 2.51.0, before the fixes of NVIDIA's August 2025 bulletin
    (CVE-2025-23310/23311 HTTP chunked-encoding stack overflow; CVE-2025-23319/23320/23334 Python backend shared
    memory chain; fixed in 2.59.1 / 25.07). No newer wheel exists; the mitigation (loopback only, restricted
    shared-memory and repository APIs, the NGC container for production) must be written down."""
    try:
        installed = metadata.version("nvidia-pytriton")
    except metadata.PackageNotFoundError:
        pytest.skip("nvidia-pytriton is not installed")
    if _version(installed) > (0, 7, 0):
        pytest.skip("a newer nvidia-pytriton: check its tritonserver version against the bulletin")
    text = (ROOT / "docs" / "operations.md").read_text()
    for needle in ("2.51", "CVE-2025-23319", "CVE-2025-23310", "127.0.0.1", "restricted-api"):
        assert needle in text, needle


def test_dependency_floors_exclude_the_advisories():
    import re
    from importlib.metadata import version
    from pathlib import Path

    text = Path(__file__).resolve().parents[1].joinpath("pyproject.toml").read_text()
    serve = re.search(r"^serve = \[(.*)\]", text, re.M).group(1)
    floors = dict(re.findall(r'"([a-z0-9]+)>=([0-9.]+)', serve))
    assert tuple(map(int, floors["h11"].split("."))) >= (0, 16)
    assert tuple(map(int, floors["starlette"].split("."))) >= (0, 47, 2)
    for name, floor in floors.items():  # the environment the tests run in satisfies them
        have = tuple(int(p) for p in re.findall(r"\d+", version(name))[:3])
        assert have >= tuple(map(int, floor.split("."))), name
