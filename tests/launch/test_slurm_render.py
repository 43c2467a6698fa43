"""The rendered sbatch script: directives, settings, containers, secrets, and submission
through a stand-in `sbatch`. The real Slurm run is test_slurm_real.py."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlhf_megatron.launch.common import LaunchError, load_run
from rlhf_megatron.launch.slurm import SlurmOptions, render_script

BASH = shutil.which("bash")


def _settings(script: str) -> str:
    start = script.index("# ---- settings rendered by the launcher")
    return script[start : script.index("# ---- end of rendered settings")]


def _bash_array(script: str, name: str) -> list[str]:
    """The words of array ``name`` as bash itself reads the rendered settings."""
    code = _settings(script) + f'\nfor w in "${{{name}[@]}}"; do printf "%s\\0" "$w"; done'
    out = subprocess.run([BASH, "-c", code], capture_output=True, check=True).stdout.decode()
    return out.split("\0")[:-1]


def _directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_gpu_job_script(run_config):
    spec = load_run(run_config, ["trainer.total_epochs=2"], nodes=4, gpus_per_node=8)
    script = render_script(spec, SlurmOptions(partition="gpu", account="rl", time="2-00:00:00"), environ={})
    directives = _directives(script)
    assert "--nodes=4" in directives and "--ntasks-per-node=1" in directives
    assert "--gpus-per-node=8" in directives
    assert "--exclusive" in directives  # no CPU count given: whole nodes
    assert {"--partition=gpu", "--account=rl", "--time=2-00:00:00", "--export=ALL"} <= set(directives)
    assert f"--output={spec.run_dir}/slurm/slurm-%j.out" in directives
    assert _bash_array(script, "DRIVER_CMD") == [
        "rlhf-megatron",
        "train",
        "--config",
        run_config,
        "trainer.total_epochs=2",
        "trainer.nnodes=4",
        "trainer.n_gpus_per_node=8",
        "trainer.resume_mode=auto",  # a requeued run reruns this command: it resumes by itself
    ]
    assert "GPUS_PER_NODE=8" in script and "NNODES=4" in script
    assert _bash_array(script, "CONTAINER_EXEC") == [] and _bash_array(script, "CONTAINER_SRUN_ARGS") == []


def test_script_is_valid_bash(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    script = render_script(spec, SlurmOptions(container="nvcr.io#org/img:1", env={"X": "a b'c"}), environ={})
    subprocess.run([BASH, "-n"], input=script.encode(), check=True)
    assert script.startswith("#!/bin/bash\n#SBATCH ")  # directives must precede any command


def test_cpu_job_asks_for_cpus_and_runs_in_cpu_mode(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=0)
    script = render_script(spec, SlurmOptions(cpus_per_node=16), environ={})
    directives = _directives(script)
    assert "--cpus-per-task=16" in directives and "--exclusive" not in directives
    assert not any(d.startswith("--gpus") for d in directives)
    assert _bash_array(script, "DRIVER_CMD")[-3:-1] == ["trainer.nnodes=2", "trainer.device=cpu"]
    assert "CPUS_PER_NODE=16" in script


def test_pyxis_container_runs_every_step_in_the_image(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    opts = SlurmOptions(container="nvcr.io#org/rlhf:gpu", container_mounts=["/data:/data"])
    script = render_script(spec, opts, environ={})
    cwd = str(Path.cwd())  # the run and log dirs are inside it, so mounted with it
    assert _bash_array(script, "CONTAINER_SRUN_ARGS") == [
        "--container-image=nvcr.io#org/rlhf:gpu",
        "--container-name=rlhf-megatron",
        f"--container-mounts={cwd}:{cwd},/data:/data",
        f"--container-workdir={cwd}",
    ]
    assert _bash_array(script, "CONTAINER_EXEC") == []
    assert "export PATH=" not in script  # the image brings its own environment


@pytest.mark.parametrize("gpus,nv", [(8, ["--nv"]), (0, [])])
def test_apptainer_container(run_config, gpus, nv):
    """Run and log dirs outside the working directory are bound too, at the same paths."""
    spec = load_run(run_config, ["trainer.default_local_dir=/scratch/ckpt"], nodes=1, gpus_per_node=gpus)
    opts = SlurmOptions(
        container="/images/rlhf.sif", container_runtime="apptainer", log_dir=Path("/scratch/logs")
    )
    script = render_script(spec, opts, environ={})
    cwd = str(Path.cwd())
    binds = f"{cwd}:{cwd},/scratch/ckpt:/scratch/ckpt,/scratch/logs:/scratch/logs"
    assert _bash_array(script, "CONTAINER_EXEC") == [
        "apptainer",
        "exec",
        *nv,
        "--bind",
        binds,
        "--pwd",
        cwd,
        "/images/rlhf.sif",
    ]
    assert _bash_array(script, "CONTAINER_SRUN_ARGS") == []


def test_environment_passes_through_without_secrets(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    environ = {"NCCL_DEBUG": "INFO", "HF_HOME": "/cache/hf dir", "WANDB_API_KEY": "s3cret", "OTHER": "x"}
    script = render_script(spec, SlurmOptions(env={"NCCL_IB_HCA": "mlx5"}), environ=environ)
    assert "export NCCL_DEBUG=INFO" in script
    assert "export HF_HOME='/cache/hf dir'" in script
    assert "export NCCL_IB_HCA=mlx5" in script
    assert "s3cret" not in script  # the secret travels only by sbatch --export=ALL
    assert "passed by sbatch --export=ALL): WANDB_API_KEY" in script
    assert "OTHER" not in script


def test_driver_cmd_replaces_the_trainer(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=0)
    script = render_script(spec, SlurmOptions(driver_cmd="python probe.py --out \"$X\" 'a b'"), environ={})
    assert _bash_array(script, "DRIVER_CMD") == ["bash", "-c", "python probe.py --out \"$X\" 'a b'"]
    assert _bash_array(script, "RESTART_CMD") == []  # a custom driver reads SLURM_RESTART_COUNT itself


# ---- restarts ------------------------------------------------------------------------


def test_job_requeues_and_reruns_through_the_restart_wrapper(run_config):
    spec = load_run(run_config, [], nodes=2, gpus_per_node=8)
    script = render_script(spec, SlurmOptions(), environ={})
    directives = _directives(script)
    assert "--requeue" in directives and "--open-mode=append" in directives
    assert "MAX_REQUEUES=3" in script
    assert _bash_array(script, "RESTART_CMD") == [
        "python3",
        "-m",
        "rlhf_megatron.launch.restart",
        "--run-dir",
        str(spec.run_dir),
    ]


def test_max_requeues_0_makes_the_job_not_requeueable(run_config):
    spec = load_run(run_config, [], nodes=1, gpus_per_node=8)
    directives = _directives(render_script(spec, SlurmOptions(max_requeues=0), environ={}))
    assert "--no-requeue" in directives and "--requeue" not in directives
    with pytest.raises(LaunchError, match="--max-requeues must be 0 or more"):
        render_script(spec, SlurmOptions(max_requeues=-1), environ={})


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.resume_mode=disable"],
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ckpt/global_step_40"],
    ],
    ids=["disable", "resume_path"],
)
def test_an_explicit_resume_choice_is_kept_for_the_first_run(run_config, overrides):
    """The restart wrapper, not the command, decides what a rerun resumes from."""
    spec = load_run(run_config, overrides, nodes=1, gpus_per_node=8)
    driver = _bash_array(render_script(spec, SlurmOptions(), environ={}), "DRIVER_CMD")
    assert "trainer.resume_mode=auto" not in driver
    assert driver[4 : 4 + len(overrides)] == overrides


def _run_prologue(script: str, tmp_path: Path, restarts: int) -> tuple[subprocess.CompletedProcess, str]:
    """Run the rendered script up to its first srun, with stand-in scontrol/srun commands."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = show ] && echo node1\nexit 0\n'
    )
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # stops the job right after the checks
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_RESTART_COUNT": str(restarts),
    }
    proc = subprocess.run([BASH, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    return proc, calls.read_text() if calls.exists() else ""


def test_requeues_past_the_bound_exit_1_and_turn_requeueing_off(run_config, tmp_path):
    spec = load_run(run_config, [f"trainer.default_local_dir={tmp_path / 'run'}"], nodes=1, gpus_per_node=0)
    script = render_script(spec, SlurmOptions(max_requeues=2), environ={})
    # The last allowed rerun turns requeueing off, then goes on (here: to the stand-in srun's failure).
    proc, calls = _run_prologue(script, tmp_path, restarts=2)
    assert "restart count 2 (SLURM_RESTART_COUNT; at most 2 requeue(s))" in proc.stdout
    assert "update JobId=77 Requeue=0" in calls
    assert "not running again" not in proc.stdout and "could not find the IP address" in proc.stdout
    # One more (e.g. a manual `scontrol requeue` that raced the update): refused before Ray starts.
    proc, _ = _run_prologue(script, tmp_path, restarts=3)
    assert proc.returncode == 1
    assert "requeued 3 time(s), more than MAX_REQUEUES=2 (--max-requeues); not running again" in proc.stdout
    assert (tmp_path / "run" / "slurm" / "status-77").read_text().strip() == "exit_code=1"


def test_dry_run_prints_the_script(launch, run_config):
    rc, out, err = launch(
        ["slurm", "--config", run_config, "--nodes", "2", "--gpus-per-node", "8", "--dry-run"]
    )
    assert rc == 0, err
    assert out.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in out


def test_submit_writes_the_script_and_prints_the_job_id(launch, run_config, tmp_path, monkeypatch):
    """`sbatch` here is a stand-in that records its arguments, as the real one is tested
    in test_slurm_real.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "sbatch_args"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/sh\necho "$@" > {record}\necho "4242;cluster0"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    rc, out, err = launch(
        [
            "slurm",
            "--config",
            run_config,
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--",
            f"trainer.default_local_dir={run_dir}",
        ]
    )
    assert rc == 0, err
    assert out.strip() == "Submitted batch job 4242"
    script = run_dir / "slurm" / "grpo_tiny.sbatch"
    assert record.read_text().split() == ["--parsable", str(script)]
    assert f"trainer.default_local_dir={run_dir}" in script.read_text()
    assert "slurm-4242.out" in err
