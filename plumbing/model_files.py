"""What a model, reward-model or tokenizer directory must hold, checked once when it loads: its
files (config, weights whole and as their index names them, tokenizer), the weights against the
config, and every token id a run depends on (EOS, pad, BOS) against the embedding. Each check
returns the problem as one phrase naming the file (None: fine); plumbing/models.py stops with it.
"""
import json
import logging
import os
import sys
import zipfile

import torch

from plumbing import distributed
from step.prompting import eos_token_ids


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # in the order from_pretrained looks for them
JSON_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "preprocessor_config.json",
              "processor_config.json", "chat_template.json", "model.safetensors.index.json",
              "pytorch_model.bin.index.json")


def model_dir_problem(path, needs=("config", "weights", "tokenizer")):
    """What is wrong with a local model (or tokenizer) directory's files, or None; a Hub id is
    left to from_pretrained. Checked before loading because transformers' own errors name neither
    the directory nor the file (a safetensors header, JSON at a char offset), or come at step 0
    (a tokenizer built from no files encodes every text to nothing)."""
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return "it is a file, not a directory; pass the directory that holds config.json"
    names = set(os.listdir(path))
    adapter = "adapter_config.json" in names  # peft's: the base comes from its config
    if "config" in needs and "config.json" not in names and not adapter:
        return ("config.json is missing, so this is no Hugging Face model directory "
                f"({'it is empty' if not names else 'it holds ' + ', '.join(sorted(names)[:4])}); "
                "pass the directory save_pretrained wrote")
    for name in sorted(names & set(JSON_FILES)):
        problem = json_problem(os.path.join(path, name))
        if problem:
            return f"{name} {problem}; copy it again"
    if "weights" in needs and not adapter:
        problem = weights_problem(path, names)
        if problem:
            return problem
    if "tokenizer" in needs and not names & set(TOKENIZER_FILES):
        return ("it holds no tokenizer files (tokenizer.json, or tokenizer_config.json and its "
                "vocabulary); save the tokenizer there too: tokenizer.save_pretrained(DIR)")
    return None


def json_problem(file):
    """Why a JSON file does not parse as an object, or None."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"is not valid JSON ({str(e).splitlines()[0][:120]})"
    return None if isinstance(value, dict) else f"is a JSON {type(value).__name__}, not an object"


def weights_problem(path, names):
    """The weight files from_pretrained will read: present, each shard an index names there, and
    each file whole (a safetensors file as long as its header says)."""
    found = [name for name in WEIGHT_FILES if name in names]
    if not found:
        return (f"it holds no weights ({' or '.join(WEIGHT_FILES[::2])}); pass the directory "
                "save_pretrained wrote, or copy the weights into it")
    files = [found[0]]
    if found[0].endswith(".index.json"):
        with open(os.path.join(path, found[0])) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            return f"{found[0]} has no weight_map (which shard holds which weight); copy it again"
        files = sorted({str(file) for file in weight_map.values()})
        missing = [file for file in files if not os.path.isfile(os.path.join(path, file))]
        if missing:
            return (f"{found[0]} names {missing[0]}, which is missing ({len(missing)} of "
                    f"{len(files)} shards); copy the whole directory again")
    for file in files:
        problem = weight_file_problem(os.path.join(path, file))
        if problem:
            return f"{file} {problem}; copy it again"
    return None


def weight_file_problem(file):
    """A truncated or damaged weight file, read from its header only (8 bytes of length, a JSON
    header, then the tensors' bytes up to the last data offset); a .bin zip without its end."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if not file.endswith(".safetensors"):
            if head[:2] == b"PK" and not zipfile.is_zipfile(file):
                return f"is truncated ({size:,} bytes, a zip archive without its end)"
            return None
        length = int.from_bytes(head, "little")
        if len(head) < 8 or length > size - 8:
            return f"is truncated ({size:,} bytes, shorter than its own header)"
        try:
            header = json.loads(f.read(length))
            end = max([spec["data_offsets"][1] for key, spec in header.items()
                       if key != "__metadata__"], default=0)
        except (ValueError, TypeError, KeyError, IndexError):
            return "has a damaged header (not the JSON a safetensors file starts with)"
    if size != 8 + length + end:
        damage = "truncated" if size < 8 + length + end else "damaged"
        return f"has {size:,} bytes where its header describes {8 + length + end:,}: {damage}"
    return None


def load_weights(auto_class, name, **kwargs):
    """auto_class.from_pretrained(name, **kwargs) -> (model, problem or None). Weights of another
    shape than the config's, or missing from the checkpoint, would be initialised at random (or
    stop in a multi-line table): they are one line here, naming a parameter and both shapes; the
    table is left out."""
    strict = not kwargs.pop("ignore_mismatched_sizes", False)  # the user's choice, if set
    report = logging.getLogger("transformers.modeling_utils")
    leave_out_table = lambda record: "LOAD REPORT" not in record.getMessage()  # noqa: E731
    report.addFilter(leave_out_table)
    try:
        model, info = auto_class.from_pretrained(name, output_loading_info=True,
                                                 ignore_mismatched_sizes=True, **kwargs)
    finally:
        report.removeFilter(leave_out_table)
    mismatched, missing = sorted(info["mismatched_keys"]), sorted(info["missing_keys"])
    if strict and mismatched:
        key, saved, wanted = mismatched[0]
        return model, (f"the weights do not fit config.json: the checkpoint's {key} is "
                       f"{list(saved)}, the config's {list(wanted)} ({len(mismatched)} such); "
                       "pass the config the weights were saved with")
    if missing:
        return model, (f"{len(missing)} parameter(s) of {type(model).__name__} are not in the "
                       f"checkpoint (e.g. {missing[0]}) and would start at random; copy the "
                       "weights again, or pass the directory they belong to")
    # NaN or inf weights would only show as every gradient NaN, blamed on rewards or the rate
    broken = next((key for key, p in model.named_parameters()
                   if p.is_floating_point() and not torch.isfinite(p).all()), None)
    if broken is not None:
        return model, (f"its weights hold NaN or inf values (e.g. in {broken}): they were saved "
                       "from a run that diverged, or the files are damaged; load sound weights")
    notes = {"are not used by": info["unexpected_keys"],
             "are initialised at random (--model_init_kwargs ignore_mismatched_sizes) in":
             [key for key, _, _ in mismatched]}
    for what, keys in notes.items():
        if keys and distributed.is_main():  # the table's content, in a line
            print(f"rloo: note: {name}: {len(keys)} weights of the checkpoint {what} "
                  f"{type(model).__name__} (e.g. {min(keys)})", file=sys.stderr)
    return model, None


def embedding_rows(model):
    """Rows of the input embedding: every token id the run feeds the model must be below it."""
    try:
        return model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        return model.config.get_text_config().vocab_size


def token_id_problem(path, model, tokenizer, generates=True):
    """The token ids a run depends on, against the model's embedding: the tokenizer's special
    tokens and vocabulary, the generation config's EOS and pad; a pad (or an EOS to pad with); for
    a model that generates, at least one EOS. A bad id otherwise surfaces as an index error deep
    in generation, a tokenizer without a vocabulary as an empty batch at step 0."""
    rows, eos = embedding_rows(model), eos_token_ids(tokenizer, model)
    config_eos = model.config.get_text_config().eos_token_id  # a reward model's only EOS
    hint = eos + (config_eos if isinstance(config_eos, list) else [config_eos])
    problem = special_token_problem(path, tokenizer, rows, hint)
    if problem:
        return problem
    if not tokenizer("0 a", add_special_tokens=False)["input_ids"]:
        return ("its tokenizer turns text into no tokens: the vocabulary file (tokenizer.json, or "
                "vocab.json with merges.txt) is missing; copy the tokenizer files again")
    generation = "generation_config.json"
    if not os.path.isfile(os.path.join(path, generation)):
        generation = "config.json"  # transformers derives the generation config from it
    if tokenizer.eos_token_id is None and tokenizer.pad_token_id is None:
        return ("tokenizer_config.json sets neither eos_token nor pad_token, and batches are "
                f"padded with one; add {suggested(tokenizer, hint, 'eos_token', rows)} to it")
    if generates and not eos:
        return (f"neither tokenizer_config.json (eos_token) nor {generation} (eos_token_id) "
                "names an EOS token, so no completion could end; set one")
    generation_config = getattr(model, "generation_config", None) if generates else None
    ids = {f"{generation} eos_token_id": eos,
           f"{generation} pad_token_id": [getattr(generation_config, "pad_token_id", None)]}
    for where, values in ids.items():
        outside = [i for i in values if isinstance(i, int) and not 0 <= i < rows]
        if outside:
            return (f"{where} {outside[0]} is outside the model's vocabulary of {rows} "
                    "(config.json vocab_size); set it to the id of the model's own token")
    return None


def special_token_problem(path, tokenizer, rows, eos):
    """EOS, pad or BOS past the embedding, or tokens of the vocabulary past it. When
    tokenizer_config.json names none, transformers adds '<|endoftext|>' as a new token, which the
    model has no row for; as the unknown token it is harmless (the tokenizer's own model maps
    unknown text), as EOS or pad it is an index error at the first padded batch."""
    saved = {}
    if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    for kind in ("eos_token", "pad_token", "bos_token"):
        token_id = getattr(tokenizer, f"{kind}_id")
        if token_id is None or 0 <= token_id < rows:
            continue
        made_up = "" if saved.get(kind) else " (tokenizer_config.json sets none, so transformers " \
            "added one)"
        fix = suggested(tokenizer, eos, kind, rows) if kind != "bos_token" else '"bos_token": null'
        return (f"the tokenizer's {kind} {getattr(tokenizer, kind)!r} is id {token_id}, outside "
                f"the model's vocabulary of {rows}{made_up}; set {fix} in tokenizer_config.json")
    made_up_unknown = None if saved.get("unk_token") else tokenizer.unk_token
    beyond = [token for token in tokenizer.convert_ids_to_tokens(list(range(rows, len(tokenizer))))
              if token != made_up_unknown]
    if beyond:
        return (f"the tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} "
                f"rows (config.json vocab_size): {beyond[0]!r} and {len(beyond) - 1} more would "
                "index past it; use the model's own tokenizer, or resize its embeddings to the "
                "tokenizer's and save")
    return None


def suggested(tokenizer, eos, kind, rows):
    """'"KIND": TOKEN' with the model's own EOS (the first EOS id the model and the tokenizer
    both have: its generation config's or config's), for tokenizer_config.json."""
    own = [i for i in eos if isinstance(i, int) and 0 <= i < min(rows, len(tokenizer))]
    token = json.dumps(tokenizer.convert_ids_to_tokens(own[0])) if own else "TOKEN"
    return f'"{kind}": {token}'
