#!/usr/bin/env bash
# The whole pipeline on a CPU machine, each stage's output feeding the next (configs/pipeline_cpu/):
#
#   1. a random tiny Llama (the base model) and the arithmetic task's data: SFT transcripts,
#      preference pairs, RL prompts (tools/data/arith_{sft,prefs}.py, tools/data/arith.py);
#   2. SFT on the Megatron engine (python -m rlhf_megatron.sft), exported to Hugging Face;
#   3. a reward model trained from the SFT model on the pairs (python -m rlhf_megatron.rm), exported;
#   4. GRPO from the SFT model with the reward model scoring every response (python -m rlhf_megatron.train).
#
#   bash scripts/pipeline_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
PY=.venv/bin/python
OUT=outputs/pipeline
rm -rf "$OUT"
mkdir -p "$OUT/data"

# The base model: the quickstart's architecture with random weights (no pre-training).
$PY - <<'PYEOF'
from rlhf_megatron.models.tiny import make_tiny_hf_model
make_tiny_hf_model("outputs/pipeline/base_model", "llama", num_layers=2, hidden_size=256, num_heads=4,
                   num_kv_heads=2, ffn_hidden_size=512, max_position_embeddings=128)
PYEOF
for tool in arith_sft arith_prefs arith; do
  name=${tool#arith_}; [ "$tool" = arith ] && name=arith
  $PY tools/data/$tool.py --output-dir "$OUT/data/$name" --train-size 2048 --test-size 200 --seed 0 >/dev/null
done

$PY -m rlhf_megatron.sft --config pipeline_cpu/sft "$@" >"$OUT/sft.log"
.venv/bin/rlhf-megatron convert mcore-to-hf --ckpt "$OUT/sft/global_step_$(cat "$OUT/sft/latest_checkpointed_iteration.txt")/actor" \
  --out "$OUT/sft_hf" >/dev/null
$PY -m rlhf_megatron.rm --config pipeline_cpu/rm >"$OUT/rm.log"
.venv/bin/rlhf-megatron convert mcore-to-hf \
  --ckpt "$OUT/rm/global_step_$(cat "$OUT/rm/latest_checkpointed_iteration.txt")/reward_model" --out "$OUT/rm_hf" >/dev/null
$PY -m rlhf_megatron.train --config pipeline_cpu/ppo >"$OUT/ppo.log"

echo
for stage in sft rm ppo; do
  echo "$stage: $OUT/$stage/metrics.jsonl, plot $OUT/$stage/metrics.png, log $OUT/$stage.log"
done
