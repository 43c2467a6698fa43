"""KubeRay manifests: golden files, Kubernetes schema validation of every pod template, and
the embedded config loading to the same run config as the file it came from.

`UPDATE_GOLDEN=1 pytest tests/launch/test_k8s.py` rewrites the golden files; review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from omegaconf import OmegaConf

from rlhf_megatron.config.presets import CONFIGS_DIR
from rlhf_megatron.launch.common import load_run
from rlhf_megatron.launch.k8s import (
    CONFIG_DIR,
    K8sOptions,
    build_manifests,
    embedded_config,
    pod_templates,
    retry_caveat,
)
from rlhf_megatron.planning import load_config

GOLDEN = Path(__file__).resolve().parent / "golden"
K8S_VERSION = "1.30"  # a version kubernetes-validate ships schemas for, offline
IMAGE = "registry.example.com/rlhf-megatron:gpu"
GOLDEN_CASES = {
    "rayjob_1node.yaml": ["--nodes", "1", "--gpus-per-node", "8"],
    "rayjob_4node.yaml": [
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--namespace",
        "rl",
        "--secret-env",
        "wandb",
        "--cpus-per-node",
        "96",
        "--memory-per-node",
        "900Gi",
        "--storage-class",
        "nfs",
    ],
}


def _render(launch, run_config, extra: list[str]) -> str:
    argv = [
        "k8s",
        "--config",
        run_config,
        "--image",
        IMAGE,
        "--ray-version",
        "2.40.0",
        *extra,
        "--",
        "trainer.total_epochs=2",
    ]
    rc, out, err = launch(argv)
    assert rc == 0, err
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden(launch, run_config, name):
    text = _render(launch, run_config, GOLDEN_CASES[name])
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"{name} changed; if on purpose, rerun with UPDATE_GOLDEN=1 and review the diff"
    )


def test_output_is_deterministic_and_ignores_the_environment(launch, run_config, monkeypatch):
    first = _render(launch, run_config, GOLDEN_CASES["rayjob_4node.yaml"])
    monkeypatch.setenv("NCCL_DEBUG", "TRACE")
    monkeypatch.setenv("WANDB_API_KEY", "s3cret")
    assert _render(launch, run_config, GOLDEN_CASES["rayjob_4node.yaml"]) == first


def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{obj['kind']} {obj['metadata'].get('name')}: {exc.message} at {where}")


SHAPES = {
    "1 node x 8 GPUs": (1, 8, K8sOptions(image=IMAGE)),
    "4 nodes x 8 GPUs, every option": (
        4,
        8,
        K8sOptions(
            image=IMAGE,
            namespace="rl",
            service_account="trainer",
            secret_envs=["wandb", "hf"],
            cpus_per_node=96,
            memory_per_node="900Gi",
            storage_class="nfs",
            pvc_size="2Ti",
            shm_size="64Gi",
            env={"NCCL_IB_HCA": "mlx5"},
        ),
    ),
    "2 CPU nodes": (2, 0, K8sOptions(image="rlhf-megatron:cpu", cpus_per_node=8)),
    "RayCluster": (2, 4, K8sOptions(image=IMAGE, kind="raycluster")),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_pod_template_and_object_validates(run_config, shape):
    nodes, gpus, opts = SHAPES[shape]
    spec = load_run(run_config, [], nodes=nodes, gpus_per_node=gpus)
    config_map, pvc, ray_obj = build_manifests(spec, opts)
    _validate(config_map)
    _validate(pvc)
    templates = pod_templates(ray_obj)
    assert len(templates) == (1 if nodes == 1 else 2)
    for label, template in templates:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{ray_obj['metadata']['name']}-{label.split()[0]}", **template["metadata"]},
            "spec": template["spec"],
        }
        _validate(pod)


def test_manifest_shape(run_config):
    spec = load_run(run_config, ["trainer.total_epochs=2"], nodes=4, gpus_per_node=8)
    config_map, pvc, job = build_manifests(spec, K8sOptions(image=IMAGE))
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["shutdownAfterJobFinishes"] is True and job["spec"]["ttlSecondsAfterFinished"] == 600
    assert job["spec"]["backoffLimit"] == 3  # retries, each on a new RayCluster (KubeRay >= 1.2)
    assert job["spec"]["entrypoint"] == (
        f"cd /opt/rlhf_megatron && rlhf-megatron train --config {CONFIG_DIR}/config.yaml "
        "trainer.total_epochs=2 trainer.nnodes=4 trainer.n_gpus_per_node=8 trainer.resume_mode=auto"
    )
    cluster = job["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert (
        workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    )  # + the head = 4 nodes
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "8"
    run_dir = "/opt/rlhf_megatron/checkpoints/launch_tests/grpo_tiny"  # default_local_dir, inside the image
    for _, template in pod_templates(job):
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["dshm"]["mountPath"] == "/dev/shm"
        assert mounts["checkpoints"]["mountPath"] == run_dir
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert {"name": "config", "configMap": {"name": config_map["metadata"]["name"]}} in head["volumes"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_one_node_job_has_no_worker_group(run_config):
    spec = load_run(run_config, [], nodes=1, gpus_per_node=8)
    _, _, job = build_manifests(spec, K8sOptions(image=IMAGE))
    assert "workerGroupSpecs" not in job["spec"]["rayClusterSpec"]


def test_raycluster_kind(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    _, _, cluster = build_manifests(spec, K8sOptions(image=IMAGE, kind="raycluster"))
    assert cluster["kind"] == "RayCluster" and "entrypoint" not in cluster["spec"]
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 1


@pytest.mark.parametrize(
    "config",
    [
        str(Path(__file__).resolve().parent / "golden" / "run.yaml"),
        str(CONFIGS_DIR / "examples" / "gsm8k_grpo.yaml"),  # has a `base:` chain
        str(CONFIGS_DIR / "quickstart_cpu_ppo.yaml"),
    ],
    ids=lambda p: Path(p).name,
)
def test_embedded_config_loads_to_the_same_config(config, tmp_path):
    if not Path(config).exists():
        pytest.skip(f"{config} is not in the tree")
    copy = tmp_path / "config.yaml"
    copy.write_text(embedded_config(config))
    assert "base" not in yaml.safe_load(copy.read_text())
    original = OmegaConf.to_container(load_config(config, validate=False))
    assert OmegaConf.to_container(load_config(str(copy), validate=False)) == original


def test_secrets_become_env_from(run_config):
    spec = load_run(run_config, [], nodes=1, gpus_per_node=8)
    _, _, job = build_manifests(spec, K8sOptions(image=IMAGE, secret_envs=["wandb"]))
    (container,) = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "wandb"}}]


# ---- restarts ------------------------------------------------------------------------


def test_retried_job_resumes_from_the_claim(run_config):
    """A retry runs the same entrypoint on a new RayCluster: the checkpoints must be on the
    claim (which outlives the RayJob) at the run directory, and the entrypoint must resume."""
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    opts = K8sOptions(image=IMAGE, max_retries=5)
    _, pvc, job = build_manifests(spec, opts)
    assert job["spec"]["backoffLimit"] == 5
    assert job["spec"]["entrypoint"].endswith(" trainer.resume_mode=auto")
    assert "ownerReferences" not in pvc["metadata"]  # not deleted with the RayJob
    run_dir = f"/opt/rlhf_megatron/{spec.cfg.trainer.default_local_dir}"
    for label, template in pod_templates(job):
        (container,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts.get(run_dir) == "checkpoints", f"{label}: no checkpoint volume at {run_dir}"
        claims = {v["name"]: v.get("persistentVolumeClaim") for v in template["spec"]["volumes"]}
        assert claims["checkpoints"] == {"claimName": pvc["metadata"]["name"]}
    assert retry_caveat(spec, opts) is None


@pytest.mark.parametrize(
    "overrides,start",
    [
        (["trainer.resume_mode=disable"], "fresh (trainer.resume_mode=disable)"),
        (
            ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/global_step_40"],
            "from /ckpt/global_step_40",
        ),
    ],
    ids=["disable", "resume_path"],
)
def test_explicit_resume_is_kept_and_the_retry_caveat_says_so(launch, run_config, overrides, start):
    spec = load_run(run_config, overrides, nodes=1, gpus_per_node=8)
    _, _, job = build_manifests(spec, K8sOptions(image=IMAGE))
    assert "resume_mode=auto" not in job["spec"]["entrypoint"]
    caveat = retry_caveat(spec, K8sOptions(image=IMAGE))
    assert caveat is not None and f"a retried RayJob starts {start} again" in caveat
    assert retry_caveat(spec, K8sOptions(image=IMAGE, max_retries=0)) is None
    rc, _, err = launch(
        ["k8s", "--config", run_config, "--image", IMAGE, "--ray-version", "2.40.0", "--", *overrides]
    )
    assert rc == 0 and f"warning: {caveat}" in err


def test_max_retries_0_and_negative(launch, run_config):
    spec = load_run(run_config, [], nodes=1, gpus_per_node=8)
    _, _, job = build_manifests(spec, K8sOptions(image=IMAGE, max_retries=0))
    assert job["spec"]["backoffLimit"] == 0
    rc, _, err = launch(["k8s", "--config", run_config, "--image", IMAGE, "--max-retries", "-1"])
    assert rc == 2 and "--max-retries must be 0 or more" in err
