"""Deployments of a bundle: ``draftsmith deploy kubernetes`` writes plain Kubernetes manifests (kustomize-ready) for
either server, the OpenAI server (``draftsmith serve-openai``) or, for a tensorrt_llm bundle, Triton.

On top of the runtime (and, inside a pod's init container only, triton_repo's writer of a TensorRT-LLM repository,
named in a command line, not imported); the runtime imports it only through the ``draftsmith`` command table in
``runtime/cli.py``. A package of its own, not part of triton_repo, because it deploys the OpenAI server too.

- ``options.py``: the deployment's choices (``DeployOptions``), its constants and ``DeployError``;
- ``sizing.py``: one server process measured (or estimated) and what the manifests take from it (``Sizing``);
- ``server_commands.py``: each server's command line in a pod, and the refusal of an unsafe Triton;
- ``kubernetes.py``: the manifests (Deployment, Service, PDB, HPA, NetworkPolicy, kustomization) and their files;
- ``cli.py``: the ``deploy`` command group.
"""
