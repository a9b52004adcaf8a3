#!/usr/bin/env bash
# Launch train.py on one node or on a SLURM allocation of several nodes.
#
#   ./launch.sh [--dry-run] [train.py flags...]
#
# One node:   ./launch.sh --model Qwen/Qwen2-0.5B-Instruct --dataset trl-lib/DeepMath-103K --reward_funcs accuracy_reward
#             runs `torchrun --standalone --nproc_per_node=N train.py ...` (N = visible GPUs, else NPROC_PER_NODE or 1).
# SLURM:      sbatch --nodes=4 --gres=gpu:8 --ntasks-per-node=1 launch.sh --model ... (or inside salloc)
#             runs `srun torchrun --nnodes=$SLURM_NNODES ... --rdzv_endpoint=<first node>:$MASTER_PORT train.py ...`,
#             one torchrun per node, rendezvous on the first node of the allocation.
# Environment: NPROC_PER_NODE (processes per node), MASTER_ADDR (rendezvous host, default: first node),
#              MASTER_PORT (rendezvous port, default 29500),
#              NNODES (override SLURM_NNODES).
# --dry-run prints the command instead of running it.
set -euo pipefail
cd "$(dirname "$0")"

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi

gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
nnodes=${NNODES:-${SLURM_NNODES:-1}}
port=${MASTER_PORT:-29500}

if (( nnodes > 1 )); then
  head=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  cmd=(srun --nodes="$nnodes" --ntasks-per-node=1 torchrun --nnodes="$nnodes" --nproc_per_node="$nproc"
       --rdzv_backend=c10d --rdzv_id="${SLURM_JOB_ID:-rloo}" --rdzv_endpoint="$head:$port" train.py "$@")
else
  cmd=(torchrun --standalone --nproc_per_node="$nproc" train.py "$@")
fi

if (( dry_run )); then printf '%q ' "${cmd[@]}"; echo; else exec "${cmd[@]}"; fi
