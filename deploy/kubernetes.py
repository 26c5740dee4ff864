"""The Kubernetes objects serving a bundle, as files (``write_manifests``; ``kubectl apply -k OUT``).

Every pod runs under Pod Security "restricted" without a service-account token, a NetworkPolicy admits only the
serving ports from the namespace, and the API key comes from a Secret mounted as a file. What the objects hold:

- readiness: the server's own (the OpenAI server's ``/health``: 503 while its scheduler is down or while draining;
  Triton's ``/v2/health/ready``); liveness: ``/health/live`` / ``/v2/health/live``; the startup probe, resources and
  grace period from ``deploy/sizing.py``; the drain they rely on is runtime/serving/drain.py and
  triton_repo/server.py;
- the bundle read-only: a PersistentVolumeClaim (``--bundle-source pvc``) or an init container that copies it from
  an image holding it at /bundle (``--bundle-source image``); the server verifies it at start as ever;
- a Service, a PodDisruptionBudget, and a HorizontalPodAutoscaler on CPU (``hpa-cpu.yaml``) or on the queue length
  (``hpa-queue.yaml``, for clusters with a custom-metrics adapter: ``vllm:num_requests_waiting`` for the OpenAI
  server, Triton's ``nv_inference_pending_request_count``); both are written, the kustomization lists the one
  ``--autoscale`` names.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path

import yaml

from deploy.options import (
    API_KEY_DIR,
    BUNDLE_PATH,
    GRPC_PORT,
    HEALTH_PORT,
    HTTP_PORT,
    METRICS_PORT,
    WORK_PATH,
    DeployError,
    DeployOptions,
)
from deploy.server_commands import check_server, openai_command, trtllm_launch_command, trtllm_repo_command
from deploy.sizing import STARTUP_PERIOD_S, Measured, Sizing, estimate_trtllm, measure, size
from runtime.bundle import BundleError, Manifest, load_manifest


def manifests(bundle: str | os.PathLike, options: DeployOptions, measured: Measured | None = None) -> dict[str, dict]:
    """File name -> Kubernetes object, for ``bundle``; ``measured``: None measures it (``measure``, or
    ``estimate_trtllm`` for a tensorrt_llm bundle)."""
    root = Path(bundle)
    try:
        manifest = load_manifest(root)
    except BundleError as err:
        raise DeployError(str(err)) from None
    check_server(manifest, options)  # before measuring, which loads the bundle
    trtllm = manifest.spec.backend == "tensorrt_llm"
    if measured is None:
        measured = (
            estimate_trtllm(root, manifest)
            if trtllm
            else measure(root, options.threads, options.max_batch, options.policy)
        )
    sizing = size(manifest, measured, options)
    labels = {"app.kubernetes.io/name": "draftsmith", "app.kubernetes.io/instance": options.name}
    files = {
        "deployment.yaml": deployment(manifest, options, sizing, measured, labels),
        "service.yaml": service(options, labels),
        "pdb.yaml": {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": options.name, "labels": labels},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
        },
        "hpa-cpu.yaml": autoscaler(options, labels, _cpu_metric(options)),
        "hpa-queue.yaml": autoscaler(options, labels, _queue_metric(options, trtllm)),
        "networkpolicy.yaml": network_policy(options, labels),
    }
    return files


def deployment(manifest: Manifest, options: DeployOptions, sizing: Sizing, measured: Measured, labels: dict) -> dict:
    trtllm = manifest.spec.backend == "tensorrt_llm"
    bundle_volume = (
        {"name": "bundle", "persistentVolumeClaim": {"claimName": options.bundle_pvc, "readOnly": True}}
        if options.bundle_source == "pvc"
        else {"name": "bundle", "emptyDir": {}}
    )
    volumes = [bundle_volume, {"name": "work", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    init = []
    if options.bundle_source == "image":
        init.append(
            _container(
                "copy-bundle",
                options.bundle_image,
                ["cp", "-R", f"{BUNDLE_PATH}/.", "/mnt/bundle/"],
                [{"name": "bundle", "mountPath": "/mnt/bundle"}],
                _small_resources(),
            )
        )
    mounts = [
        {"name": "bundle", "mountPath": BUNDLE_PATH, "readOnly": True},
        {"name": "work", "mountPath": WORK_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if options.server == "triton":
        init.append(_container("triton-repo", options.image, trtllm_repo_command(options), mounts, _small_resources()))
    server = server_container(manifest, options, sizing, mounts)
    if options.api_key_secret:  # a file in a Secret's volume: not in the environment, which /proc and logs show
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": options.api_key_secret,
                    "defaultMode": 0o440,
                    "items": [{"key": "DRAFTSMITH_API_KEY", "path": "DRAFTSMITH_API_KEY"}],
                },
            }
        )
        server["volumeMounts"] = mounts + [{"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True}]
    # Pod Security "restricted" for every pod; NVIDIA's Triton image runs as any user (mpirun's
    # --allow-run-as-root is then moot). No service-account token: the server never calls the Kubernetes API.
    pod = {
        "terminationGracePeriodSeconds": sizing.grace_s,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "initContainers": init,
        "containers": [server],
        "volumes": volumes,
    }
    if trtllm:
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    if not init:
        del pod["initContainers"]
    annotations = {
        "draftsmith/bundle-backend": manifest.spec.backend,
        "draftsmith/sizing": json.dumps({**asdict(sizing), **asdict(measured)}, sort_keys=True),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": options.name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": options.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def server_container(manifest: Manifest, options: DeployOptions, sizing: Sizing, mounts: list[dict]) -> dict:
    """The serving container: its command, environment, ports and probes (``deployment`` adds the key's volume)."""
    triton = options.server == "triton"  # only on tensorrt_llm bundles (check_server)
    env = {"OMP_NUM_THREADS": str(options.threads), "TOKENIZERS_PARALLELISM": "false", "HOME": WORK_PATH}
    if triton:
        command, launch_env = trtllm_launch_command(manifest, f"{WORK_PATH}/repo", sizing.drain_timeout_s)
        env.update(launch_env)
    else:
        command = openai_command(options, sizing)
    server = _container(
        "server", options.triton_image if triton else options.image, command, mounts, _resources(sizing)
    )
    server["env"] = [{"name": k, "value": v} for k, v in env.items()]
    server["ports"] = [
        {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in serving_ports(options)
    ]
    ready, live = ("/v2/health/ready", "/v2/health/live") if triton else ("/health", "/health/live")
    # the OpenAI server answers its probes on a port of their own (not in the Service: the kubelet calls it)
    port = "http" if triton else "health"
    if not triton:
        server["ports"].append({"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"})
    server["startupProbe"] = _probe(live, STARTUP_PERIOD_S, sizing.startup_failures, port)
    # 3 failures: a busy pod is not flapped out; a stopping one leaves the Service's endpoints at once anyway
    server["readinessProbe"] = _probe(ready, 2, 3, port)
    server["livenessProbe"] = _probe(live, 10, 3, port)
    if triton and options.drain_linger > 0:  # mpirun hands SIGTERM to tritonserver, which closes its ports at once
        server["lifecycle"] = {"preStop": {"sleep": {"seconds": math.ceil(options.drain_linger)}}}
    return server


def serving_ports(options: DeployOptions) -> list[tuple[str, int]]:
    """(name, port) of what the pod serves: the Service's ports and the only ones its NetworkPolicy admits."""
    if options.server == "triton":
        return [("http", HTTP_PORT), ("grpc", GRPC_PORT), ("metrics", METRICS_PORT)]
    return [("http", HTTP_PORT)]


def network_policy(options: DeployOptions, labels: dict) -> dict:
    """Ingress to the serving ports from pods of the same namespace only, and no egress at all (the server calls
    nothing; kubelet probes come from the node, which policies do not govern). Add the namespace of your ingress
    controller or Prometheus to ``from`` if they live elsewhere (docs/operations.md)."""
    ports = [{"protocol": "TCP", "port": name} for name, _ in serving_ports(options)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {}}], "ports": ports}],
            "egress": [],
        },
    }


def _container(name: str, image: str, command: list[str], mounts: list[dict], resources: dict) -> dict:
    return {
        "name": name,
        "image": image,
        "command": command,
        "volumeMounts": mounts,
        "resources": resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _small_resources() -> dict:
    return {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def _resources(sizing: Sizing) -> dict:
    resources = {
        "requests": {"cpu": f"{sizing.cpu_request_m}m", "memory": f"{sizing.memory_request_mib}Mi"},
        "limits": {"cpu": f"{sizing.cpu_limit_m}m", "memory": f"{sizing.memory_limit_mib}Mi"},
    }
    if sizing.gpus:
        resources["limits"]["nvidia.com/gpu"] = sizing.gpus
    return resources


def _probe(path: str, period: int, failures: int, port: str = "http") -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def service(options: DeployOptions, labels: dict) -> dict:
    ports = [
        {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in serving_ports(options)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {"type": "ClusterIP", "selector": labels, "ports": ports},
    }


def _cpu_metric(options: DeployOptions) -> dict:
    return {
        "type": "Resource",
        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": options.cpu_utilization}},
    }


# The queue gauge each server exports, as a Prometheus adapter exposes it (its rule renames ':' away; docs).
QUEUE_METRICS = {
    "openai": ("vllm:num_requests_waiting", "vllm_num_requests_waiting"),
    "triton-trtllm": ("nv_inference_pending_request_count", "nv_inference_pending_request_count"),
}


def queue_metric_name(server: str, trtllm: bool) -> tuple[str, str]:
    """(the server's Prometheus series, the custom-metrics name the adapter serves it under)."""
    return QUEUE_METRICS["triton-trtllm" if server == "triton" and trtllm else server]


def _queue_metric(options: DeployOptions, trtllm: bool) -> dict:
    _, name = queue_metric_name(options.server, trtllm)
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": name},
            "target": {"type": "AverageValue", "averageValue": str(options.queue_per_replica)},
        },
    }


def autoscaler(options: DeployOptions, labels: dict, metric: dict) -> dict:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": options.name},
            "minReplicas": options.min_replicas,
            "maxReplicas": options.max_replicas,
            "metrics": [metric],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def kustomization(options: DeployOptions) -> dict:
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [
            "deployment.yaml",
            "service.yaml",
            "pdb.yaml",
            "networkpolicy.yaml",
            f"hpa-{options.autoscale}.yaml",
        ],
    }


def write_manifests(
    bundle: str | os.PathLike,
    out: str | os.PathLike,
    options: DeployOptions,
    measured: Measured | None = None,
    overwrite: bool = False,
) -> dict[str, dict]:
    """``manifests`` written as YAML into ``out`` with a kustomization.yaml (``kubectl apply -k out``)."""
    out = Path(out)
    objects = manifests(bundle, options, measured)
    files = {**objects, "kustomization.yaml": kustomization(options)}
    existing = [name for name in files if (out / name).exists()]
    if existing and not overwrite:
        raise DeployError(f"{out} already holds {', '.join(existing)}; pass --overwrite to replace them")
    out.mkdir(parents=True, exist_ok=True)
    for name, document in files.items():
        (out / name).write_text(
            _header(name, options, objects) + yaml.dump(document, Dumper=_Dumper, sort_keys=False), encoding="utf-8"
        )
    return objects


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no anchors and aliases for repeated objects (the labels), which not every tool reads."""

    def ignore_aliases(self, data) -> bool:
        return True


def no_key_warning(options: DeployOptions) -> str | None:
    """What a deployment anyone in its namespace can use without a key says, loudly (None: it has a key)."""
    if options.server == "triton":
        return (
            "WARNING: no API key: Triton has no authentication; any pod in this namespace can use it (the "
            "NetworkPolicy admits no one else). Put an authenticating proxy in front."
        )
    if not options.api_key_secret:
        return (
            "WARNING: no API key (--api-key-secret): any pod in this namespace can use this server (the "
            "NetworkPolicy admits no one else)."
        )
    return None


def _header(name: str, options: DeployOptions, objects: dict) -> str:
    warning = no_key_warning(options)
    if name == "deployment.yaml" and warning:
        return f"# written by draftsmith deploy kubernetes\n# {warning}\n"
    if name != "hpa-queue.yaml":
        return "# written by draftsmith deploy kubernetes\n"
    metric = objects[name]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    series = next(s for s, n in QUEUE_METRICS.values() if n == metric)
    return (
        "# Scale on the queue: needs a custom-metrics adapter (e.g. prometheus-adapter) serving the per-pod\n"
        f'# series {series} as the pods metric {metric}; see docs/operations.md, "Scaling out".\n'
    )
