"""``draftsmith deploy kubernetes``: manifests valid against Kubernetes' own schemas (kubernetes-validate, offline,
strict: unknown fields are errors) for every option combination and every release from 1.30 to the newest the
package carries; sizing from the bundle and the measurement; the tensorrt_llm GPU count and launch command."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest

from fakes import fake_gpu_runner
import yaml
from click.testing import CliRunner

kv = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils  # noqa: E402

from runtime.bundle import load_manifest  # noqa: E402
from triton_repo.deploy import (AUTOSCALERS, BUNDLE_SOURCES, SERVERS, DeployError, DeployOptions,  # noqa: E402
                                Measured, kv_cache_mib, manifests, max_tokens_allowed, measure, write_manifests)

FIRST = (1, 30)
VERSIONS = sorted({v for v in kv_utils.all_versions() if tuple(map(int, v.split(".")[:2])) >= FIRST},
                  key=lambda v: tuple(map(int, v.split("."))))
GIVEN = Measured(load_s=4.0, rss_mib=300.0, tokens_per_s=40.0, how="given")


@pytest.fixture(scope="module", autouse=True)
def cached_schemas():
    """kubernetes_validate reads its JSON schema files on every call; the same files, read once."""
    original = kv_utils.schema_contents
    kv_utils.schema_contents = functools.lru_cache(maxsize=None)(original)
    yield
    kv_utils.schema_contents = original


@pytest.fixture(scope="module", params=["engine", "llmapi"])
def trt_bundle(request, tiny_pair, tmp_path_factory) -> Path:
    """A tensorrt_llm bundle with tp 2 x pp 2, built without a GPU (the engine steps faked)."""
    from builder.trtllm import build as trtllm
    from runtime.bundle import BuildSpec
    target, draft = tiny_pair
    spec = BuildSpec(target=str(target), draft=str(draft), target_quant="fp16", draft_quant="fp16", k=3, max_k=6,
                     max_context=128, backend="tensorrt_llm", device="cuda", trtllm_flavor=request.param,
                     tp_size=2, pp_size=2)
    out = tmp_path_factory.mktemp("trt-deploy") / "bundle"
    trtllm.build(spec, out, runner=fake_gpu_runner, version="1.2.1", gpus=4, examples_dir=str(out.parent),
                 available=lambda name: True)
    return out


def validate_all(objects: dict[str, dict]) -> None:
    """Every object against every release's strict schema; the schema used must be that release's own."""
    for name, document in objects.items():
        for version in VERSIONS:
            try:
                used = kv.validate(document, version, strict=True)
            except kv.ValidationError as err:
                raise AssertionError(f"{name} invalid for Kubernetes {version}: {err.message} at "
                                     f"{'.'.join(map(str, err.path))}") from None
            assert used == kv_utils.major_minor(version), (name, version, used)


def test_the_schemas_cover_1_30_to_the_newest():
    assert VERSIONS[0].startswith("1.30") and len(VERSIONS) >= 2
    assert kv_utils.major_minor(VERSIONS[-1]) == kv_utils.major_minor(kv_utils.latest_version())


@pytest.mark.parametrize("server,source,autoscale", list(itertools.product(SERVERS, BUNDLE_SOURCES, AUTOSCALERS)))
def test_onnx_bundle_manifests_validate_for_every_release(tiny_bundle, server, source, autoscale):
    options = DeployOptions(server=server, bundle_source=source, autoscale=autoscale, bundle_image="reg/bundle:1",
                            api_key_secret="draftsmith-key" if server == "openai" else "")
    validate_all(manifests(tiny_bundle, options, GIVEN))


@pytest.mark.parametrize("server,source", list(itertools.product(SERVERS, BUNDLE_SOURCES)))
def test_trtllm_bundle_manifests_validate_for_every_release(trt_bundle, server, source):
    objects = manifests(trt_bundle, DeployOptions(server=server, bundle_source=source, bundle_image="reg/b:1"),
                        GIVEN)
    validate_all(objects)
    pod = objects["deployment.yaml"]["spec"]["template"]["spec"]
    server_container = pod["containers"][0]
    assert server_container["resources"]["limits"]["nvidia.com/gpu"] == 4  # tp 2 x pp 2
    command = server_container["command"]
    if server == "triton":
        assert command[:4] == ["mpirun", "--allow-run-as-root", "-n", "1"]
        assert command[4].endswith("tritonserver") and "--model-repository=/work/repo" in command
        grace = pod["terminationGracePeriodSeconds"]
        exit_timeout = int(next(a for a in command if a.startswith("--exit-timeout-secs=")).split("=")[1])
        assert exit_timeout < grace
        flavor = load_manifest(trt_bundle).spec.trtllm_flavor
        env = {e["name"]: e.get("value") for e in server_container["env"]}
        assert (env.get("TRTLLM_ORCHESTRATOR") == "1") == (flavor == "engine")  # two engines: orchestrator mode
        assert pod["initContainers"][-1]["name"] == "triton-repo"
    else:
        assert command[:3] == ["draftsmith", "serve-openai", "/bundle"]


def test_a_misspelt_field_is_caught_by_the_strict_schema(tiny_bundle):
    """The check can fail: an unknown field, and a wrong type, are refused."""
    deployment = manifests(tiny_bundle, DeployOptions(), GIVEN)["deployment.yaml"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, VERSIONS[0], strict=True)
    container["readinessProbe"] = container.pop("readinesProbe")
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, VERSIONS[0], strict=True)


def _server(objects: dict) -> tuple[dict, dict]:
    pod = objects["deployment.yaml"]["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_openai_probes_grace_and_resources_follow_the_bundle_and_the_measurement(tiny_bundle):
    options = DeployOptions(threads=3, max_batch=4, drain_linger=5)
    slow = Measured(load_s=20.0, rss_mib=500.0, tokens_per_s=8.0, how="given")
    pod, container = _server(manifests(tiny_bundle, options, slow))
    manifest = load_manifest(tiny_bundle)
    longest = max_tokens_allowed(manifest, "openai")
    assert longest == manifest.max_context - 1
    drain = float(_flag(container["command"], "--drain-timeout"))
    assert drain >= longest / (8.0 / 4) + 5  # the longest request at a full batch's per-row speed, and the linger
    assert pod["terminationGracePeriodSeconds"] > drain
    assert float(_flag(container["command"], "--request-timeout")) <= drain - 5  # no request outlives the drain
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3 * 20.0  # three times the load time
    requests = container["resources"]["requests"]
    assert requests["cpu"] == "3250m" and _flag(container["command"], "--threads") == "3"
    assert int(requests["memory"].removesuffix("Mi")) >= 500 + kv_cache_mib(manifest, 4)
    assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}["/bundle"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_triton_serves_a_repository_written_at_pod_start(tiny_bundle):
    options = DeployOptions(server="triton", bundle_source="image", bundle_image="reg/bundle:1")
    pod, container = _server(manifests(tiny_bundle, options, GIVEN))
    assert [c["name"] for c in pod["initContainers"]] == ["copy-bundle", "triton-repo"]
    assert pod["initContainers"][1]["command"][:5] == ["draftsmith", "triton-repo", "/bundle", "/work/repo",
                                                       "--bundle-mount"]
    assert container["command"][:3] == ["draftsmith", "serve", "/work/repo"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/models/ensemble/ready"  # a drain unloads it
    assert int(_flag(container["command"], "--exit-timeout")) < pod["terminationGracePeriodSeconds"]
    longest = max_tokens_allowed(load_manifest(tiny_bundle), "triton")
    assert int(_flag(container["command"], "--exit-timeout")) >= longest / (GIVEN.tokens_per_s / options.max_batch)


def test_queue_autoscaler_names_each_servers_gauge(tiny_bundle):
    openai = manifests(tiny_bundle, DeployOptions(), GIVEN)["hpa-queue.yaml"]
    triton = manifests(tiny_bundle, DeployOptions(server="triton"), GIVEN)["hpa-queue.yaml"]
    assert openai["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert triton["spec"]["metrics"][0]["pods"]["metric"]["name"] == "draftsmith_waiting"


def test_bad_options_are_refused_by_name():
    with pytest.raises(DeployError, match="server: expected one of") as info:
        DeployOptions(server="nginx", replicas=0, bundle_source="image")
    assert "replicas: expected an integer >= 1" in str(info.value) and "bundle_image" in str(info.value)
    with pytest.raises(DeployError, match="name: expected a DNS label"):
        DeployOptions(name="Draft_Smith")


def test_command_writes_a_kustomization_and_refuses_to_overwrite(tiny_bundle, tmp_path):
    from runtime.cli import main
    out = tmp_path / "k8s"
    args = ["deploy", "kubernetes", str(tiny_bundle), "--out", str(out), "--autoscale", "queue",
            "--load-seconds", "3", "--memory-mib", "200", "--tokens-per-second", "50"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["deployment.yaml", "service.yaml", "pdb.yaml", "hpa-queue.yaml"]
    assert "vllm:num_requests_waiting" in (out / "hpa-queue.yaml").read_text()  # the adapter rule's series
    for name in kustomization["resources"]:
        assert "&id" not in (out / name).read_text()  # no YAML anchors
        validate_all({name: yaml.safe_load((out / name).read_text())})
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "--overwrite" in again.output


def test_measure_loads_the_bundle_in_a_child(tiny_bundle, tmp_path):
    figures = measure(tiny_bundle, threads=1, max_batch=2)
    assert figures.how == "measured" and figures.load_s > 0 and figures.tokens_per_s > 0
    assert 20 < figures.rss_mib < 4096
    objects = write_manifests(tiny_bundle, tmp_path / "out", DeployOptions(threads=1))  # measures itself
    sizing = json.loads(objects["deployment.yaml"]["metadata"]["annotations"]["draftsmith/sizing"])
    assert sizing["how"] == "measured" and sizing["memory_request_mib"] > sizing["rss_mib"]


def test_a_trtllm_bundle_is_estimated_not_loaded(trt_bundle):
    """No GPU here: the figures come from the bundle's size, and say so."""
    objects = manifests(trt_bundle, DeployOptions(server="triton"))
    sizing = json.loads(objects["deployment.yaml"]["metadata"]["annotations"]["draftsmith/sizing"])
    assert sizing["how"].startswith("estimated") and sizing["gpus"] == 4 and sizing["load_s"] >= 120
