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
from deploy.kubernetes import manifests, write_manifests  # noqa: E402
from deploy.options import AUTOSCALERS, BUNDLE_SOURCES, SERVERS, DeployError, DeployOptions  # noqa: E402
from deploy.sizing import Measured, kv_cache_mib, max_tokens_allowed, measure  # noqa: E402

FIRST = (1, 30)
VERSIONS = sorted(
    {v for v in kv_utils.all_versions() if tuple(map(int, v.split(".")[:2])) >= FIRST},
    key=lambda v: tuple(map(int, v.split("."))),
)
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
    spec = BuildSpec(
        target=str(target),
        draft=str(draft),
        target_quant="fp16",
        draft_quant="fp16",
        k=3,
        max_k=6,
        max_context=128,
        backend="tensorrt_llm",
        device="cuda",
        trtllm_flavor=request.param,
        tp_size=2,
        pp_size=2,
    )
    out = tmp_path_factory.mktemp("trt-deploy") / "bundle"
    trtllm.build(
        spec,
        out,
        runner=fake_gpu_runner,
        version="1.2.1",
        gpus=4,
        examples_dir=str(out.parent),
        available=lambda name: True,
    )
    return out


def validate_all(objects: dict[str, dict]) -> None:
    """Every object against every release's strict schema; the schema used must be that release's own."""
    for name, document in objects.items():
        for version in VERSIONS:
            try:
                used = kv.validate(document, version, strict=True)
            except kv.ValidationError as err:
                raise AssertionError(
                    f"{name} invalid for Kubernetes {version}: {err.message} at {'.'.join(map(str, err.path))}"
                ) from None
            assert used == kv_utils.major_minor(version), (name, version, used)


def test_the_schemas_cover_1_30_to_the_newest():
    assert VERSIONS[0].startswith("1.30") and len(VERSIONS) >= 2
    assert kv_utils.major_minor(VERSIONS[-1]) == kv_utils.major_minor(kv_utils.latest_version())


@pytest.mark.parametrize("source,autoscale,key", list(itertools.product(BUNDLE_SOURCES, AUTOSCALERS, ("", "k"))))
def test_onnx_bundle_manifests_validate_for_every_release(tiny_bundle, source, autoscale, key):
    options = DeployOptions(bundle_source=source, autoscale=autoscale, bundle_image="reg/bundle:1", api_key_secret=key)
    validate_all(manifests(tiny_bundle, options, GIVEN))


@pytest.mark.parametrize("server,source", list(itertools.product(SERVERS, BUNDLE_SOURCES)))
def test_trtllm_bundle_manifests_validate_for_every_release(trt_bundle, server, source):
    objects = manifests(trt_bundle, DeployOptions(server=server, bundle_source=source, bundle_image="reg/b:1"), GIVEN)
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
    longest = max_tokens_allowed(manifest)
    assert longest == manifest.max_context - 1
    drain = float(_flag(container["command"], "--drain-timeout"))
    assert drain >= longest / (8.0 / 4) + 5  # the longest request at a full batch's per-row speed, and the linger
    assert pod["terminationGracePeriodSeconds"] > drain
    assert float(_flag(container["command"], "--request-timeout")) <= drain - 5  # no request outlives the drain
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    # the probes have a port of their own, which idle client connections cannot starve (issue 38)
    health = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert _flag(container["command"], "--health-port") == str(health)
    assert {container[p]["httpGet"]["port"] for p in ("readinessProbe", "livenessProbe", "startupProbe")} == {"health"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3 * 20.0  # three times the load time
    requests = container["resources"]["requests"]
    assert requests["cpu"] == "3250m" and _flag(container["command"], "--threads") == "3"
    assert int(requests["memory"].removesuffix("Mi")) >= 500 + kv_cache_mib(manifest, 4)
    assert {m["mountPath"]: m.get("readOnly", False) for m in container["volumeMounts"]}["/bundle"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_queue_autoscaler_names_each_servers_gauge(tiny_bundle, trt_bundle):
    openai = manifests(tiny_bundle, DeployOptions(), GIVEN)["hpa-queue.yaml"]
    triton = manifests(trt_bundle, DeployOptions(server="triton"), GIVEN)["hpa-queue.yaml"]
    assert openai["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert triton["spec"]["metrics"][0]["pods"]["metric"]["name"] == "nv_inference_pending_request_count"


# --- issue 38: nothing generated exposes a known-vulnerable endpoint, a root pod, an open network or a key in env ---


def test_triton_on_an_onnx_bundle_is_refused_with_the_reason_and_the_alternative(tiny_bundle, tmp_path):
    """The CPU image's tritonserver is 2.51 (nvidia-pytriton 0.7.0), with unauthenticated crash/RCE CVEs: a pod
    serving it on 0.0.0.0 is what docs/operations.md says must never face a network."""
    with pytest.raises(DeployError, match=r"2\.51.*CVE-2025-23310.*--server openai"):
        manifests(tiny_bundle, DeployOptions(server="triton"), GIVEN)
    from runtime.cli import main

    out = tmp_path / "k8s"
    result = CliRunner().invoke(
        main,
        [
            "deploy",
            "kubernetes",
            str(tiny_bundle),
            "--out",
            str(out),
            "--server",
            "triton",
            "--load-seconds",
            "3",
            "--memory-mib",
            "200",
            "--tokens-per-second",
            "50",
        ],
    )
    assert result.exit_code != 0 and "--server openai" in result.output and not out.exists()


VULNERABLE_TRITON_IMAGES = [
    "nvcr.io/nvidia/tritonserver:24.10-trtllm-python-py3",
    "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3",
    "nvcr.io/nvidia/tritonserver:23.12-py3",
    "nvcr.io/nvidia/tritonserver:25.01-trtllm-python-py3",
]


@pytest.mark.parametrize("image", VULNERABLE_TRITON_IMAGES)
def test_a_triton_release_before_the_cve_fixes_is_refused(trt_bundle, image):
    with pytest.raises(DeployError, match="25.07"):
        manifests(trt_bundle, DeployOptions(server="triton", triton_image=image), GIVEN)
    manifests(trt_bundle, DeployOptions(server="triton", triton_image=image.replace(image[28:33], "25.07")), GIVEN)


def _all_pods(tiny_bundle, trt_bundle):
    for bundle, server in ((tiny_bundle, "openai"), (trt_bundle, "openai"), (trt_bundle, "triton")):
        for source in BUNDLE_SOURCES:
            options = DeployOptions(server=server, bundle_source=source, bundle_image="reg/b:1")
            yield manifests(bundle, options, GIVEN)


def test_every_pod_runs_restricted_without_a_service_account_token(tiny_bundle, trt_bundle):
    """Pod Security "restricted" for every pod, the TensorRT-LLM Triton one included (it ran as root)."""
    for objects in _all_pods(tiny_bundle, trt_bundle):
        pod = objects["deployment.yaml"]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True


def test_a_network_policy_admits_only_the_serving_ports_from_the_namespace(tiny_bundle, trt_bundle, tmp_path):
    for objects in _all_pods(tiny_bundle, trt_bundle):
        policy = objects["networkpolicy.yaml"]
        validate_all({"networkpolicy.yaml": policy})
        labels = objects["deployment.yaml"]["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"] == {"matchLabels": labels}
        assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"} and policy["spec"]["egress"] == []
        [rule] = policy["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {}}]
        ports = {p["port"] for p in rule["ports"]}
        service_ports = {p["targetPort"] for p in objects["service.yaml"]["spec"]["ports"]}
        assert ports == service_ports
    write_manifests(tiny_bundle, tmp_path, DeployOptions(), GIVEN)
    assert "networkpolicy.yaml" in yaml.safe_load((tmp_path / "kustomization.yaml").read_text())["resources"]


def test_the_api_key_comes_from_a_secret_file_and_no_key_is_said_loudly(tiny_bundle, tmp_path):
    pod, container = _server(manifests(tiny_bundle, DeployOptions(api_key_secret="my-key"), GIVEN))
    assert not any(e["name"] == "DRAFTSMITH_API_KEY" for e in container["env"])  # not in the environment
    volume = next(v for v in pod["volumes"] if v["name"] == "api-key")
    assert volume["secret"]["secretName"] == "my-key"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-key")
    assert mount["readOnly"] is True
    assert _flag(container["command"], "--api-key-file") == f"{mount['mountPath']}/DRAFTSMITH_API_KEY"
    from runtime.cli import main

    result = CliRunner().invoke(
        main,
        [
            "deploy",
            "kubernetes",
            str(tiny_bundle),
            "--out",
            str(tmp_path / "k"),
            "--load-seconds",
            "3",
            "--memory-mib",
            "200",
            "--tokens-per-second",
            "50",
        ],
    )
    assert result.exit_code == 0 and "WARNING: no API key" in result.output
    assert "WARNING: no API key" in (tmp_path / "k" / "deployment.yaml").read_text()


@pytest.mark.parametrize("content,given", [("s3cret\n", "s3cret"), ("s3cret\r\n", "s3cret"), ("k e y", "k e y")])
def test_serve_openai_reads_its_key_from_a_file(tiny_bundle, tmp_path, monkeypatch, content, given):
    from runtime.cli import main
    from runtime.serving import openai_server

    seen = {}
    monkeypatch.setattr(openai_server, "serve", lambda bundle, **kw: seen.update(kw))
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text(content)
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--api-key-file", str(key)])
    assert result.exit_code == 0, result.output
    assert seen["api_key"] == given


@pytest.mark.parametrize("problem", ["empty", "missing", "both"])
def test_serve_openai_refuses_a_bad_key_file(tiny_bundle, tmp_path, monkeypatch, problem):
    from runtime.cli import main
    from runtime.serving import openai_server

    monkeypatch.setattr(openai_server, "serve", lambda bundle, **kw: pytest.fail("served"))
    monkeypatch.delenv("DRAFTSMITH_API_KEY", raising=False)
    key = tmp_path / "key"
    if problem != "missing":
        key.write_text("\n" if problem == "empty" else "k")
    extra = ["--api-key", "other"] if problem == "both" else []
    result = CliRunner().invoke(main, ["serve-openai", str(tiny_bundle), "--api-key-file", str(key), *extra])
    assert result.exit_code != 0


def test_bad_options_are_refused_by_name():
    with pytest.raises(DeployError, match="server: expected one of") as info:
        DeployOptions(server="nginx", replicas=0, bundle_source="image")
    assert "replicas: expected an integer >= 1" in str(info.value) and "bundle_image" in str(info.value)
    with pytest.raises(DeployError, match="name: expected a DNS label"):
        DeployOptions(name="Draft_Smith")


def test_command_writes_a_kustomization_and_refuses_to_overwrite(tiny_bundle, tmp_path):
    from runtime.cli import main

    out = tmp_path / "k8s"
    args = [
        "deploy",
        "kubernetes",
        str(tiny_bundle),
        "--out",
        str(out),
        "--autoscale",
        "queue",
        "--load-seconds",
        "3",
        "--memory-mib",
        "200",
        "--tokens-per-second",
        "50",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kustomization["resources"] == [
        "deployment.yaml",
        "service.yaml",
        "pdb.yaml",
        "networkpolicy.yaml",
        "hpa-queue.yaml",
    ]
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
