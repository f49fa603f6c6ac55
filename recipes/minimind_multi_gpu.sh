#!/usr/bin/env bash
# A MiniMind-scale run on one multi-GPU machine (or several): tokenizer -> data -> pretrain -> SFT -> chat.
#
#   bash recipes/minimind_multi_gpu.sh                         # every GPU of this machine, built-in corpora
#   PRETRAIN_DATA=pretrain_hq.jsonl SFT_DATA=sft_mini_512.jsonl bash recipes/minimind_multi_gpu.sh
#   PARALLEL=fsdp PRESET=minimind-104m bash recipes/minimind_multi_gpu.sh
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash recipes/minimind_multi_gpu.sh   # on each node, see docs/training.md
#   SMOKE=1 NPROC=2 bash recipes/minimind_multi_gpu.sh         # the whole recipe in a minute on a CPU (gloo)
#
# Every stage is resumable: run the script again after a crash or a stopped job and each stage
# continues where it stopped (the tokenizer and prepared data are reused, training resumes from
# its last checkpoint). Settings come from the environment variables below; anything in EXTRA is
# passed to both training stages (e.g. EXTRA="--train.compile true --train.activation_checkpointing true").
set -euo pipefail

NANOLM=${NANOLM:-nanolm}                  # the nanolm command (e.g. ".venv/bin/nanolm")
PYTHON=${PYTHON:-python}                  # the Python that has nanolm installed, for torchrun
WORK=${WORK:-runs/minimind}               # everything this recipe writes goes under here
PRETRAIN_DATA=${PRETRAIN_DATA:-sanguo shakespeare sotu}   # built-in corpora, .txt/.jsonl files or directories
SFT_DATA=${SFT_DATA:-idioms chatterbot}   # conversations: MiniMind, OpenAI messages or Alpaca JSONL
PRESET=${PRESET:-minimind-26m}
PARALLEL=${PARALLEL:-ddp}                 # ddp, or fsdp to shard weights, gradients and optimizer state
VOCAB=${VOCAB:-6400}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [[ "$NPROC" -gt 0 ]] || NPROC=1
fi
WORLD=$((NNODES * NPROC))
# MiniMind's pretraining batch: 32 sequences x 512 tokens x 8 accumulation steps = 131k tokens per step.
# grad_accum is the whole job's; it must be a multiple of the number of processes.
ACCUM=${ACCUM:-$(( (8 + WORLD - 1) / WORLD * WORLD ))}
PRETRAIN_STEPS=${PRETRAIN_STEPS:-6000}
SFT_STEPS=${SFT_STEPS:-3000}
SFT_MAX_TOKENS=${SFT_MAX_TOKENS:-512}
EXTRA=${EXTRA:-}

if [[ "${SMOKE:-0}" == 1 ]]; then  # tiny sizes: checks the recipe itself, not the model
  PRESET=tiny VOCAB=600 PRETRAIN_STEPS=${PRETRAIN_STEPS_SMOKE:-12} SFT_STEPS=${SFT_STEPS_SMOKE:-6}
  EXTRA="$EXTRA --train.device cpu --train.batch_size 4 --train.seq_len 64 --model.max_seq_len 64
         --model.d_model 64 --model.n_layer 2 --train.eval_interval 6 --train.eval_batches 2 --train.log_interval 3"
  SFT_MAX_TOKENS=64
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

say() { echo "[recipe] $*"; }
launch() {  # torchrun on this node; with NNODES > 1 every node runs the same command
  if [[ "$NNODES" -gt 1 ]]; then
    "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC" \
      --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "nanolm-$(basename "$WORK")" \
      -m nanolm "$@"
  else
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m nanolm "$@"
  fi
}
resume_flag() { [[ -d "$1/checkpoints" ]] && ls "$1/checkpoints" | grep -q '^step-' && echo "--resume" || true; }

mkdir -p "$WORK"
say "$WORLD process(es) ($NNODES node(s) x $NPROC), $PARALLEL, preset $PRESET, grad_accum $ACCUM, work dir $WORK"

# 1. Tokenizer and data. Every node prepares its own copy (the output is deterministic); on a shared
#    filesystem the second node finds the data already there and does nothing.
[[ -f "$WORK/tok/tokenizer.json" ]] || $NANOLM tokenizer train $PRETRAIN_DATA --out "$WORK/tok" --vocab-size "$VOCAB"
$NANOLM prepare $PRETRAIN_DATA --tokenizer "$WORK/tok" --out "$WORK/data" --workers "${PREP_WORKERS:-8}"
$NANOLM prepare $SFT_DATA --format chat --tokenizer "$WORK/tok" --out "$WORK/sft-data" \
  --max-tokens "$SFT_MAX_TOKENS" --workers "${PREP_WORKERS:-8}"

# 2. Pretraining.
# shellcheck disable=SC2086
launch train --preset "$PRESET" --data "$WORK/data" --out "$WORK/pretrain" --model.vocab_size "$VOCAB" \
  --train.parallel "$PARALLEL" --train.grad_accum "$ACCUM" --train.max_steps "$PRETRAIN_STEPS" \
  $(resume_flag "$WORK/pretrain") $EXTRA

# 3. Supervised fine-tuning on conversations (lr / 10 by the stage's defaults), from the best pretraining checkpoint.
# shellcheck disable=SC2086
launch train --preset "$PRESET" --stage sft --init-from "$WORK/pretrain" --data "$WORK/sft-data" \
  --out "$WORK/sft" --model.vocab_size "$VOCAB" --train.parallel "$PARALLEL" --train.grad_accum "$WORLD" \
  --train.max_steps "$SFT_STEPS" $(resume_flag "$WORK/sft") $EXTRA

# 4. Try it.
if [[ "$NODE_RANK" == 0 ]]; then
  $NANOLM generate "$WORK/pretrain" --prompt "${PROMPT:-话说天下大势}" --max-new-tokens 40 --seed 0
  printf '%s\n' "${QUESTION:-你好，请介绍一下你自己。}" | $NANOLM chat "$WORK/sft"
  say "done: chat with \`$NANOLM chat $WORK/sft\`, serve with \`$NANOLM serve $WORK/sft\`"
fi
