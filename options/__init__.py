"""What a run may turn on, each where it branches from the step (README 'Files'): packed rows
(packing), vLLM (vllm_rollout, vllm_server, weight_source), multi-turn environments and tools
(environments, lookup, tools), LoRA (lora) and evaluation (evaluation)."""
