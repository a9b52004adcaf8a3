#!/usr/bin/env bash
# Launch train.py on one node or on a SLURM allocation of several nodes, optionally with a vLLM server.
#
#   ./launch.sh [--dry-run] [train.py flags...]
#
# One node:   ./launch.sh --model Qwen/Qwen2-0.5B-Instruct --dataset trl-lib/DeepMath-103K --reward_funcs accuracy_reward
#             runs `torchrun --standalone --nproc_per_node=N train.py ...` (N = visible GPUs, else NPROC_PER_NODE or 1).
# SLURM:      sbatch --nodes=4 --gres=gpu:8 --ntasks-per-node=1 launch.sh --model ... (or inside salloc)
#             runs `srun torchrun --nnodes=$SLURM_NNODES ... --rdzv_endpoint=<first node>:$MASTER_PORT train.py ...`,
#             one torchrun per node, rendezvous on the first node of the allocation.
# vLLM server: VLLM_SERVER_MODEL=<model> reserves generation for vLLM's own server (vllm serve) and adds
#             `--use_vllm --vllm_mode server --vllm_server_host H --vllm_server_port P` to train.py. With SLURM the
#             last node serves and the others train; on one node the GPUs in VLLM_SERVER_GPUS (default: the last
#             one) serve and the rest train. Pass the same model to train.py with --model. The weight push goes
#             through --vllm_sync_dir, which must be on a filesystem both sides see.
# Environment: NPROC_PER_NODE (processes per node), MASTER_ADDR (rendezvous host, default: first node),
#              MASTER_PORT (rendezvous port, default 29500), NNODES (override SLURM_NNODES),
#              VLLM_SERVER_MODEL, VLLM_SERVER_PORT (default 8000), VLLM_SERVER_GPUS, VLLM_SERVER_ARGS (extra flags).
# --dry-run prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")"

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi

gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
nnodes=${NNODES:-${SLURM_NNODES:-1}}
port=${MASTER_PORT:-29500}
vllm_port=${VLLM_SERVER_PORT:-8000}
server=()
train_env=()

if [[ -n "${VLLM_SERVER_MODEL:-}" ]]; then
  # the engine's own OpenAI-compatible server; dev mode exposes /collective_rpc for the weight push
  server=(env VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "$VLLM_SERVER_MODEL"
          --host 0.0.0.0 --port "$vllm_port" --logprobs-mode processed_logprobs --generation-config vllm
          ${VLLM_SERVER_ARGS:-})
  if (( nnodes > 1 )); then
    nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
    server_host=${nodes[$((nnodes - 1))]}
    server=(srun --nodes=1 --ntasks=1 --nodelist="$server_host" "${server[@]}")
    nnodes=$((nnodes - 1))
    train_nodes=$(IFS=,; echo "${nodes[*]:0:$nnodes}")
  else
    server_host=127.0.0.1
    server_gpus=${VLLM_SERVER_GPUS:-$(( gpus > 0 ? gpus - 1 : 0 ))}
    train_gpus=$(python -c "import sys; s=set(sys.argv[1].split(',')); print(','.join(str(i) for i in range(int(sys.argv[2])) if str(i) not in s))" "$server_gpus" "$gpus")
    server=(env CUDA_VISIBLE_DEVICES="$server_gpus" "${server[@]}")
    train_env=(env CUDA_VISIBLE_DEVICES="$train_gpus")
    gpus=$(( gpus > 1 ? gpus - $(tr ',' '\n' <<< "$server_gpus" | wc -l) : gpus ))
  fi
  set -- "$@" --use_vllm --vllm_mode server --vllm_server_host "$server_host" --vllm_server_port "$vllm_port"
fi

nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
if (( nnodes > 1 )) || [[ -n "${train_nodes:-}" ]]; then
  head=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  cmd=(srun --nodes="$nnodes" --ntasks-per-node=1 ${train_nodes:+--nodelist="$train_nodes"} torchrun
       --nnodes="$nnodes" --nproc_per_node="$nproc" --rdzv_backend=c10d --rdzv_id="${SLURM_JOB_ID:-rloo}"
       --rdzv_endpoint="$head:$port" train.py "$@")
else
  cmd=(${train_env[@]+"${train_env[@]}"} torchrun --standalone --nproc_per_node="$nproc" train.py "$@")
fi

if (( dry_run )); then
  if (( ${#server[@]} )); then printf '%q ' "${server[@]}"; echo "&"; fi
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
if (( ${#server[@]} )); then
  "${server[@]}" &
  server_pid=$!
  trap 'kill $server_pid 2>/dev/null' EXIT   # train.py waits for the server's health check (--vllm_server_timeout)
  "${cmd[@]}"
else
  exec "${cmd[@]}"
fi
