"""Shared fixtures: tiny models built locally (no hub), in Hugging Face format on disk."""

import string

import pytest
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_model(path, classifier=False, max_positions=256):
    """A character-level tokenizer over printable ASCII with ChatML specials, and a tiny random Qwen2
    (causal LM, or sequence classifier with one label), saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = specials + sorted(set(string.printable))
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<|endoftext|>"))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    # head_dim 64 (128 / 2 heads): the smallest head size vLLM's CPU attention kernel accepts
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=not classifier, eos_token_id=2, pad_token_id=0, num_labels=1)
    torch.manual_seed(0)
    model = (Qwen2ForSequenceClassification if classifier else Qwen2ForCausalLM)(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("rm") / "tiny-rm", classifier=True)
