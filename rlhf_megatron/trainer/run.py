"""Assemble a run from a resolved config: Ray, data, rewards, worker groups, then the loop.

``run_training(cfg)`` is what ``rlhf-megatron train`` calls after loading and
validating the config. Placement: one resource pool of
``trainer.nnodes × trainer.n_gpus_per_node`` processes; the hybrid actor
(+rollout +ref) owns one process per slot, and the critic and the reward
model are colocated in the same bundles (each role gets a share of the
slot). On CPU a slot is one CPU bundle.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf_megatron.algorithms import estimator_needs_critic
from rlhf_megatron.platform import is_cuda

logger = logging.getLogger(__name__)

# Environment for every worker process: one OpenMP thread per process (the processes share
# the cores), vLLM kept in-process and not pinning threads to cores it does not own.
WORKER_ENV = {
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    "PYTHONWARNINGS": "ignore::UserWarning,ignore::DeprecationWarning,ignore::FutureWarning",
    # Test hook (rlhf_megatron/workers/faults.py): forwarded so worker processes see it too.
    **({"RLHF_FAULT": os.environ["RLHF_FAULT"]} if os.environ.get("RLHF_FAULT") else {}),
}


def _init_ray(cfg: DictConfig) -> bool:
    """Join ``RAY_ADDRESS`` when set (launchers), else start a local Ray. Returns True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": {**WORKER_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))}}  # fmt: skip
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
        return False
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    ray.init(num_cpus=max(world, os.cpu_count() or 1), include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=False)  # fmt: skip
    return True


def _loaders(cfg: DictConfig, tokenizer):
    from rlhf_megatron.data import RLHFDataset, StatefulDataLoader, collate_fn

    train = RLHFDataset(list(cfg.data.train_files) if not isinstance(cfg.data.train_files, str)
                        else cfg.data.train_files, tokenizer, cfg.data)  # fmt: skip
    val = RLHFDataset(list(cfg.data.val_files) if not isinstance(cfg.data.val_files, str)
                      else cfg.data.val_files, tokenizer, cfg.data)  # fmt: skip
    if len(train) < int(cfg.data.train_batch_size):
        raise ValueError(
            f"data.train_files has {len(train)} usable rows, fewer than data.train_batch_size="
            f"{cfg.data.train_batch_size}; add data or lower the batch size"
        )
    seed = int(cfg.data.get("seed") or cfg.trainer.seed)
    train_loader = StatefulDataLoader(train, int(cfg.data.train_batch_size), shuffle=bool(cfg.data.shuffle),
                                      seed=seed, drop_last=True, collate_fn=collate_fn)  # fmt: skip
    val_bs = int(cfg.data.val_batch_size or len(val))
    val_loader = StatefulDataLoader(val, min(val_bs, len(val)), shuffle=False, seed=seed, drop_last=False,
                                    collate_fn=collate_fn)  # fmt: skip
    return train_loader, val_loader


def _reward_fns(cfg: DictConfig, tokenizer):
    from rlhf_megatron.rewards import RewardManager, resolve_compute_score

    custom = cfg.custom_reward_function
    score = resolve_compute_score(custom.path, custom.name, custom.get("reward_kwargs"))
    common = dict(compute_score=score, reward_fn_key=str(cfg.data.reward_fn_key), on_error=str(cfg.reward.on_error),
                  num_workers=int(cfg.reward.num_workers))  # fmt: skip
    if int(cfg.reward.num_workers) > 0:
        common["timeout_s"] = float(cfg.reward.timeout_s)
    return RewardManager(tokenizer, num_examine=0, **common), RewardManager(
        tokenizer, num_examine=1, **common
    )


def _worker_groups(cfg: DictConfig, total_steps: int, plain_cfg: dict[str, Any]):
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    use_critic = estimator_needs_critic(str(cfg.algorithm.adv_estimator))
    use_rm = bool(cfg.reward_model.enable)
    colocated = 1 + int(use_critic) + int(use_rm)
    pool = ResourcePool("global_pool", [int(cfg.trainer.n_gpus_per_node)] * int(cfg.trainer.nnodes),
                        use_gpu=is_cuda() and str(cfg.trainer.device) != "cpu")  # fmt: skip
    pool.create()
    kwargs = {"config": plain_cfg}
    groups = {"actor": WorkerGroup("actor", pool, ActorRolloutRefWorker, kwargs, colocated_roles=colocated)}
    if use_critic:
        groups["critic"] = WorkerGroup("critic", pool, CriticWorker, kwargs, colocated_roles=colocated)
    if use_rm:
        groups["reward_model"] = WorkerGroup(
            "reward_model", pool, RewardModelWorker, kwargs, colocated_roles=colocated
        )
    need_ref = bool(cfg.actor_rollout_ref.actor.use_kl_loss) or bool(cfg.algorithm.use_kl_in_reward)
    groups["actor"].call("init_model", need_ref=need_ref, total_steps=total_steps)
    if use_critic:
        groups["critic"].call("init_model", total_steps=total_steps)
    if use_rm:
        groups["reward_model"].call("init_model")
    return pool, groups


def run_training(cfg: DictConfig) -> list[dict[str, Any]]:
    """Train per ``cfg``; returns the per-step metric records (also in ``<run dir>/metrics.jsonl``)."""
    import ray
    from transformers import AutoTokenizer

    from rlhf_megatron.config.arch import count_parameters
    from rlhf_megatron.config.model_arch import ModelArch
    from rlhf_megatron.trainer.checkpoint import CheckpointManager
    from rlhf_megatron.trainer.loggers import Tracker
    from rlhf_megatron.trainer.ppo_trainer import PPOTrainer, StopTraining

    plain = OmegaConf.to_container(cfg, resolve=True)
    model_path = os.path.expanduser(str(cfg.actor_rollout_ref.model.path))
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.get("tokenizer_path") or model_path)
    check_tokenizer_fits_model(tokenizer, ModelArch.from_hf_dir(model_path), model_path)
    train_loader, val_loader = _loaders(cfg, tokenizer)
    total = int(cfg.trainer.total_training_steps or 0)
    if total <= 0:
        total = len(train_loader) * int(cfg.trainer.total_epochs)
    run_dir = Path(str(cfg.trainer.default_local_dir))
    reward_fn, val_reward_fn = _reward_fns(cfg, tokenizer)
    started_ray = _init_ray(cfg)
    tracker = Tracker(list(cfg.trainer.logger), run_dir, total, str(cfg.trainer.project_name),
                      str(cfg.trainer.experiment_name), plain)  # fmt: skip
    pool = groups = None
    try:
        pool, groups = _worker_groups(cfg, total, plain)
        n_params = count_parameters(ModelArch.from_hf_dir(model_path)).total
        trainer = PPOTrainer(
            cfg, actor=groups["actor"], critic=groups.get("critic"), reward_model=groups.get("reward_model"),
            reward_fn=reward_fn, val_reward_fn=val_reward_fn, train_loader=train_loader, val_loader=val_loader,
            tokenizer=tokenizer, tracker=tracker, total_steps=total, n_params=n_params,
            checkpoints=CheckpointManager(run_dir, cfg.trainer.max_actor_ckpt_to_keep),
        )  # fmt: skip
        try:
            history = trainer.fit()
        except StopTraining as stop:
            logger.warning("%s", stop)
            return trainer.history
        _report(run_dir, history)
        return history
    finally:
        tracker.close()
        for group in (groups or {}).values():
            try:
                group.shutdown()
            except Exception as e:  # a failed run reports its own error; teardown must not mask it
                logger.warning("shutting down %s: %s", group.role, e)
        if pool is not None:
            pool.remove()
        if started_ray:
            ray.shutdown()


def check_tokenizer_fits_model(tokenizer, arch, model_path: str) -> None:
    """Every token id the tokenizer can produce must have a row in the model's embedding.

    Checked in the driver before any process starts: a tokenizer with more tokens than the
    model's vocabulary otherwise fails much later as an index error inside an embedding.
    """
    if len(tokenizer) > arch.vocab_size:
        raise ValueError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', '?')}) has {len(tokenizer)} tokens but the model "
            f"at {model_path} has vocab_size={arch.vocab_size}: token ids past {arch.vocab_size - 1} have no "
            "embedding. Use the model's own tokenizer (actor_rollout_ref.model.tokenizer_path) or resize the model"
        )


def _report(run_dir: Path, history: list[dict[str, Any]]) -> None:
    """Tell the user where everything is: metrics, plot, checkpoints."""
    from rlhf_megatron.trainer.plot import load_records, plot

    lines = [f"run directory: {run_dir}", f"metrics:       {run_dir / 'metrics.jsonl'}"]
    try:
        lines.append(f"plot:          {plot(load_records(run_dir), run_dir / 'metrics.png')}")
    except ImportError as e:  # matplotlib is a dev extra
        lines.append(f"plot:          skipped ({e})")
    latest = run_dir / "latest_checkpointed_iteration.txt"
    if latest.is_file():
        step = latest.read_text().strip()
        ckpt = run_dir / f"global_step_{step}" / "actor"
        lines.append(f"checkpoint:    {ckpt}")
        lines.append(
            f"export to HF:  rlhf-megatron convert mcore-to-hf --ckpt {ckpt} --out {run_dir / 'hf_actor'}"
        )
    vals = [r["val/reward_mean"] for r in history if "val/reward_mean" in r]
    if len(vals) >= 2:
        lines.append(f"val/reward_mean: {vals[0]:.3f} -> {vals[-1]:.3f}")
    print("\n".join(lines), flush=True)
