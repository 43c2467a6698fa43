"""Launcher arguments: bad ones are errors that name the argument and the fix; good ones
become the right cluster shape, driver command and environment."""

from __future__ import annotations

import argparse

import pytest

from rlhf_megatron.launch.common import (
    ClusterShape,
    LaunchError,
    check_env_assignments,
    load_run,
    parse_launch_args,
    passthrough_env,
)

K8S = ["k8s", "--image", "reg/rlhf-megatron:gpu"]
SLURM = ["slurm", "--dry-run"]

# (argv after `launch`, words the error must contain). {cfg} is the run config.
BAD_ARGS = [
    (SLURM + ["--config", "{cfg}", "--nodes", "0"], ["--nodes", "at least 1"]),
    (SLURM + ["--config", "{cfg}", "--gpus-per-node", "-1"], ["--gpus-per-node", "0 or more", "CPU mode"]),
    (SLURM + ["--config", "no/such/run.yaml"], ["--config", "not found", "no/such/run.yaml"]),
    (
        SLURM + ["--config", "{cfg}", "--container", "img", "--container-runtime", "docker"],
        ["--container-runtime", "'docker'", "pyxis", "apptainer"],
    ),
    (
        SLURM + ["--config", "{cfg}", "--container-mount", "/data:/data"],
        ["--container-mount", "--container IMAGE"],
    ),
    (SLURM + ["--config", "{cfg}", "--time", "4h"], ["--time", "'4h'", "H:MM:SS"]),
    (SLURM + ["--config", "{cfg}", "--partition", "gpu queue"], ["--partition", "Slurm name"]),
    (SLURM + ["--config", "{cfg}", "--cpus-per-node", "0"], ["--cpus-per-node", "at least 1"]),
    (SLURM + ["--config", "{cfg}", "--join-timeout", "0"], ["--join-timeout", "positive"]),
    (SLURM + ["--config", "{cfg}", "--env", "1BAD=x"], ["--env", "'1BAD=x'", "NAME=VALUE"]),
    (SLURM + ["--config", "{cfg}", "stray"], ["unrecognized arguments: stray", "key=value"]),
    (
        SLURM + ["--config", "{cfg}", "--", "actor_rollout_ref.actor.ppo_mini_batch_size=7"],
        ["invalid config", "ppo_mini_batch_size"],
    ),
    (SLURM + ["--config", "{cfg}", "--", "trainer.no_such_key=1"], ["invalid config", "trainer.no_such_key"]),
    (K8S + ["--config", "{cfg}", "--nodes", "0"], ["--nodes", "at least 1"]),
    (K8S + ["--config", "{cfg}", "--gpus-per-node", "-8"], ["--gpus-per-node", "0 or more"]),
    (K8S + ["--config", "missing.yaml"], ["--config", "not found"]),
    (["k8s", "--config", "{cfg}", "--image", " "], ["--image", "empty"]),
    (K8S + ["--config", "{cfg}", "--kind", "deployment"], ["--kind", "rayjob", "raycluster"]),
    (K8S + ["--config", "{cfg}", "--name", "My_Run"], ["--name", "'My_Run'", "lowercase"]),
    (K8S + ["--config", "{cfg}", "--namespace", "Team_A"], ["--namespace", "Kubernetes name"]),
    (K8S + ["--config", "{cfg}", "--pvc-size", "10GB"], ["--pvc-size", "'10GB'", "100Gi"]),
    (K8S + ["--config", "{cfg}", "--shm-size", "lots"], ["--shm-size", "quantity"]),
    (
        K8S + ["--config", "{cfg}", "--nodes", "2", "--pvc-access-mode", "ReadWriteOnce"],
        ["--pvc-access-mode", "ReadWriteMany", "all 2 nodes"],
    ),
    (K8S + ["--config", "{cfg}", "--workdir", "relative/dir"], ["--workdir", "absolute"]),
    (K8S + ["--config", "{cfg}", "--ttl", "-1"], ["--ttl", "0 or more"]),
    (["local", "--config", "{cfg}", "--num-cpus", "0"], ["--num-cpus", "at least 1"]),
    (["local", "--config", "{cfg}", "--num-gpus", "-1"], ["--num-gpus", "0 or more"]),
    (["local", "--config", "nope.yaml"], ["--config", "not found"]),
    (["lsf", "--config", "{cfg}"], ["unknown launcher 'lsf'", "slurm", "k8s", "local"]),
]


@pytest.mark.parametrize("argv,words", BAD_ARGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_ARGS])
def test_bad_arguments_are_named_errors(launch, run_config, argv, words):
    rc, out, err = launch([a.format(cfg=run_config) for a in argv])
    assert rc == 2, f"expected a usage error, got rc={rc}\nstdout: {out}\nstderr: {err}"
    assert out == ""  # nothing rendered or submitted
    for word in words:
        assert word in err, f"{word!r} missing from the error:\n{err}"


def test_launch_help_lists_every_launcher(launch):
    rc, out, _ = launch(["--help"])
    assert rc == 0
    assert all(name in out for name in ("slurm", "k8s", "local"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--driver-cmd")
    return parser


@pytest.mark.parametrize(
    "argv,overrides",
    [
        (["--config", "x", "--", "a.b=1", "c=[1,2]"], ["a.b=1", "c=[1,2]"]),
        (["--config", "x", "a.b=1", "--dry-run", "+c.d=2"], ["a.b=1", "+c.d=2"]),  # verl style, no `--`
        (["--dry-run", "a=1", "--", "b=2"], ["a=1", "b=2"]),
        (["--driver-cmd", "A=1 python x.py", "--config", "x"], []),  # a flag's value is not an override
    ],
)
def test_overrides_with_and_without_double_dash(argv, overrides):
    _, got = parse_launch_args(_parser(), argv)
    assert got == overrides


def test_cluster_shape_becomes_trainer_overrides():
    assert ClusterShape(4, 8).trainer_overrides() == ["trainer.nnodes=4", "trainer.n_gpus_per_node=8"]
    # CPU mode keeps the config's n_gpus_per_node: there it counts processes per node.
    assert ClusterShape(2, 0).trainer_overrides() == ["trainer.nnodes=2", "trainer.device=cpu"]


def test_shape_defaults_come_from_the_config(run_config):
    spec = load_run(run_config, ["trainer.nnodes=2", "trainer.n_gpus_per_node=4"])
    assert (spec.shape.nodes, spec.shape.gpus_per_node) == (2, 4)
    spec = load_run(run_config, ["trainer.device=cpu", "trainer.n_gpus_per_node=2"])
    assert spec.shape.cpu_mode and spec.cfg.trainer.n_gpus_per_node == 2


def test_launcher_shape_wins_and_is_validated(run_config):
    spec = load_run(run_config, ["trainer.total_epochs=2"], nodes=2, gpus_per_node=8)
    assert spec.cfg.trainer.nnodes == 2 and spec.cfg.trainer.n_gpus_per_node == 8
    assert spec.train_command() == [
        "rlhf-megatron",
        "train",
        "--config",
        run_config,
        "trainer.total_epochs=2",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=8",
    ]


def test_passthrough_env_records_values_but_never_secrets():
    environ = {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "HF_HOME": "/cache/hf",
        "WANDB_PROJECT": "rl",
        "WANDB_API_KEY": "s3cret",
        "HF_TOKEN": "hf_s3cret",
        "GLOO_SOCKET_IFNAME": "ib0",
        "HOME": "/root",
        "PATH": "/bin",
    }
    values, secrets = passthrough_env(environ)
    assert values == {
        "GLOO_SOCKET_IFNAME": "ib0",
        "HF_HOME": "/cache/hf",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_HCA": "mlx5",
        "WANDB_PROJECT": "rl",
    }
    assert list(values) == sorted(values)
    assert secrets == ["HF_TOKEN", "WANDB_API_KEY"]


def test_env_assignments():
    assert check_env_assignments(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    with pytest.raises(LaunchError, match="--env 'A-B=1'"):
        check_env_assignments(["A-B=1"])
