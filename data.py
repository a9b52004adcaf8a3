"""Prompts: the datasets a run trains and evaluates on (any `datasets` source, or the embedded task), the checks on
them before training starts, and which rows each rank takes at each step.

Prompt order is a pure function of the step (prompt_indices), so a resumed run draws exactly the prompts the
interrupted one would have. Turning prompts into completions is rollout.py's job; scoring them is rewards.py's.
"""

import itertools
import os

import torch

import distributed
import rollout
from config import fail


def embedded_task(seed, num_rows=4096):
    """A tiny Qwen2 model, a character tokenizer and a verifiable task, all built locally (no network).

    Task: copy a 4-digit string ("4172=" -> "4172", then EOS). task_reward gives per-position partial credit, so a
    random policy scores ~0.1 and the reward climbs as the model learns to attend to the digit 5 positions back
    and to stop.
    """
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # No <pad> or <unk> the policy could sample and the decoder would hide: padding is EOS, as in many real LMs.
    vocab = ["<eos>", "="] + list("0123456789")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>", eos_token="<eos>")
    # one head of size 64: the smallest head vLLM's CPU attention kernel runs, so `--use_vllm` works here too
    model_config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                               num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                               tie_word_embeddings=True, eos_token_id=0, pad_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)  # same initial weights on every rank
    model = Qwen2ForCausalLM(model_config)
    g = torch.Generator().manual_seed(seed)
    digits = ["".join(map(str, row)) for row in torch.randint(0, 10, (num_rows, 4), generator=g).tolist()]
    dataset = Dataset.from_dict({"prompt": [s + "=" for s in digits], "target": digits})
    return model, tokenizer, dataset



def check_images(dataset, cfg):
    """A dataset with an `image` or `images` column: conversational prompts only, and its first images must load."""
    first = next(iter(dataset))
    prompts = dataset["prompt"] if hasattr(dataset, "__len__") else [first["prompt"]]
    bad = next((p for p in prompts if not rollout.is_conversational(p)), None)
    if bad is not None:
        fail(f"the dataset has images, so prompts must be conversational ([{{'role': 'user', 'content': ...}}]) for "
             f"the images to enter the first user message; got {str(bad)[:80]!r}")
    try:
        rollout.row_images({k: [v] for k, v in first.items()})
    except ValueError as e:
        fail(f"first row: {e}")


DATA_FILE_TYPES = (".json", ".jsonl", ".parquet", ".csv")


def load_data(cfg, split):
    """Any `datasets` source: a Hub name, a save_to_disk directory, a data directory or a json/jsonl/parquet/csv file.
    Streaming gives an IterableDataset (no length, rows read as training goes)."""
    import datasets

    path = cfg.dataset
    if not os.path.exists(path) and (os.path.splitext(path)[1] in DATA_FILE_TYPES or path.startswith((".", "/"))):
        fail(f"dataset file {path!r} does not exist (looked from {os.getcwd()!r}); check the path")
    try:
        if os.path.isfile(path):
            kind = {".jsonl": "json"}.get(os.path.splitext(path)[1], os.path.splitext(path)[1].lstrip("."))
            dataset = datasets.load_dataset(kind, data_files=path, split=split, streaming=cfg.streaming)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            dataset = datasets.load_from_disk(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            dataset = datasets.load_from_disk(path)[split]
        else:
            dataset = datasets.load_dataset(path, cfg.dataset_config, split=split, streaming=cfg.streaming)
        if cfg.streaming and not isinstance(dataset, datasets.IterableDataset):
            dataset = dataset.to_iterable_dataset()
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:  # OSError: unreachable Hub
        fail(f"cannot load dataset {path!r} (split {split!r}): {str(e).splitlines()[0]}")
    columns = dataset.column_names or list(next(iter(dataset)).keys())
    if "prompt" not in columns:
        fail(f"dataset {path!r} has no 'prompt' column (columns: {columns}); rename the column holding the "
             "prompts to 'prompt'")
    if not cfg.streaming and len(dataset) == 0:
        fail(f"dataset {path!r} split {split!r} is empty")
    return dataset


def check_chat_template(dataset, tokenizer, name):
    """Conversational prompts need the tokenizer's chat template."""
    if rollout.is_conversational(next(iter(dataset))["prompt"]) and not getattr(tokenizer, "chat_template", None):
        fail(f"the dataset's prompts are conversations but {name!r} has no chat template; use a chat (Instruct) "
             "model, add a chat_template to its tokenizer_config.json, or give plain string prompts")


def longest_prompt(dataset, tokenizer, cfg):
    """Tokens of the longest prompt after the chat template; None for a stream (no length to go through)."""
    if not hasattr(dataset, "__len__"):
        return None
    return max(map(len, rollout.tokenize_prompts(tokenizer, dataset["prompt"], cfg.chat_template_kwargs)))


def check_prompt_lengths(dataset, tokenizer, model, cfg):
    """Every prompt (after the chat template) plus max_completion_length must fit the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    longest = longest_prompt(dataset, tokenizer, cfg) if limit is not None else None
    if longest is not None and longest + cfg.max_completion_length > limit:
        fail(f"the longest prompt has {longest} tokens; with max_completion_length={cfg.max_completion_length} "
             f"that exceeds the model's {limit} positions. Drop long prompts or lower --max_completion_length")



def load_datasets(cfg):
    """(train dataset or None for the embedded task, eval dataset or None, vision): the data is loaded before any
    model because it is cheaper to find out it is wrong. Image columns make it a vision-language run."""
    if cfg.model is not None and cfg.dataset is None:
        fail("--model needs --dataset (a dataset with a 'prompt' column)")
    dataset = load_data(cfg, cfg.dataset_split) if cfg.dataset is not None else None
    eval_dataset = load_data(cfg, cfg.eval_split) if cfg.eval_split and cfg.dataset else None
    vision = dataset is not None and bool({"image", "images"} & set(dataset.column_names or next(iter(dataset))))
    if vision:
        check_images(dataset, cfg)
    if vision and cfg.model is None:
        fail("the dataset has images: pass --model with a vision-language model")
    return dataset, eval_dataset, vision


def check_data(dataset, tokenizer, processor, model, cfg):
    """Once the tokenizer is known: chat template, prompt lengths, and enough rows for one step."""
    check_chat_template(dataset, processor or tokenizer, cfg.model)
    if processor is None:  # image tokens are only counted once the processor has the images
        check_prompt_lengths(dataset, tokenizer, model, cfg)
    needed = prompts_per_rank(cfg) * distributed.world_size()
    if hasattr(dataset, "__len__") and len(dataset) < needed:
        fail(f"dataset has {len(dataset)} rows but one step needs {needed} prompts; "
             "lower per_device_train_batch_size or gradient_accumulation_steps")


def prompts_per_rank(cfg):
    """P: prompts per rank per step; each gets G completions, B = P * G of them per rank."""
    return cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // cfg.num_generations


def steps_per_epoch(dataset, cfg):
    """Generation steps in one pass over the prompts (None for a stream, which has no length)."""
    if not hasattr(dataset, "__len__"):
        return None
    return len(dataset) // (prompts_per_rank(cfg) * distributed.world_size())


def prompt_indices(step, num_rows, prompts_per_rank, seed, shuffle, shard=None):
    """Dataset rows of generation step `step` for this rank: a pure function of the step, so resuming is exact.

    Every rank draws the same seeded permutation of each epoch and takes its own disjoint slice.
    shard: (rank, world_size), by default this process's.
    """
    rank, world_size = shard or (distributed.rank(), distributed.world_size())
    per_step = prompts_per_rank * world_size
    epoch, i = divmod(step, num_rows // per_step)
    order = (torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle
             else torch.arange(num_rows))
    start = i * per_step + rank * prompts_per_rank
    return order[start:start + prompts_per_rank].tolist()


def prompt_batches(dataset, cfg, start):
    """Rows (a dict of column lists) for every generation step from `start` on, this rank's share only.

    Map-style: prompt_indices, so resuming at any step is exact. Streaming: each rank reads its own part of the
    stream (split_dataset_by_node), shuffled in a buffer, skipping what the first `start` steps consumed.
    """
    P = prompts_per_rank(cfg)
    if hasattr(dataset, "__len__"):
        for step in itertools.count(start):
            yield dataset[prompt_indices(step, len(dataset), P, cfg.seed, cfg.shuffle_dataset)]
    from datasets.distributed import split_dataset_by_node

    stream = split_dataset_by_node(dataset, rank=distributed.rank(), world_size=distributed.world_size())
    if cfg.shuffle_dataset:
        stream = stream.shuffle(seed=cfg.seed, buffer_size=1000)
    rows, to_skip = [], start * P
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        for row in stream:
            if to_skip:
                to_skip -= 1
                continue
            rows.append(row)
            if len(rows) == P:
                yield {key: [r[key] for r in rows] for key in rows[0]}
                rows = []


def max_images_per_row(dataset):
    """The most images one prompt carries (what vLLM must make room for); a streamed `images` column: assume 8."""
    if "images" not in (dataset.column_names or next(iter(dataset))):
        return 1
    return max(len(x or []) for x in dataset["images"]) if hasattr(dataset, "__len__") else 8


def row_images(rows):
    """rollout.row_images, with an unreadable image stopping the run with one line, not a traceback."""
    try:
        return rollout.row_images(rows)
    except ValueError as e:
        fail(str(e))

