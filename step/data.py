"""Prompts: the datasets a run trains and evaluates on (any `datasets` source, or the embedded
task), the checks on them before training starts, and which rows each rank takes at each step.

Prompt order is decided in one place, epoch_order, and read at the data position, the prompt
batches drawn so far (prompt_indices; step/batches.py keeps the position), so a resumed run draws
exactly the prompts the interrupted one would have. A stream's order is its own, shuffled in a
buffer. Turning prompts into completions is rollout.py's job; scoring them is rewards.py's.
"""

import hashlib
import itertools
import json
import os
import sys

import torch

from plumbing import distributed
from step import prompting
from plumbing.config import fail, generation_steps


def environment_prompts(dataset, cfg):
    """An environment that owns its data (TRL's environment_factory without a dataset, or a
    dataset that only routes rows to environments): rows whose prompt is an empty user message,
    to which reset() appends the task. Without a dataset, one generation's worth of such rows."""
    from datasets import Dataset
    empty = [{"role": "user", "content": ""}]
    if dataset is None:
        rows = prompts_per_rank(cfg) * distributed.world_size()
        return Dataset.from_dict({"prompt": [empty] * rows})
    if "prompt" in (dataset.column_names or next(iter(dataset))):
        return dataset
    return dataset.map(lambda row: {"prompt": empty})


def embedded_task(seed, num_rows=4096):
    """A tiny Qwen2 model, a character tokenizer and a verifiable task, all built locally (no
    network).

    Task: copy a 4-digit string ("4172=" -> "4172", then EOS). task_reward gives per-position
    partial credit, so a random policy scores ~0.1 and the reward climbs as the model learns to
    attend to the digit 5 positions back and to stop.
    """
    from datasets import Dataset
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # No <pad> or <unk> the policy could sample and the decoder would hide: padding is EOS, as in
    # many real LMs.
    vocab = ["<eos>", "="] + list("0123456789")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<eos>", eos_token="<eos>")
    # one head of size 64: the smallest head vLLM's CPU attention kernel runs, so `--use_vllm` works
    # here too
    model_config = Qwen2Config(vocab_size=len(vocab), hidden_size=64, intermediate_size=256,
                               num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                               max_position_embeddings=64, tie_word_embeddings=True,
                               eos_token_id=0, pad_token_id=0, bos_token_id=0)
    torch.manual_seed(seed)  # same initial weights on every rank
    model = Qwen2ForCausalLM(model_config)
    g = torch.Generator().manual_seed(seed)
    digits = ["".join(map(str, row)) for row in torch.randint(0, 10, (num_rows, 4),
                                                              generator=g).tolist()]
    dataset = Dataset.from_dict({"prompt": [s + "=" for s in digits], "target": digits})
    return model, tokenizer, dataset


def prompt_column(dataset):
    """A dataset's prompts as one list: iterating datasets' Column (datasets >= 4) formats row
    by row (about 27 us a row, seconds a pass on 100k rows); a slice reads the Arrow column once."""
    return dataset["prompt"][:]


def check_images(dataset, cfg):
    """A dataset with an `image` or `images` column: conversational prompts only, and its first
    images must load."""
    first = next(iter(dataset))
    prompts = prompt_column(dataset) if hasattr(dataset, "__len__") else [first["prompt"]]
    bad = next((p for p in prompts if not prompting.is_conversational(p)), None)
    if bad is not None:
        fail(f"the dataset has images, so prompts must be conversational ([{{'role': 'user', "
             "'content': ...}}]) for the images to enter the first user message; got "
             f"{str(bad)[:80]!r}")
    prompting.row_images({k: [v] for k, v in first.items()})


DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")  # a json/csv file in these, read as it is


def file_kind(path):
    """The `datasets` builder of a data file by its name (data.jsonl.gz: json), or None."""
    stem, suffix = os.path.splitext(path)
    if suffix in COMPRESSED:
        stem, suffix = os.path.splitext(stem)
        return {".parquet": None}.get(suffix, DATA_FILE_TYPES.get(suffix))
    return DATA_FILE_TYPES.get(suffix)


def load_data(cfg, split, streaming=None, path=None):
    """Any `datasets` source: a Hub name, a save_to_disk directory, a data directory or a
    json/jsonl/parquet/csv file. Streaming gives an IterableDataset (no length, rows read as
    training goes). A source that does not load is one line naming it (and, for a file that is not
    UTF-8, the byte offset)."""
    import datasets

    path = cfg.dataset if path is None else path
    streaming = cfg.streaming if streaming is None else streaming
    if not os.path.exists(path) and (file_kind(path) or path.startswith((".", "/"))):
        fail(f"dataset file {path!r} does not exist (looked from {os.getcwd()!r}); check the path")
    if os.path.isfile(path) and not file_kind(path):
        fail(f"dataset file {path!r} is of no type rloo reads: give a .json, .jsonl, .parquet or "
             f".csv file (json and csv also compressed: {', '.join(COMPRESSED)})")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        fail(f"--dataset {path!r} is a model directory (it holds config.json); pass a dataset")
    if os.path.isfile(path):
        check_text_file(path)
    try:
        if os.path.isfile(path):
            dataset = datasets.load_dataset(file_kind(path), data_files=path, split=split,
                                            streaming=streaming)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            dataset = datasets.load_from_disk(path)
        elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            dataset = datasets.load_from_disk(path)[split]
        else:
            dataset = datasets.load_dataset(path, cfg.dataset_config, split=split,
                                            streaming=streaming)
        if streaming and not isinstance(dataset, datasets.IterableDataset):
            dataset = dataset.to_iterable_dataset()
        columns = dataset.column_names or list(next(iter(dataset), {}).keys())
    # OSError: unreachable Hub
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError,
            datasets.exceptions.DatasetGenerationError) as e:
        cause = e.__cause__ or e  # DatasetGenerationError wraps the parser's own message
        fail(f"cannot load dataset {path!r} (split {split!r}): {first_line(cause)}")
    if not columns:
        fail(f"dataset {path!r} split {split!r} has no rows")
    if "prompt" not in columns and not cfg.environment:  # an environment's reset() may give it
        fail(f"dataset {path!r} has no 'prompt' column (columns: {columns}); rename the column "
             "holding the prompts to 'prompt'")
    if not streaming and len(dataset) == 0:
        fail(f"dataset {path!r} split {split!r} is empty")
    return dataset


def first_line(error):
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def check_text_file(path):
    """json/jsonl/csv files must be UTF-8: the first undecodable byte, by offset, rather than a
    parser's traceback."""
    if os.path.splitext(path)[1] not in (".json", ".jsonl", ".csv"):
        return
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        fail(f"dataset file {path!r} is empty")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        fail(f"dataset file {path!r} is not UTF-8: byte {e.start} (line {line}) is "
             f"{raw[e.start:e.start + 1]!r}; re-encode it as UTF-8")


def prompt_problem(prompt):
    """What is wrong with one row's prompt, or None: a non-empty string, or a non-empty list of
    messages, each a dict with a string `role` and a `content` (a string, or a list of parts for
    images)."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "an empty string"
    if not isinstance(prompt, list):
        return (f"{str(prompt)[:60]!r} of type {type(prompt).__name__} (a CSV column of digits "
                "loads as numbers)")
    if not prompt:
        return "an empty list of messages"
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            return (f"a list whose item {j} is {str(message)[:40]!r} of type "
                    f"{type(message).__name__}, not a {{'role', 'content'}} message (pre-split "
                    "words are not a conversation)")
        if not isinstance(message.get("role"), str):
            return f"a conversation whose message {j} has no string 'role' ({str(message)[:60]!r})"
        if "content" not in message:
            return (f"a conversation whose message {j} ({message['role']}) has no 'content' "
                    f"({str(message)[:60]!r})")
        if not isinstance(message["content"], (str, list)):
            return (f"a conversation whose message {j} ({message['role']}) has a 'content' of "
                    f"type {type(message['content']).__name__}, not a string "
                    f"({str(message)[:60]!r})")
    return None


def check_prompts(prompts, where, first_row=0):
    """Every row's prompt (prompt_problem), naming the split and the row."""
    for i, prompt in enumerate(prompts):
        problem = prompt_problem(prompt)
        if problem is not None:
            fail(f"{where} row {first_row + i}: the prompt is {problem}; a prompt is a non-empty "
                 f"string or a list of {{'role': ..., 'content': ...}} messages")


def check_chat_template(prompts, tokenizer, name, where):
    """Conversational prompts need the tokenizer's chat template."""
    row = next((i for i, p in enumerate(prompts) if prompting.is_conversational(p)), None)
    if row is not None and not getattr(tokenizer, "chat_template", None):
        model = "the embedded model (no --model)" if name is None else repr(name)
        fail(f"{where} row {row}: the prompt is a conversation but {model} has no chat template; "
             "use a chat (Instruct) model, add a chat_template to its tokenizer_config.json, or "
             "give plain string prompts")


def check_roles(prompts, tokenizer, cfg, where):
    """Every message's role is one the chat template renders (prompting.allowed_roles), and the
    template keeps every message's content: one probe render per sequence of roles."""
    allowed, probed = prompting.allowed_roles(tokenizer), set()
    for i, prompt in enumerate(prompts):
        if not prompting.is_conversational(prompt):
            continue
        roles = tuple(message["role"] for message in prompt)
        unknown = next((role for role in roles if role not in allowed), None)
        if unknown is not None:
            fail(f"{where} row {i}: a message has the role {unknown!r}, which chat templates do "
                 f"not know (rendered verbatim or dropped); roles: {', '.join(allowed)}")
        if roles in probed:
            continue
        probed.add(roles)
        dropped = prompting.dropped_content(tokenizer, prompt, cfg.chat_template_kwargs)
        if dropped is not None:
            j, text = dropped
            model = cfg.model or "the model"
            fail(f"{where} row {i}: the chat template of {model!r} leaves out message {j} "
                 f"({prompt[j]['role']}: {text[:60]!r}) when it renders the prompt, so the model "
                 "would never see it: change that message's role or the template")


def prompt_lengths(prompts, tokenizer, cfg, where):
    """Token counts after the chat template; a conversation the template cannot render is one line
    naming its row."""
    try:
        return list(map(len, prompting.tokenize_prompts(tokenizer, prompts,
                                                      cfg.chat_template_kwargs)))
    # noqa: BLE001 (jinja's errors, the template's own raise_exception): find the row
    except Exception:
        for i, prompt in enumerate(prompts):
            try:
                prompting.tokenize_prompts(tokenizer, [prompt], cfg.chat_template_kwargs)
            except Exception as e:  # noqa: BLE001
                fail(f"{where} row {i}: the chat template cannot render this prompt "
                     f"({first_line(e)}): {str(prompt)[:120]!r}")
        raise


def longest_prompt(dataset, tokenizer, cfg):
    """Tokens of the longest prompt after the chat template; None for a stream (no length to go
    through)."""
    if not hasattr(dataset, "__len__"):
        return None
    return max(prompt_lengths(prompt_column(dataset), tokenizer, cfg, "dataset"))


def check_prompt_lengths(prompts, tokenizer, model, cfg, where):
    """Every prompt (after the chat template) plus max_completion_length must fit the model's
    context."""
    lengths = prompt_lengths(prompts, tokenizer, cfg, where)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if limit is not None and lengths[longest] + cfg.max_completion_length > limit:
        fail(f"{where} row {longest}: the longest prompt has {lengths[longest]} tokens; with "
             f"max_completion_length={cfg.max_completion_length} that exceeds the model's {limit} "
             "positions. Drop long prompts or lower --max_completion_length")


# What a reward function gets beside the row's columns (rewards.py), each by keyword: a column of
# one of these names would be a second value for it. `environments` (the environment instances) is
# reserved for the environment work.
REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "step", "trainer_state",
                    "log_extra", "log_metric", "environments")
# Columns the trainer reads itself: `environment` routes a row to one of several environments
# (TRL's name), so a column of that name that means something else would be misread.
RESERVED_COLUMNS = ("environment",)


def check_columns(columns, where, routed=False):
    """A dataset's columns reach reward functions as keyword arguments: none may take the name of
    an argument the trainer passes, nor a name the trainer reserves (`environment`, but in a run
    with --environment, whose rows it routes). One line at start-up."""
    for column in columns:
        if column in REWARD_ARGUMENTS:
            fail(f"{where} has a column {column!r}, which is also the name of an argument the "
                 f"trainer passes reward functions ({', '.join(REWARD_ARGUMENTS)}); rename the "
                 "column")
        if column in RESERVED_COLUMNS and not routed:
            fail(f"{where} has a column {column!r}, a name rloo reserves (it routes each row to "
                 "one of several environments with --environment); rename the column")


# an eval set's metric names of one or two words (options/evaluation.py): with several sets, set x's
# aux_loss and set x_aux's loss would both be eval_x_aux_loss
EVAL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "loss", "aux_loss")


def check_eval_names(names):
    """With several eval sets a metric is eval_<set>_<metric>: no two sets may write one key."""
    for a, b in itertools.permutations(names, 2):
        if not b.startswith(a + "_"):
            continue
        rest = b[len(a) + 1:]
        clash = next((m for m in EVAL_METRICS if f"{rest}_{m}" in EVAL_METRICS), None)
        if clash is not None:
            fail(f"eval sets {a!r} and {b!r} would both log eval_{b}_{clash} (set {a}'s "
                 f"{rest}_{clash} and set {b}'s {clash}); rename one of them")


def load_datasets(cfg):
    """(train dataset or None for the embedded task, {name: eval set}, vision): the data is loaded
    before any model because it is cheaper to find out it is wrong. Image columns make it a
    vision-language run. Eval sets are loaded whole even with --streaming (evaluation goes through
    all of each): the splits of --eval_split, named by split, then each --eval_dataset
    NAME=SOURCE[@SPLIT]."""
    if cfg.model is not None and cfg.dataset is None and not cfg.environment:
        fail("--model needs --dataset (a dataset with a 'prompt' column)")
    dataset = load_data(cfg, cfg.dataset_split) if cfg.dataset is not None else None
    if cfg.environment and (dataset is not None or cfg.model is not None):
        dataset = environment_prompts(dataset, cfg)
    eval_sets = {split: load_data(cfg, split, streaming=False) for split in cfg.eval_split or []}
    for named in cfg.eval_dataset or []:
        name, _, source = named.partition("=")
        source, _, split = source.rpartition("@") if "@" in source else (source, "", "train")
        eval_sets[name] = load_data(cfg, split, streaming=False, path=source)
    if dataset is not None:
        check_columns(dataset.column_names or next(iter(dataset)), f"--dataset {cfg.dataset}",
                      bool(cfg.environment))
    if hasattr(dataset, "__len__"):  # a stream's rows are checked as they are drawn
        check_prompts(prompt_column(dataset), "dataset")
    check_eval_names(list(eval_sets))
    for name, split in eval_sets.items():
        if cfg.environment:
            split = eval_sets[name] = environment_prompts(split, cfg)
        check_columns(split.column_names, eval_where(cfg, name), bool(cfg.environment))
        check_prompts(prompt_column(split), eval_where(cfg, name))
    vision = dataset is not None and bool({"image", "images"} & set(dataset.column_names
                                                                    or next(iter(dataset))))
    if vision:
        check_images(dataset, cfg)
    if vision and cfg.model is None:
        fail("the dataset has images: pass --model with a vision-language model")
    return dataset, eval_sets, vision


def eval_where(cfg, name):
    """How an error names an eval set."""
    return f"eval {'split' if name in (cfg.eval_split or []) else 'set'} {name!r}"


def check_data(dataset, tokenizer, processor, model, cfg, where="dataset"):
    """Once the tokenizer is known: chat template and prompt lengths of every row, and enough rows
    for one step (a stream's rows are checked as they are drawn)."""
    if not hasattr(dataset, "__len__"):  # a stream: its first row now, every row when it is drawn
        first = [next(iter(dataset))["prompt"]]
        check_chat_template(first, processor or tokenizer, cfg.model, "stream")
        check_roles(first, processor or tokenizer, cfg, "stream")
        prompting.check_representable(first, tokenizer, cfg, "stream")
        return
    prompts = prompt_column(dataset)
    check_chat_template(prompts, processor or tokenizer, cfg.model, where)
    prompting.check_representable(prompts[:64], tokenizer, cfg, where)
    if processor is None:  # image tokens are only counted once the processor has the images
        check_prompt_lengths(prompts, tokenizer, model, cfg, where)
    check_roles(prompts, processor or tokenizer, cfg, where)
    needed = prompts_per_rank(cfg) * distributed.world_size()
    if where == "dataset" and len(dataset) < needed:
        fail(f"dataset has {len(dataset)} rows but one step needs {needed} prompts; "
             "lower per_device_train_batch_size or steps_per_generation")


def prompts_per_rank(cfg):
    """P: prompts per rank per generated batch; each gets G completions, B = P * G of them per
    rank: per_device_train_batch_size * steps_per_generation."""
    B = cfg.per_device_train_batch_size * generation_steps(cfg, distributed.world_size())
    return B // cfg.num_generations


def steps_per_epoch(dataset, cfg):
    """Generated batches in one pass over the prompts (None for a stream, which has no length)."""
    if not hasattr(dataset, "__len__"):
        return None
    return len(dataset) // (prompts_per_rank(cfg) * distributed.world_size())


def epoch_order(dataset, epoch, cfg):
    """The run's data order, decided here alone: one pass over the prompts (an epoch) as the run
    reads it, len(dataset) row indices. A seeded permutation of each epoch (--shuffle_dataset,
    TRL's default), else the dataset's own order. A new order (a curriculum: README 'How to change
    one thing') replaces this function; kept a function of its arguments, every rank reads the same
    order and a resumed run the rows the interrupted one would have."""
    if not cfg.shuffle_dataset:
        return torch.arange(len(dataset))
    return torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed + epoch))


def prompt_indices(position, dataset, prompts_per_rank, cfg, shard=None):
    """Dataset rows of the position-th prompt batch for this rank: its slice of epoch_order, a
    pure function of the position, so resuming is exact; the ranks' slices are disjoint. shard:
    (rank, world_size), by default this process's."""
    rank, world_size = shard or (distributed.rank(), distributed.world_size())
    per_step = prompts_per_rank * world_size
    epoch, i = divmod(position, len(dataset) // per_step)
    start = i * per_step + rank * prompts_per_rank
    order = torch.as_tensor(epoch_order(dataset, epoch, cfg))
    return order[start:start + prompts_per_rank].tolist()


def prompt_batches(dataset, cfg, start, digest=None):
    """Rows (a dict of column lists) of every prompt batch from position `start` on, this rank's
    share only.

    Map-style: prompt_indices, so resuming at any step is exact. Streaming: each rank reads its own
    part of the stream (split_dataset_by_node), shuffled in a buffer, reading again (now, at
    start-up) what the first `start` batches consumed; digest (a hashlib object) takes every prompt
    read, so a resumed run knows whether those rows are the ones its checkpoint's run read.
    """
    P = prompts_per_rank(cfg)
    if hasattr(dataset, "__len__"):
        return (dataset[prompt_indices(position, dataset, P, cfg)]
                for position in itertools.count(start))
    rows = stream_rows(dataset, cfg, digest or hashlib.sha256())
    for _ in range(start * P):
        next(rows)
    return stream_batches(rows, P)


def stream_rows(dataset, cfg, digest):
    """A stream's rows for this rank, epoch after epoch, each checked and its prompt hashed."""
    from datasets.distributed import split_dataset_by_node

    stream = split_dataset_by_node(dataset, rank=distributed.rank(),
                                   world_size=distributed.world_size())
    if cfg.shuffle_dataset:
        stream = stream.shuffle(seed=cfg.seed, buffer_size=1000)
    seen = 0
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        for row in stream:
            seen += 1
            check_prompts([row["prompt"]], "stream", seen - 1)
            add_prompt(digest, row["prompt"])
            yield row
        if not seen:
            fail(f"the dataset stream {cfg.dataset!r} gave this rank no rows; check the dataset "
                 "and its split")


def stream_batches(rows, P):
    while True:
        batch = [next(rows) for _ in range(P)]
        yield {key: [row[key] for row in batch] for key in batch[0]}


def add_prompt(digest, prompt):
    """One prompt into a hash of prompts in order (images in content parts by their type only)."""
    text = json.dumps(prompt, sort_keys=True, default=lambda value: type(value).__name__)
    digest.update(text.encode() + b"\n")


def identity(dataset):
    """What identifies a dataset's rows at a data position (prompt_indices draws from them): their
    count and a hash of their prompts in order; None for a stream (its rows read so far identify it,
    prompt_batches' digest)."""
    if not hasattr(dataset, "__len__"):
        return None
    digest = hashlib.sha256()
    for prompt in prompt_column(dataset):
        add_prompt(digest, prompt)
    return {"rows": len(dataset), "prompts": digest.hexdigest()[:16]}


def seen(dataset, tokenizer, cfg):
    """A hash of the first prompts' token ids as the model sees them (the tokenizer and its chat
    template applied): a resume checks them, as the rows, against its checkpoint's run. None for
    prompts with images (their processor renders them)."""
    prompts = [row.get("prompt") for row in itertools.islice(iter(dataset), 8)]
    parts = [m.get("content") for p in prompts if prompting.is_conversational(p) for m in p]
    if not prompts or None in prompts or not all(isinstance(c, str) for c in parts):
        return None  # an environment's prompts, or images
    ids = prompting.tokenize_prompts(tokenizer, prompts, cfg.chat_template_kwargs)
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def data_change(saved, now):
    """How the data differs from what a checkpoint recorded (identity, or a stream's {"stream": the
    hash of each rank's rows read}), or None."""
    if ("stream" in saved) != ("stream" in now):
        then, since = ("a stream", "a whole dataset") if "stream" in saved else \
            ("a whole dataset", "a stream")
        return f"read as {then} then, as {since} now: --streaming"
    if "stream" in now and len(saved["stream"]) != len(now["stream"]):
        then, since = len(saved["stream"]), len(now["stream"])
        return f"a stream split over {then} processes then, {since} now"
    if "stream" in now:
        same = saved["stream"] == now["stream"]
        return seen_change(saved, now) if same else \
            "the stream's rows up to the data position differ from that run's"
    if saved["rows"] != now["rows"]:
        return f"{saved['rows']} rows then, {now['rows']} now"
    if saved["prompts"] != now["prompts"]:
        return f"the same {now['rows']} rows, with prompts reordered or edited"
    return seen_change(saved, now)


def seen_change(saved, now):
    """The same rows, seen otherwise by the model (a checkpoint from before it was recorded: not
    checked)."""
    if saved.get("seen") and now.get("seen") and saved["seen"] != now["seen"]:
        return RENDERED
    return None


RENDERED = ("the same rows, tokenized otherwise: the model directory's tokenizer or chat template "
            "differ from the run's")


def check_same_data(cfg, saved, now, position):
    """A resumed run's data against its checkpoint's (saved: None from an older rloo, unchecked):
    data changed since would put the data position elsewhere, so prompts of the epoch repeat or go
    unseen. One line (the same on every rank: each has every rank's record), or with
    --accept_data_change a warning, and the run goes on from the same position."""
    if saved is None:
        if distributed.is_main():
            print("rloo: the checkpoint records nothing of its data (an older rloo wrote it): "
                  "resuming without checking that the data is the same", file=sys.stderr)
        return
    change = data_change(saved, now)
    if change is None:
        return
    if not cfg.accept_data_change and change == RENDERED:
        fail(f"--resume_from_checkpoint {cfg.resume_from_checkpoint}: {change}, so the policy "
             "would go on learning from prompts it sees otherwise. Resume with the tokenizer and "
             "template it was written with; or start afresh; or go on as they are now: "
             "--accept_data_change")
    if not cfg.accept_data_change:
        fail(f"--resume_from_checkpoint {cfg.resume_from_checkpoint}: the data changed since the "
             f"checkpoint ({change}), so data position {position} would repeat or skip prompts of "
             "this epoch. Resume with the data it was written with; or start afresh "
             "(--overwrite_output_dir, no --resume_from_checkpoint); or go on with this data from "
             "the same position: --accept_data_change")
    if distributed.is_main():
        print(f"rloo: WARNING: the data changed since the checkpoint ({change}); going on from "
              f"data position {position} as --accept_data_change asks: prompts of this epoch may "
              "repeat or be skipped", file=sys.stderr)


def max_images_per_row(dataset):
    """The most images one prompt carries (what vLLM must make room for); a streamed `images`
    column: assume 8. Counted in Arrow: reading the column in Python decodes every image."""
    import pyarrow.compute as pc
    if "images" not in (dataset.column_names or next(iter(dataset))):
        return 1
    if not hasattr(dataset, "__len__"):
        return 8
    return pc.max(pc.list_value_length(dataset.with_format("arrow")["images"])).as_py() or 0
