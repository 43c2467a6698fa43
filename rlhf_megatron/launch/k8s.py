"""``rlhf-megatron launch k8s``: KubeRay manifests for a run, printed as multi-document YAML.

Role: from the run config and the cluster shape, build
  1. a ConfigMap holding the config file (with its ``base`` chain merged in), because a
     config on the user's machine is not in the image; it is mounted on the head pod at
     ``/etc/rlhf-megatron/config.yaml``;
  2. a PersistentVolumeClaim for checkpoints, mounted at ``trainer.default_local_dir``
     on every pod (each run in its own ``<project>/<experiment>`` sub-path, so runs can
     share a claim);
  3. a ``RayJob`` (default) whose RayCluster has a head pod plus ``N - 1`` workers, each
     with G GPUs, ``/dev/shm`` in memory, and the NCCL environment. Its entrypoint is
     ``rlhf-megatron train --config /etc/rlhf-megatron/config.yaml overrides...
     trainer.nnodes=N trainer.n_gpus_per_node=G trainer.resume_mode=auto``. ``--kind
     raycluster`` gives a bare ``RayCluster`` instead, for interactive use (``ray job submit``).
The head pod is a training node like the others: the N nodes of the run are the head
plus the workers, as on Slurm.

Restarts: ``spec.backoffLimit`` (KubeRay >= 1.2; older operators ignore the field) lets a
failed RayJob run again, up to ``--max-retries`` times, each time on a new RayCluster. The
checkpoints are on the claim, which outlives the RayJob, and the entrypoint resumes from the
newest one (``resume_mode=auto``). A run configured to start from an explicit checkpoint or
fresh would repeat that on a retry, so the launcher warns about it (``retry_caveat``).

Output is deterministic: mappings are built in a fixed, readable order and never depend
on the caller's environment (pass values with ``--env``, secrets with ``--secret-env``).

Boundaries: writes YAML text; never talks to a cluster.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import shlex
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import yaml

from rlhf_megatron.config.keys import RENAMED_KEYS
from rlhf_megatron.config.presets import read_preset_layers
from rlhf_megatron.launch.common import (
    LaunchError,
    RunSpec,
    add_common_args,
    auto_resume_overrides,
    check_env_assignments,
    is_auto_resume,
    load_run,
    parse_launch_args,
)

__all__ = [
    "K8sOptions",
    "build_manifests",
    "embedded_config",
    "main",
    "pod_templates",
    "render_yaml",
    "retry_caveat",
]

RAY_API = "ray.io/v1"
CONFIG_DIR = "/etc/rlhf-megatron"
CONFIG_KEY = "config.yaml"
# NCCL and gloo pick the pod network interface (eth0 on standard CNIs); --env overrides.
DEFAULT_ENV = {"NCCL_DEBUG": "WARN", "NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# KubeRay derives pod and service names from the job name; keep room for its suffixes.
MAX_NAME = 40
_QUANTITY = re.compile(r"\d+(\.\d+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
KINDS = ("rayjob", "raycluster")
ACCESS_MODES = ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod")


class _Dumper(yaml.SafeDumper):
    """Block style; multi-line strings as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


@dataclass
class K8sOptions:
    """Everything about the cluster objects that is not the run config."""

    image: str
    kind: str = "rayjob"
    name: str | None = None
    """Object name; None derives one from ``trainer.experiment_name``."""
    namespace: str | None = None
    pvc_name: str | None = None
    """None: ``<name>-checkpoints``."""
    pvc_size: str = "100Gi"
    pvc_access_mode: str = "ReadWriteMany"
    """Every node writes its checkpoint shards, so multi-node runs need ReadWriteMany."""
    storage_class: str | None = None
    shm_size: str = "32Gi"
    cpus_per_node: int | None = None
    memory_per_node: str | None = None
    service_account: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    secret_envs: list[str] = field(default_factory=list)
    """Secrets whose keys all become environment variables (e.g. WANDB_API_KEY)."""
    workdir: str = "/opt/rlhf_megatron"
    """Working directory in the image (the Dockerfile's WORKDIR); relative paths start here."""
    ray_version: str | None = None
    """``spec.rayVersion``; None: the installed Ray's version."""
    ttl_seconds: int = 600
    max_retries: int = 3
    """``spec.backoffLimit`` of the RayJob: reruns after a failure, each on a new RayCluster."""
    driver_cmd: str | None = None

    def check(self, nodes: int) -> None:
        """A LaunchError for the first bad option, naming it and what to change."""
        if not self.image.strip():
            raise LaunchError(
                "--image is empty; pass the image every pod runs, e.g. registry/rlhf-megatron:gpu"
            )
        if self.kind not in KINDS:
            raise LaunchError(f"--kind {self.kind!r} is not supported; use one of {', '.join(KINDS)}")
        for flag, value, limit in (
            ("--name", self.name, MAX_NAME),
            ("--namespace", self.namespace, 63),
            ("--pvc-name", self.pvc_name, 63),
            ("--service-account", self.service_account, 63),
            *(("--secret-env", s, 63) for s in self.secret_envs),
        ):
            if value is not None and not (_DNS_LABEL.fullmatch(value) and len(value) <= limit):
                raise LaunchError(
                    f"{flag} {value!r} is not a Kubernetes name: use at most {limit} lowercase letters, "
                    "digits and '-', starting and ending with a letter or digit"
                )
        for flag, value in (
            ("--pvc-size", self.pvc_size),
            ("--shm-size", self.shm_size),
            ("--memory-per-node", self.memory_per_node),
        ):
            if value is not None and not _QUANTITY.fullmatch(value):
                raise LaunchError(f"{flag} {value!r} is not a Kubernetes quantity; write e.g. 100Gi or 512Mi")
        if self.pvc_access_mode not in ACCESS_MODES:
            raise LaunchError(
                f"--pvc-access-mode {self.pvc_access_mode!r}: use one of {', '.join(ACCESS_MODES)}"
            )
        if nodes > 1 and self.pvc_access_mode != "ReadWriteMany":
            raise LaunchError(
                f"--pvc-access-mode {self.pvc_access_mode} lets only one node mount the checkpoint volume, but "
                f"all {nodes} nodes write checkpoint shards; use ReadWriteMany (a storage class that supports it)"
            )
        if self.cpus_per_node is not None and self.cpus_per_node < 1:
            raise LaunchError(f"--cpus-per-node must be at least 1 (got {self.cpus_per_node})")
        if self.max_retries < 0:
            raise LaunchError(
                f"--max-retries must be 0 or more (got {self.max_retries}); 0 turns retries off"
            )
        if self.ttl_seconds < 0:
            raise LaunchError(f"--ttl must be 0 or more seconds (got {self.ttl_seconds})")
        if not posixpath.isabs(self.workdir):
            raise LaunchError(f"--workdir {self.workdir!r} must be an absolute path inside the image")


def _dns_name(text: str) -> str:
    """``My_Run.v2`` -> ``my-run-v2``: a valid Kubernetes name of at most MAX_NAME chars."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:MAX_NAME].strip("-")
    return name or "rlhf-megatron"


def _leaves(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    return [(prefix, value)]


def _canonical(key: str) -> str:
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(old + "."):
            return new + key[len(old) :]
    return key


def embedded_config(config_file: str) -> str:
    """The config file and its ``base`` chain as one YAML document, for the ConfigMap.

    Merged as the loader merges layers: later files win, and setting a key replaces
    everything below it. Only the keys the files set are written (no schema defaults), so
    the text stays as short as the files; it loads to the same config (tests check this).
    """
    flat: dict[str, Any] = {}
    for _source, mapping in read_preset_layers(config_file):
        for key, value in _leaves(mapping):
            key = _canonical(key)
            for other in [k for k in flat if k.startswith(key + ".") or key.startswith(k + ".")]:
                del flat[other]
            flat[key] = value
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return yaml.dump(nested, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


@dataclass(frozen=True)
class _Names:
    job: str
    pvc: str
    config_map: str
    run_dir: str
    """Absolute mount path of the checkpoint volume (``trainer.default_local_dir``)."""
    sub_path: str


def _names(spec: RunSpec, opts: K8sOptions) -> _Names:
    job = opts.name or _dns_name(spec.job_name)
    trainer = spec.cfg.trainer
    run_dir = posixpath.normpath(posixpath.join(opts.workdir, str(trainer.default_local_dir)))
    return _Names(
        job=job,
        pvc=opts.pvc_name or f"{job}-checkpoints",
        config_map=f"{job}-config",
        run_dir=run_dir,
        sub_path=f"{_dns_name(str(trainer.project_name))}/{_dns_name(str(trainer.experiment_name))}",
    )


def _container(spec: RunSpec, opts: K8sOptions, names: _Names, head: bool) -> dict[str, Any]:
    gpus = spec.shape.gpus_per_node
    limits: dict[str, Any] = {}
    if opts.cpus_per_node:
        limits["cpu"] = str(opts.cpus_per_node)
    if opts.memory_per_node:
        limits["memory"] = opts.memory_per_node
    requests = dict(limits)  # CPU and memory: guaranteed, so the scheduler packs nodes honestly
    if gpus > 0:
        limits["nvidia.com/gpu"] = gpus  # extended resources: limits only (requests default to them)
    env = {**DEFAULT_ENV, **opts.env}
    container: dict[str, Any] = {
        "name": "ray-head" if head else "ray-worker",
        "image": opts.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": opts.workdir,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
    }
    if opts.secret_envs:
        container["envFrom"] = [{"secretRef": {"name": s}} for s in opts.secret_envs]
    if limits:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests else {})}
    if head:
        container["ports"] = [
            {"containerPort": 6379, "name": "gcs-server"},
            {"containerPort": 8265, "name": "dashboard"},
            {"containerPort": 10001, "name": "client"},
        ]
    container["volumeMounts"] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "checkpoints", "mountPath": names.run_dir, "subPath": names.sub_path},
    ]
    if head:  # the driver runs on the head and is the only reader of the config file
        container["volumeMounts"].append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    return container


def _pod_template(spec: RunSpec, opts: K8sOptions, names: _Names, head: bool) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    if opts.service_account:
        pod["serviceAccountName"] = opts.service_account
    pod["containers"] = [_container(spec, opts, names, head)]
    if spec.shape.gpus_per_node > 0:
        # GPU node pools are commonly tainted so that only GPU pods land there.
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod["volumes"] = [
        # NCCL and vLLM move tensors through /dev/shm; Docker's default 64 MiB is far too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": opts.shm_size}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": names.pvc}},
    ]
    if head:
        pod["volumes"].append({"name": "config", "configMap": {"name": names.config_map}})
    role = "head" if head else "worker"
    labels = {
        "app.kubernetes.io/name": "rlhf-megatron",
        "app.kubernetes.io/instance": names.job,
        "app.kubernetes.io/component": f"ray-{role}",
    }
    return {"metadata": {"labels": labels}, "spec": pod}


def _ray_start_params(spec: RunSpec, opts: K8sOptions, head: bool) -> dict[str, str]:
    params = {"dashboard-host": "0.0.0.0"} if head else {}
    if opts.cpus_per_node:
        params["num-cpus"] = str(opts.cpus_per_node)
    params["num-gpus"] = str(spec.shape.gpus_per_node)
    return params


def _cluster_spec(spec: RunSpec, opts: K8sOptions, names: _Names) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "rayVersion": opts.ray_version or _installed_ray_version(),
        "headGroupSpec": {
            "rayStartParams": _ray_start_params(spec, opts, head=True),
            "template": _pod_template(spec, opts, names, head=True),
        },
    }
    workers = spec.shape.nodes - 1
    if workers > 0:
        cluster["workerGroupSpecs"] = [
            {
                "groupName": "workers",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": _ray_start_params(spec, opts, head=False),
                "template": _pod_template(spec, opts, names, head=False),
            }
        ]
    return cluster


def _installed_ray_version() -> str:
    try:
        return version("ray")
    except PackageNotFoundError:
        raise LaunchError(
            "Ray is not installed here, so its version is unknown; pass --ray-version"
        ) from None


def _metadata(opts: K8sOptions, name: str, instance: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    meta["labels"] = {"app.kubernetes.io/name": "rlhf-megatron", "app.kubernetes.io/instance": instance}
    return meta


def _entrypoint(spec: RunSpec, opts: K8sOptions) -> str:
    # Ray runs the entrypoint through a shell; `cd` makes a relative default_local_dir
    # resolve inside the image, where the checkpoint volume is mounted.
    train = [
        "rlhf-megatron",
        "train",
        "--config",
        f"{CONFIG_DIR}/{CONFIG_KEY}",
        *spec.train_overrides,
        *auto_resume_overrides(spec),
    ]
    command = opts.driver_cmd or shlex.join(train)
    return f"cd {shlex.quote(opts.workdir)} && {command}"


def build_manifests(spec: RunSpec, opts: K8sOptions) -> list[dict[str, Any]]:
    """[ConfigMap, PersistentVolumeClaim, RayJob or RayCluster] for the run."""
    opts.check(spec.shape.nodes)
    names = _names(spec, opts)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(opts, names.config_map, names.job),
        "data": {CONFIG_KEY: embedded_config(spec.config_file)},
    }
    pvc_spec: dict[str, Any] = {"accessModes": [opts.pvc_access_mode]}
    if opts.storage_class:
        pvc_spec["storageClassName"] = opts.storage_class
    pvc_spec["resources"] = {"requests": {"storage": opts.pvc_size}}
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(opts, names.pvc, names.job),
        "spec": pvc_spec,
    }
    cluster = _cluster_spec(spec, opts, names)
    if opts.kind == "raycluster":
        ray_obj = {
            "apiVersion": RAY_API,
            "kind": "RayCluster",
            "metadata": _metadata(opts, names.job, names.job),
            "spec": cluster,
        }
    else:
        ray_obj = {
            "apiVersion": RAY_API,
            "kind": "RayJob",
            "metadata": _metadata(opts, names.job, names.job),
            "spec": {
                "entrypoint": _entrypoint(spec, opts),
                # A failed run goes again on a fresh RayCluster and resumes from the claim.
                "backoffLimit": opts.max_retries,
                # Free the GPUs once the run ends; keep the pods ttl seconds for the logs.
                "shutdownAfterJobFinishes": True,
                "ttlSecondsAfterFinished": opts.ttl_seconds,
                "rayClusterSpec": cluster,
            },
        }
    return [config_map, pvc, ray_obj]


def retry_caveat(spec: RunSpec, opts: K8sOptions) -> str | None:
    """Why a retry of this RayJob would not continue the run, or None when it would.

    Unlike a Slurm job, a retried RayJob can't tell its own checkpoints from older ones (no
    restart count, no job start it could compare against), so a run told to start from an
    explicit checkpoint, or fresh, does that again on every retry.
    """
    if opts.kind != "rayjob" or opts.max_retries == 0 or opts.driver_cmd or is_auto_resume(spec.cfg.trainer):
        return None
    trainer = spec.cfg.trainer
    start = f"from {trainer.resume_from_path or trainer.resume_mode}"
    if trainer.resume_mode == "disable":
        start = "fresh (trainer.resume_mode=disable)"
    return (
        f"a retried RayJob starts {start} again, not from the checkpoints the failed attempt wrote; "
        "for retries that continue the run, let it resume by itself (trainer.resume_mode=auto, no "
        "trainer.resume_from_path) or pass --max-retries 0"
    )


def pod_templates(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod template in a RayJob/RayCluster as (label, template), head first."""
    cluster = manifest["spec"].get("rayClusterSpec", manifest["spec"])
    out = [("head", cluster["headGroupSpec"]["template"])]
    out += [(f"worker group {g['groupName']}", g["template"]) for g in cluster.get("workerGroupSpecs", [])]
    return out


def render_yaml(manifests: list[dict[str, Any]]) -> str:
    header = "# Generated by `rlhf-megatron launch k8s`. Apply with: kubectl apply -f <this file>\n"
    docs = [
        yaml.dump(m, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000) for m in manifests
    ]
    return header + "---\n" + "---\n".join(docs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf-megatron launch k8s",
        description="Print KubeRay manifests (checkpoint PVC + RayJob or RayCluster) for a run.",
        epilog="Config overrides go after `--`. Example: rlhf-megatron launch k8s --config X --nodes 4 "
        "--gpus-per-node 8 --image REGISTRY/rlhf-megatron:gpu > job.yaml && kubectl apply -f job.yaml",
    )
    add_common_args(parser, multi_node=True)
    parser.add_argument(
        "--image", required=True, help="image of every pod (the project's Dockerfile, pushed)"
    )
    parser.add_argument(
        "--kind", default="rayjob", help="rayjob (runs the trainer, then frees the pods) or raycluster"
    )
    parser.add_argument(
        "--name", help=f"object name (default: from trainer.experiment_name, at most {MAX_NAME} chars)"
    )
    parser.add_argument("--namespace", help="namespace (default: kubectl's current one)")
    parser.add_argument("--pvc-name", help="checkpoint claim (default: <name>-checkpoints)")
    parser.add_argument("--pvc-size", default="100Gi", help="checkpoint claim size")
    parser.add_argument(
        "--pvc-access-mode", default="ReadWriteMany", help="ReadWriteMany unless the run has one node"
    )
    parser.add_argument("--storage-class", help="storage class of the claim (default: the cluster's)")
    parser.add_argument("--shm-size", default="32Gi", help="size of /dev/shm (memory-backed)")
    parser.add_argument("--cpus-per-node", type=int, help="CPU request/limit per pod, and Ray's num-cpus")
    parser.add_argument("--memory-per-node", help="memory request/limit per pod, e.g. 900Gi")
    parser.add_argument("--service-account", help="service account of the pods")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="environment of every pod"
    )
    parser.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="SECRET",
        help="a Secret whose keys become environment variables (e.g. WANDB_API_KEY)",
    )
    parser.add_argument("--workdir", default="/opt/rlhf_megatron", help="working directory in the image")
    parser.add_argument("--ray-version", help="spec.rayVersion (default: the installed Ray's)")
    parser.add_argument(
        "--ttl", type=int, default=600, help="seconds the finished RayJob's pods stay for logs"
    )
    parser.add_argument(
        "--max-retries",
        type=int,
        default=3,
        help="spec.backoffLimit: reruns of a failed RayJob (KubeRay >= 1.2), each resuming from "
        "the last checkpoint on the claim (0: none)",
    )
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_launch_args(build_parser(), sys.argv[1:] if argv is None else argv)
    opts = K8sOptions(
        image=args.image,
        kind=args.kind,
        name=args.name,
        namespace=args.namespace,
        pvc_name=args.pvc_name,
        pvc_size=args.pvc_size,
        pvc_access_mode=args.pvc_access_mode,
        storage_class=args.storage_class,
        shm_size=args.shm_size,
        cpus_per_node=args.cpus_per_node,
        memory_per_node=args.memory_per_node,
        service_account=args.service_account,
        env=check_env_assignments(args.env),
        secret_envs=args.secret_env,
        workdir=args.workdir,
        ray_version=args.ray_version,
        ttl_seconds=args.ttl,
        max_retries=args.max_retries,
        driver_cmd=args.driver_cmd,
    )
    opts.check(args.nodes or 1)  # argument mistakes first; the node count is checked again below
    spec = load_run(args.config, overrides, args.nodes, args.gpus_per_node)
    text = render_yaml(build_manifests(spec, opts))
    caveat = retry_caveat(spec, opts)
    if caveat:
        print(f"warning: {caveat}", file=sys.stderr)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
