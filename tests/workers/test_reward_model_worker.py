"""RewardModelWorker on real Ray + megatron-core: the TP=2 Megatron reward model scores the last token
exactly like transformers' *ForSequenceClassification, re-templating for its own tokenizer."""

import warnings

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    from rlhf_megatron.data.tokenizer import build_tiny_tokenizer
    from rlhf_megatron.models.tiny import make_tiny_hf_model

    root = tmp_path_factory.mktemp("rm")
    actor = make_tiny_hf_model(
        root / "actor", "llama", num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2
    )
    # The reward model has its own tokenizer (an extra word shifts the vocabulary), so prompts and
    # responses must be decoded with the actor's tokenizer and re-tokenized for it.
    tok = build_tiny_tokenizer(extra_words=("Answer",))
    config = transformers.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    rm = transformers.LlamaForSequenceClassification(config).eval()
    rm.save_pretrained(root / "rm", safe_serialization=True)
    tok.save_pretrained(root / "rm")
    return str(actor), str(root / "rm"), rm, tok


def _chat_ids(tok, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tok(text, add_special_tokens=False).input_ids


def test_reward_model_scores_match_transformers(models):
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from rlhf_megatron.config.context import RunContext
    from rlhf_megatron.planning import load_config
    from rlhf_megatron.rollout.base import assemble_rollout
    from rlhf_megatron.scheduling import ResourcePool, WorkerGroup
    from rlhf_megatron.workers import RewardModelWorker

    actor_path, rm_path, rm, rm_tok = models
    actor_tok = AutoTokenizer.from_pretrained(actor_path)
    prompts = ["3+4=", "12+9=", "Answer 5+5="]
    completions = ["7", "21", "10"]
    ids = [_chat_ids(actor_tok, [{"role": "user", "content": p}], True) for p in prompts]
    width = max(map(len, ids))
    from rlhf_megatron.data.batch import Batch

    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    batch = Batch.from_dict(
        {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        {"raw_prompt": [[{"role": "user", "content": p}] for p in prompts]},
    )
    responses = [
        actor_tok(c, add_special_tokens=False).input_ids + [actor_tok.eos_token_id] for c in completions
    ]
    rollout = assemble_rollout(batch, responses, [[0.0] * len(r) for r in responses], 1, 6, 0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = load_config(
            "quickstart_cpu_tp2",
            [
                f"actor_rollout_ref.model.path={actor_path}",
                "reward_model.enable=true",
                f"reward_model.model.path={rm_path}",
                f"reward_model.model.input_tokenizer={actor_path}",
                "reward_model.megatron.tensor_model_parallel_size=2",
                "reward_model.megatron.params_dtype=float32",
                "reward_model.micro_batch_size_per_gpu=4",
            ],
            validate=False,
        )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = ResourcePool("rm", [2])
        kwargs = {"section": OmegaConf.to_object(cfg).reward_model, "context": RunContext.from_config(cfg, 1)}
        group = WorkerGroup("reward_model", pool, RewardModelWorker, kwargs)
        group.call.init_model()
        scores = group.call.compute_rm_score(rollout)["rm_scores"]
        group.shutdown()
        pool.remove()
    finally:
        ray.shutdown()

    last = rollout["response_mask"].sum(-1) - 1
    for i, (p, c) in enumerate(zip(prompts, completions)):
        chat = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        rm_ids = torch.tensor([_chat_ids(rm_tok, chat, False)])
        with torch.no_grad():
            expected = rm(input_ids=rm_ids).logits[0, 0]
        assert scores[i, last[i]].item() == pytest.approx(expected.item(), abs=1e-4)
        assert scores[i].abs().sum().item() == pytest.approx(abs(scores[i, last[i]].item()), abs=1e-6)
