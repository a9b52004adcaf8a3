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
#             last node serves (tensor parallel over VLLM_SERVER_GPUS of its GPUs, default all: as many as this
#             node shows) and the others train; on one node the last VLLM_SERVER_GPUS (default 1) of the
#             visible GPUs (CUDA_VISIBLE_DEVICES, else all) serve and the rest train; with one GPU both share it,
#             the server taking VLLM_SERVER_GPU_MEMORY_UTILIZATION (default 0.3) of its memory. Pass the same model
#             to train.py with --model. The server listens only on the address the trainers use (127.0.0.1 on one
#             node) and requires VLLM_API_KEY (a random one is made if unset), which train.py sends: its weight-push
#             endpoints (VLLM_SERVER_DEV_MODE) can load any weights, so keep it on a private network.
#             Weights go from trainer rank 0 over NCCL to a server on GPUs of its own; on one shared GPU (NCCL
#             refuses one GPU twice in a group) over CUDA IPC, whose handles travel pickled over HTTP
#             (VLLM_ALLOW_INSECURE_SERIALIZATION=1, exported): anyone who can reach 127.0.0.1 can run code there.
# Environment: NPROC_PER_NODE (processes per node, at most its GPUs), MASTER_ADDR (rendezvous host, default:
#              first node), MASTER_PORT (rendezvous port, default 29500), NNODES (override SLURM_NNODES),
#              RLOO_GPU_COUNT (override the GPU count), VLLM_SERVER_MODEL, VLLM_SERVER_PORT (default 8000),
#              VLLM_SERVER_GPUS, VLLM_SERVER_GPU_MEMORY_UTILIZATION, VLLM_SERVER_ARGS (extra flags), VLLM_API_KEY.
# --dry-run prints the commands instead of running them.
set -euo pipefail
cd "$(dirname "$0")"

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi

gpus=${RLOO_GPU_COUNT:-$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
nnodes=${NNODES:-${SLURM_NNODES:-1}}
port=${MASTER_PORT:-29500}
vllm_port=${VLLM_SERVER_PORT:-8000}
server=()
train_env=()

if [[ -n "${VLLM_SERVER_MODEL:-}" ]]; then
  # the engine's own OpenAI-compatible server; dev mode exposes /collective_rpc for the weight push
  export VLLM_API_KEY=${VLLM_API_KEY:-$(python -c "import secrets; print(secrets.token_hex(16))")}
  server=(env VLLM_SERVER_DEV_MODE=1 vllm serve "$VLLM_SERVER_MODEL"
          --port "$vllm_port" --logprobs-mode processed_logprobs --generation-config vllm ${VLLM_SERVER_ARGS:-})
  # vLLM's weight-transfer engine, from trainer rank 0 into the server's workers: NCCL when they have GPUs
  # of their own; on one shared GPU CUDA IPC (below): NCCL refuses a group that holds one GPU twice
  transfer=nccl
  if (( nnodes > 1 )); then
    nodes=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
    server_host=${nodes[$((nnodes - 1))]}
    server=(srun --nodes=1 --ntasks=1 --nodelist="$server_host" "${server[@]}" --host "$server_host")
    # the whole node serves: tensor parallel over its GPUs (the allocation's nodes alike: as many as this one)
    serving=${VLLM_SERVER_GPUS:-$gpus}
    (( serving > 1 )) && server+=(--tensor-parallel-size "$serving")
    nnodes=$((nnodes - 1))
    train_nodes=$(IFS=,; echo "${nodes[*]:0:$nnodes}")
  else
    server_host=127.0.0.1
    server+=(--host "$server_host")
    # positions in the visible list, not physical ids: CUDA_VISIBLE_DEVICES=4,5,6,7 means GPUs 4-7 are ours
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then IFS=, read -r -a visible <<< "$CUDA_VISIBLE_DEVICES"
    else visible=($(seq 0 $(( gpus - 1 )))); fi
    serving=${VLLM_SERVER_GPUS:-1}
    if (( ${#visible[@]} == 1 )); then
      echo "launch.sh: one GPU (${visible[0]}): the vLLM server and the trainer share it; the server takes" \
           "${VLLM_SERVER_GPU_MEMORY_UTILIZATION:-0.3} of its memory (VLLM_SERVER_GPU_MEMORY_UTILIZATION)" >&2
      server=(env CUDA_VISIBLE_DEVICES="${visible[0]}" "${server[@]}"
              --gpu-memory-utilization "${VLLM_SERVER_GPU_MEMORY_UTILIZATION:-0.3}")
      train_env=(env CUDA_VISIBLE_DEVICES="${visible[0]}")
      if (( gpus > 0 )); then
        # the IPC handles reach the server pickled, over HTTP, which vLLM refuses unless allowed
        transfer=ipc
        export VLLM_ALLOW_INSECURE_SERIALIZATION=1
        echo "launch.sh: the weights go to the server over CUDA IPC (VLLM_ALLOW_INSECURE_SERIALIZATION=1)" >&2
      fi
    elif (( ${#visible[@]} > 1 )); then
      if (( serving >= ${#visible[@]} )); then
        echo "error: VLLM_SERVER_GPUS=$serving leaves none of the ${#visible[@]} visible GPUs to train on;" \
             "serve on fewer" >&2
        exit 2
      fi
      n_train=$(( ${#visible[@]} - serving ))
      server_list=$(IFS=,; echo "${visible[*]:$n_train}")
      server=(env CUDA_VISIBLE_DEVICES="$server_list" "${server[@]}")
      (( serving > 1 )) && server+=(--tensor-parallel-size "$serving")
      train_env=(env CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${visible[*]:0:$n_train}")")
      gpus=$n_train
    fi
  fi
  (( gpus > 0 )) && server+=(--weight-transfer-config "{\"backend\": \"$transfer\"}")
  set -- "$@" --use_vllm --vllm_mode server --vllm_server_host "$server_host" --vllm_server_port "$vllm_port"
fi

nproc=${NPROC_PER_NODE:-$(( gpus > 0 ? gpus : 1 ))}
if (( gpus > 0 && nproc > gpus )); then
  echo "error: NPROC_PER_NODE=$nproc processes per node but $gpus GPU(s) to train on, so two ranks would share a" \
       "GPU: set NPROC_PER_NODE=$gpus or fewer" >&2
  exit 2
fi
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
