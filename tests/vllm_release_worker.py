"""What the colocated engine asks of the vLLM release `import vllm` finds (the installed one, or a release's Python
put first on PYTHONPATH), on a GPU trainer: the options vllm_rollout.engine_options chooses, built into the release's
own EngineArgs (which refuses a field it lacks), and the line vllm_rollout.engine_error makes of the release's own
out-of-memory errors, raised by its own functions on stand-in memory figures. Writes a JSON report to argv[1].
    python tests/vllm_release_worker.py OUT.json"""

import inspect
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from options import vllm_rollout  # noqa: E402

GIB = 2**30
CUDA = torch.device("cuda")  # a device as data: nothing here touches a GPU


def memory_errors():
    """The release's errors for a device short of memory: at start-up (request_memory), when sizing the KV cache
    (no memory left for it, or too little for one sequence), and PyTorch's out-of-memory error."""
    from vllm.v1.worker.utils import request_memory
    try:
        from vllm.v1.core.kv_cache_planning import _check_enough_kv_cache_memory
    except ImportError:  # 0.32
        from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    snapshot = SimpleNamespace(total_memory=80 * GIB, free_memory=10 * GIB, device_="cuda:0")
    cache = SimpleNamespace(gpu_memory_utilization=0.9, resolved_gpu_memory_utilization=0.9,
                            enable_extensible_kv_cache=False)
    hint = {"hint": ""} if "hint" in inspect.signature(_check_enough_kv_cache_memory).parameters else {}
    calls = {"start-up": lambda: request_memory(snapshot, cache),
             "no KV cache": lambda: _check_enough_kv_cache_memory(0, lambda: GIB, 4096, lambda m: 0, **hint),
             "one sequence": lambda: _check_enough_kv_cache_memory(GIB, lambda: 2 * GIB, 4096, lambda m: 2048,
                                                                  **hint)}
    errors = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as e:
            errors[name] = e
    errors["torch"] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return errors


def main(out_path):
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    cfg = train.parse_config(["--use_vllm", "--vllm_enable_sleep_mode", "--bf16", "true"])
    options = vllm_rollout.engine_options(cfg, "some/model", CUDA, max_model_len=1024)
    EngineArgs(**options)  # every option is one of the release's
    lines = {name: vllm_rollout.engine_error(e, cfg, "some/model", CUDA) for name, e in memory_errors().items()}
    lines["unsupported"] = vllm_rollout.engine_error(ValueError("Unsupported head size: 16"), cfg, "some/model", CUDA)
    with open(out_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "options": options, "lines": lines}, f)


if __name__ == "__main__":
    main(sys.argv[1])
