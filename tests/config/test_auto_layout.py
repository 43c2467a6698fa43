"""``parallelism: auto`` (``planning/auto_layout.py``, ``planning/cost_model.py``): the loader takes ``auto``
out of the typed merge and writes numbers back; the search keeps explicit sizes, picks the fastest
predicted layout that fits, and says what would fit when none does."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rlhf_megatron.cli import plan_main
from rlhf_megatron.config import ConfigError
from rlhf_megatron.config.auto_keys import follower_keys, take_auto
from rlhf_megatron.planning import load_config
from rlhf_megatron.planning.auto_layout import resolve_auto, search_layouts
from rlhf_megatron.planning.cost_model import CostConstants, load_constants, phase_features, predict_step

A = "actor_rollout_ref."
ACTOR_TP = A + "actor.megatron.tensor_model_parallel_size"
ROLLOUT_TP = A + "rollout.tensor_model_parallel_size"
TRAIN_MICRO = A + "actor.ppo_micro_batch_size_per_gpu"
MICRO = [
    f"{TRAIN_MICRO}=32",
    A + "rollout.log_prob_micro_batch_size_per_gpu=64",
    A + "ref.log_prob_micro_batch_size_per_gpu=64",
]
MANUAL = ["parallelism=manual", f"{ACTOR_TP}=2", f"{ROLLOUT_TP}=2", *MICRO]
TP1 = ["parallelism=manual", f"{ACTOR_TP}=1", f"{ROLLOUT_TP}=1", *MICRO]


def constants(collective: float) -> CostConstants:
    """Constants where only TP collectives and layer passes cost anything (a collective costs ``collective`` s)."""
    return CostConstants(
        device="cpu",
        seconds={
            "forward": {"collectives": collective, "layer_passes": 1e-3},
            "update": {"collectives": collective, "layer_passes": 1e-3},
            "gen": {"engine_steps": 1e-3, "engine_collectives": collective},
        },
        source="test",
    )


def test_take_auto_removes_searchable_keys_and_rejects_others():
    values = {ACTOR_TP: "auto", ROLLOUT_TP: 2, TRAIN_MICRO: "auto", "data.train_batch_size": 8}
    taken, errors = take_auto(values)
    assert taken == {ACTOR_TP, TRAIN_MICRO}
    assert values == {ROLLOUT_TP: 2, "data.train_batch_size": 8}
    _, errors = take_auto({A + "actor.megatron.virtual_pipeline_model_parallel_size": "auto"})
    assert "only these keys take auto" in errors[0]


def test_loader_resolves_auto_to_numbers_and_keeps_explicit_sizes():
    seen = []
    cfg = load_config("quickstart_cpu", [f"{ACTOR_TP}=2", "parallelism=auto"], on_search=seen.append)
    assert OmegaConf.select(cfg, ACTOR_TP) == 2  # explicit: fixed
    assert isinstance(OmegaConf.select(cfg, ROLLOUT_TP), int)  # searched, written back as a number
    assert all(ACTOR_TP not in c.values for c in seen[0].ranked)
    assert all(c.fits for c in seen[0].ranked)
    assert OmegaConf.select(cfg, "parallelism") == "auto"


def test_manual_keeps_the_config_as_written():
    cfg = load_config("quickstart_cpu", MANUAL, on_search=lambda s: pytest.fail("searched"))
    assert (OmegaConf.select(cfg, ACTOR_TP), OmegaConf.select(cfg, ROLLOUT_TP)) == (2, 2)


def test_search_ranks_by_the_cost_model():
    cfg = load_config("quickstart_cpu", MANUAL)
    keys = [ACTOR_TP, ROLLOUT_TP]
    cheap = search_layouts(cfg, keys, constants=constants(0.0))
    costly = search_layouts(cfg, keys, constants=constants(1e-2))
    # With free collectives every layout costs the same passes; with costly ones, TP 1 wins.
    assert costly.ranked[0].values == {ACTOR_TP: 1, ROLLOUT_TP: 1}
    assert costly.ranked[-1].cost.total > costly.ranked[0].cost.total
    assert {c.values[ACTOR_TP] for c in cheap.ranked} == {1, 2}


def test_ref_follows_the_searched_actor_layout():
    cfg = load_config("quickstart_cpu", [*TP1, f"{ROLLOUT_TP}=2"])
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 1  # resolved at load
    # Re-sharding for vLLM priced high: the actor at vLLM's TP 2 wins, and the reference goes with it.
    resharding = CostConstants("cpu", {"sync_weights": {"reshards": 10.0}})
    followers = follower_keys([ACTOR_TP], set())
    assert followers == {
        ACTOR_TP: [
            A + "ref.megatron.tensor_model_parallel_size",
            "critic.megatron.tensor_model_parallel_size",
        ]
    }
    resolve_auto(cfg, [ACTOR_TP], followers=followers, constants=resharding)
    assert (
        OmegaConf.select(cfg, ACTOR_TP) == cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    )
    # A layer that set the reference's size keeps it.
    assert follower_keys([ACTOR_TP], {A + "ref.megatron.tensor_model_parallel_size"})[ACTOR_TP] == [
        "critic.megatron.tensor_model_parallel_size"
    ]


def test_micro_batches_are_the_largest_that_fit():
    cfg = load_config("quickstart_cpu", MANUAL)
    search = search_layouts(cfg, [TRAIN_MICRO], constants=constants(1e-3))
    # TP 2 on 2 processes: DP 1, so one rank holds a whole mini-batch of 8 prompts x 8 responses.
    assert search.ranked[0].values == {TRAIN_MICRO: 64}


def test_cost_features_follow_the_layout():
    tp1 = phase_features(load_config("quickstart_cpu", TP1))
    tp2 = phase_features(load_config("quickstart_cpu", MANUAL))
    assert tp1["update_actor"]["collectives"] < tp2["update_actor"]["collectives"]
    assert tp1["gen"]["engine_collectives"] == 0 < tp2["gen"]["engine_collectives"]
    assert tp1["update_actor"]["flops"] == pytest.approx(tp2["update_actor"]["flops"])
    assert tp1["sync_weights"]["reshards"] == tp2["sync_weights"]["reshards"] == 0


def test_calibrated_cpu_model_prefers_tp1_on_the_quickstart():
    cfg = load_config("quickstart_cpu", MANUAL)
    c = load_constants("cpu")
    tp1 = load_config("quickstart_cpu", TP1)
    assert predict_step(tp1, c).total < predict_step(cfg, c).total


def test_nothing_fits_names_the_overflow_and_the_hardware_that_fits():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart_cpu", ["parallelism=auto", "trainer.gpu_memory_gb=1"])
    text = str(err.value)
    assert "no layout fits 2 GPUs x 1 GiB" in text
    assert "runtime" in text  # the term that overflows
    assert "What would fit: 2 GPUs of 4 GiB" in text


BIG = [
    "parallelism=auto",
    A + "model.path=/nonexistent",
    "model_arch.hidden_size=4096",
    "model_arch.intermediate_size=11008",
    "model_arch.num_attention_heads=32",
    "model_arch.num_key_value_heads=8",
    "model_arch.head_dim=128",
    "model_arch.vocab_size=32000",
    "model_arch.num_hidden_layers=4",
    "model_arch.max_position_embeddings=4096",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "trainer.gpu_memory_gb=40",
    f"{TRAIN_MICRO}=32",
]


def test_explicit_sizes_that_divide_no_layout_are_named_not_a_crash():
    with pytest.raises(ConfigError) as err:
        load_config(
            "quickstart_cpu",
            [
                "parallelism=auto",
                "trainer.n_gpus_per_node=1",
                A + "actor.megatron.tensor_model_parallel_size=2",
            ],
            validate=False,
        )
    text = str(err.value)
    assert "no layout to search" in text and "do not divide the 1 GPUs" in text, text
    assert A + "actor.megatron.tensor_model_parallel_size=2" in text, text


def test_an_explicit_micro_batch_too_big_gets_the_largest_that_fits():
    with pytest.raises(ConfigError) as err:
        load_config("quickstart_cpu", BIG, validate=False)
    text = str(err.value)
    assert "actor's activations" in text
    assert f"the largest micro-batches that fit: {TRAIN_MICRO}=" in text


def test_plan_auto_prints_the_ranking(capsys):
    assert plan_main(["quickstart_cpu", "--auto"]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "runner-up" in out and "memory plan" in out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_stored_constants_price_every_feature_group(device):
    from rlhf_megatron.planning.cost_model import FEATURES

    seconds = load_constants(device).seconds
    assert set(seconds) == set(FEATURES)
    assert all(set(seconds[group]) <= set(names) for group, names in FEATURES.items())


def test_an_overlays_auto_for_an_absent_role_is_not_searched():
    """``configs/models/auto.yaml`` sets the critic's micro-batch to auto; a GRPO run has no critic,
    so that key is not searched (and not printed) and keeps the schema's default."""
    seen = []
    critic_micro = "critic.ppo_micro_batch_size_per_gpu"
    cfg = load_config("quickstart_cpu", [*MANUAL, f"{critic_micro}=auto"], on_search=seen.append)
    assert not seen, "nothing left to search"
    assert OmegaConf.select(cfg, critic_micro) == OmegaConf.select(
        load_config("quickstart_cpu", MANUAL), critic_micro
    )
    seen.clear()
    load_config(
        "quickstart_cpu", [*MANUAL, f"{critic_micro}=auto", f"{TRAIN_MICRO}=auto"], on_search=seen.append
    )
    assert seen and seen[0].keys == [TRAIN_MICRO]


def test_with_a_pipeline_the_cheapest_micro_batch_wins_not_the_largest():
    """PP 2: fewer, larger micro-batches grow the bubble. When FLOPs are what costs, the search prices
    every micro-batch that fits and keeps the smallest bubble; without a pipeline it keeps the largest."""
    flops_only = CostConstants(device="cpu", seconds={"update": {"flops": 1e-9}}, source="test")
    pp2 = [*MANUAL, f"{ACTOR_TP}=1", A + "actor.megatron.pipeline_model_parallel_size=2"]
    search = search_layouts(load_config("quickstart_cpu", pp2), [TRAIN_MICRO], constants=flops_only)
    assert search.ranked[0].values == {TRAIN_MICRO: 1}
    search = search_layouts(load_config("quickstart_cpu", MANUAL), [TRAIN_MICRO], constants=flops_only)
    assert search.ranked[0].values == {TRAIN_MICRO: 64}


def test_cost_constants_refuse_what_the_model_does_not_price():
    with pytest.raises(ValueError, match="unknown group 'train'"):
        CostConstants(device="cpu", seconds={"train": {"flops": 1.0}}, source="test")
    with pytest.raises(ValueError, match=r"update has no feature \['engine_steps'\]"):
        CostConstants(device="cpu", seconds={"update": {"engine_steps": 1.0}}, source="test")


DIST_OPT = A + "actor.megatron.use_distributed_optimizer"


def test_optimizer_sharding_costs_its_collectives_and_bytes():
    ddp = phase_features(load_config("quickstart_cpu", [*TP1, f"{DIST_OPT}=false"]))["update_actor"]
    zero1 = phase_features(load_config("quickstart_cpu", [*TP1, f"{DIST_OPT}=true"]))["update_actor"]
    passes = 4  # 32 prompts in mini-batches of 8
    # ZeRO-1: reduce-scatter + all-gather for the all-reduce, plus the grad norm's and the
    # non-finite check's all-reduces, which ranks holding the same gradients skip.
    assert zero1["collectives"] - ddp["collectives"] == 3 * passes
    assert ddp["sharded_bytes"] == 0 < zero1["sharded_bytes"]
    assert zero1["collective_bytes"] + zero1["sharded_bytes"] == pytest.approx(ddp["collective_bytes"])


def test_auto_takes_the_plain_ddp_optimizer_where_it_fits_and_is_cheaper():
    cfg = load_config("quickstart_cpu", TP1)
    priced = {"update": {"sharded_bytes": 1e-9, "collective_bytes": 5e-10}}
    search = search_layouts(cfg, [DIST_OPT], constants=CostConstants("cpu", priced))
    assert [c.values[DIST_OPT] for c in search.ranked] == [False]
    assert "actor TP1 DDP" not in search.ranked[0].describe() and "DDP" in search.ranked[0].describe()
    # Where the pair costs no more than the all-reduce, the sharded (smaller) state stays.
    even = {"update": {"sharded_bytes": 5e-10, "collective_bytes": 5e-10}}
    assert search_layouts(cfg, [DIST_OPT], constants=CostConstants("cpu", even)).ranked[0].values[DIST_OPT]
    # parallelism: auto searches it; an explicit setting is kept.
    seen = []
    load_config("quickstart_cpu", [], on_search=seen.append)
    assert DIST_OPT in seen[0].keys
    pinned = load_config("quickstart_cpu", [f"{DIST_OPT}=true"], on_search=seen.append)
    assert DIST_OPT not in seen[1].keys and OmegaConf.select(pinned, DIST_OPT) is True


def test_auto_keeps_the_optimizer_sharded_where_the_whole_state_does_not_fit():
    """A 7B actor on 8 x 80 GB: its unsharded fp32 state (~12 bytes a parameter) does not fit, so
    however cheap the plain all-reduce is priced, the search keeps ZeRO-1."""
    cfg = load_config("models/qwen2.5_7b", [])
    priced = {"update": {"sharded_bytes": 1.0, "collective_bytes": 1e-12}}
    search = search_layouts(cfg, [DIST_OPT], constants=CostConstants("cuda", priced))
    assert [c.values[DIST_OPT] for c in search.ranked] == [True]
