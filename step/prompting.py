"""Prompts as the model sees them: chat template, token ids, images; the one padding helper; the ids
that end a completion. Shared by every generator (rollout.py, options/vllm_rollout.py,
options/environments.py) and by the metrics."""
import array
import io
import json
import re
import sys
import weakref

import torch
import torch.nn.functional as F

from plumbing import distributed
from plumbing.config import fail


def is_conversational(prompt):
    """A conversational prompt is a list of {"role", "content"} messages; a standard one a
    string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def is_token_ids(prompt):
    """A prompt given as token ids (options/environments.py continues a trajectory this way)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(x, int) for x in prompt)


def repeat_each(values, G):
    """Each value G times, adjacent: a prompt's columns for its G completions."""
    return [v for v in values for _ in range(G)]


def pad(pieces, value, left=False):
    """Rows of different lengths (id lists, or [b, t] tensors) -> one [rows, longest] tensor padded
    with value, on the left (prompts, so that each ends where generation starts) or the right.
    Lists become one tensor at once (int64; float32 or bool where they hold those), not one a
    row."""
    if not any(isinstance(p, torch.Tensor) for p in pieces):
        width = max(map(len, pieces))
        fill = [[value] * (width - len(p)) for p in pieces]
        rows = [f + list(p) if left else list(p) + f for f, p in zip(fill, pieces)]
        kinds = {type(x) for p in pieces for x in p[:1]}
        dtype = torch.float32 if float in kinds else torch.bool if kinds == {bool} else torch.long
        return torch.tensor(rows, dtype=dtype)
    width = max(p.shape[1] for p in pieces)
    return torch.cat([F.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]),
                            value=value) for p in pieces])


def prompt_texts(tokenizer, prompts, chat_template_kwargs=None, images=None):
    """Conversational prompts get the chat template with add_generation_prompt=True; strings pass
    through. With images (a list per row; tokenizer is then the processor) they enter the first
    user message as image parts."""
    if images is not None:
        prompts = [with_images(p, row) for p, row in zip(prompts, images)]
    options = chat_template_kwargs or {}
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **options)
            if is_conversational(p) else p for p in prompts]


# The roles a conversation may hold. A chat template declares none: SmolLM2's writes any role
# verbatim, Qwen2.5's drops one it does not know, both silently. These are the ones every chat
# template renders, and the run's own tool results; a template may name more (Llama's 'ipython').
ROLES = ("system", "user", "assistant", "tool")


def allowed_roles(tokenizer):
    """ROLES, plus any other role the chat template names as a quoted string ('developer')."""
    template = getattr(tokenizer, "chat_template", None)
    template = " ".join(template.values()) if isinstance(template, dict) else template or ""
    named = re.findall(r"""role\W{1,8}['"](\w+)['"]""", template)
    return ROLES + tuple(sorted(set(named) - set(ROLES)))


def dropped_content(tokenizer, messages, chat_template_kwargs=None):
    """The first message whose content the chat template leaves out of its rendering ((index,
    text)), or None. Text is compared stripped (templates trim); images are not text."""
    rendered = prompt_texts(tokenizer, [messages], chat_template_kwargs)[0]
    for j, message in enumerate(messages):
        content = message["content"]
        parts = [content] if isinstance(content, str) else \
            [p.get("text", "") for p in content if isinstance(p, dict)]
        missing = next((p.strip() for p in parts if p.strip() not in rendered), None)
        if missing is not None:
            return j, missing
    return None


def tokenize_prompts(tokenizer, prompts, chat_template_kwargs=None):
    """Prompt token ids as TRL makes them: a conversation gets the chat template, which writes its
    own special tokens; a standard string gets the tokenizer's (BOS for Llama, Gemma or Mistral,
    nothing for Qwen or SmolLM2). Each prompt is tokenized once a run (start-up's length check
    does them all; the same prompts come back every epoch): TOKENIZED keeps their ids."""
    if prompts and all(is_token_ids(p) for p in prompts):  # a multi-turn trajectory so far
        return [list(p) for p in prompts]
    # what else decides the ids: a caller may change the template or the BOS between calls
    state = (tokenizer.chat_template, tokenizer.bos_token,
             getattr(tokenizer, "add_bos_token", None))
    options = json.dumps([chat_template_kwargs or {}, state], sort_keys=True, default=str)
    cache = TOKENIZED.setdefault(tokenizer, {"ids": {}, "tokens": 0})
    keys = [(p if isinstance(p, str) else json.dumps(p, sort_keys=True, default=str), options)
            for p in prompts]
    new = {key: p for key, p in zip(keys, prompts) if key not in cache["ids"]}
    if new:
        if cache["tokens"] > TOKENIZED_LIMIT:  # a stream of new prompts: start over
            cache["ids"], cache["tokens"] = {}, 0
        ids = encode_prompts(tokenizer, list(new.values()), chat_template_kwargs)
        cache["ids"].update((key, array.array("l", i)) for key, i in zip(new, ids))
        cache["tokens"] += sum(map(len, ids))
    return [cache["ids"][key].tolist() for key in keys]


# tokenizer -> {"ids": {(prompt, template options): ids}, "tokens": how many they hold}
TOKENIZED = weakref.WeakKeyDictionary()
TOKENIZED_LIMIT = 2**22  # token ids kept a tokenizer (32 MB)


def encode_prompts(tokenizer, prompts, chat_template_kwargs=None):
    """tokenize_prompts without its cache."""
    texts = prompt_texts(tokenizer, prompts, chat_template_kwargs)
    standard = [not is_conversational(p) for p in prompts]
    ids = {}
    for flag in set(standard):
        chosen = [t for t, s in zip(texts, standard) if s == flag]
        ids[flag] = iter(tokenizer(chosen, add_special_tokens=flag).input_ids)
    return [next(ids[s]) for s in standard]


def unknown_token(tokenizer):
    """The id a tokenizer gives what it cannot represent (its unk token: the embedded task's
    turns every character but the digits and '=' into end-of-text), or None (a byte-level one
    represents anything)."""
    backend = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    name = tokenizer.unk_token or getattr(backend, "unk_token", None)
    return None if name is None else tokenizer.convert_tokens_to_ids(name)


def unrepresented(tokenizer, text):
    """The characters of `text` the tokenizer reads as its unknown token, in order (none where it
    has no such token)."""
    unknown = unknown_token(tokenizer)
    if unknown is None or not hasattr(tokenizer, "backend_tokenizer"):
        return ""
    encoded = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    return "".join(text[start:end] for i, (start, end) in zip(encoded.ids, encoded.offsets)
                   if i == unknown)


def message_text(prompt):
    """What the user wrote of a prompt: the text, or its messages' string contents."""
    if isinstance(prompt, str) or not is_conversational(prompt):  # token ids: none
        return prompt if isinstance(prompt, str) else ""
    return "\n".join(m["content"] for m in prompt if isinstance(m.get("content"), str))


def check_representable(prompts, tokenizer, cfg, where):
    """Prompts in characters the tokenizer reads as its unknown token: mostly so is a model that
    would train on prompts it cannot read (the embedded model given English questions), one line;
    a few, one warning."""
    for i, prompt in enumerate(prompts):
        text = message_text(prompt) if not is_token_ids(prompt) else ""
        lost = unrepresented(tokenizer, text)
        if not lost:
            continue
        token = tokenizer.convert_ids_to_tokens(unknown_token(tokenizer))
        said = (f"{where} row {i}: the tokenizer reads {len(lost)} of its prompt's {len(text)} "
                f"characters ({''.join(dict.fromkeys(lost))[:24]!r}) as its unknown token "
                f"{token!r}")
        fix = ("without --model the embedded model knows only the digits and '=': pass --model "
               "for this dataset" if cfg.model is None else "use a tokenizer that covers them")
        if 2 * len(lost) >= len(text):
            fail(f"{said}: the model would learn from prompts it cannot read; {fix}")
        if distributed.is_main():
            print(f"rloo: WARNING: {said}; {fix}", file=sys.stderr)
        return


def completion_texts(tokenizer, lists):
    """batch_decode(lists, skip_special_tokens=True), each distinct completion decoded once: a
    group's completions repeat once the policy agrees (8x fewer decodes on the embedded task)."""
    distinct = list(dict.fromkeys(map(tuple, lists)))
    texts = dict(zip(distinct, tokenizer.batch_decode([list(ids) for ids in distinct],
                                                      skip_special_tokens=True)))
    return [texts[tuple(ids)] for ids in lists]


def prompt_tensors(id_lists, pad_id, G, device):
    """Each prompt's ids G times, left-padded -> prompt_ids, prompt_mask [P * G, longest]."""
    ids = pad(id_lists, pad_id, left=True).repeat_interleave(G, 0)
    mask = pad([[1] * len(p) for p in id_lists], 0, left=True).repeat_interleave(G, 0)
    return ids.to(device), mask.to(device)


def with_images(messages, images, part=lambda image: {"type": "image"}):
    """The conversation with one image part per image at the front of its first user message."""
    out, placed = [], False
    for message in messages:
        if not placed and message["role"] == "user":
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            message = {**message, "content": [part(image) for image in images] + list(parts)}
            placed = True
        out.append(message)
    return out


def row_images(rows):
    """Each row's images as RGB PIL images (column `image`: one per row, `images`: a list), None
    without such a column. Takes PIL images, file paths and an undecoded `datasets` Image's dicts.
    An image that does not load stops the run with one line naming it."""
    if "image" in rows:
        per_row = [[] if x is None else [x] for x in rows["image"]]
    elif "images" in rows:
        per_row = [x or [] for x in rows["images"]]
    else:
        return None
    return [[load_image(x) for x in row] for row in per_row]


def load_image(x):
    from PIL import Image

    try:
        if isinstance(x, dict):
            x = io.BytesIO(x["bytes"]) if x.get("bytes") else x["path"]
        return (x if isinstance(x, Image.Image) else Image.open(x)).convert("RGB")
    except (OSError, KeyError, TypeError, AttributeError) as e:  # PIL's errors are OSErrors
        fail(f"cannot read image {str(x)[:200]!r}: {e}. Image columns take PIL images, image file "
             "paths, or {'bytes': ..., 'path': ...} dicts")


def processor_inputs(processor, texts, images, device):
    """The processor's tensors for prompt texts and their images, left-padded: input_ids,
    attention_mask and the model's pixel inputs (pixel_values, image_grid_thw, ...). Their layout
    differs per family (patches concatenated, images stacked, padded per row), so any subset of rows
    is processed again, never sliced."""
    enc = processor(text=texts, images=images if any(images) else None, padding=True,
                    padding_side="left", return_tensors="pt")
    return {k: v.to(device) for k, v in enc.items()}


def pixel_inputs_for(processor, prompts, images, G, device, chat_template_kwargs=None):
    """rows -> the processor's tensors for that slice of the B = P*G rows (each prompt and its
    images G times)."""
    texts = repeat_each(prompt_texts(processor, prompts, chat_template_kwargs, images), G)
    images = repeat_each(images, G)
    return lambda rows: processor_inputs(processor, texts[rows], images[rows], device)


def image_token_ids(processor):
    """Placeholder ids the policy must never sample: the forward pairs each with an image
    feature."""
    names = ("image_token_id", "video_token_id")
    return sorted(v for k, v in vars(processor).items() if k.endswith(names) and isinstance(v, int))


def eos_token_ids(tokenizer, model, cfg=None):
    """Every id that ends a completion: the tokenizer's EOS, the model's generation_config EOS (may
    be a list) and generation_kwargs' stop_token_ids."""
    stop_ids = ((cfg and cfg.generation_kwargs) or {}).get("stop_token_ids", [])
    ids = {tokenizer.eos_token_id, *stop_ids}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)
