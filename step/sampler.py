"""The distribution the decode loop samples from: --generation_kwargs' processors in vLLM's order,
then HF's penalty, the temperature and the logit filters (rloo.sampling_mask, vLLM's), and the
draw: an inverse CDF at a counter-based uniform that makes every sample a pure function of (seed,
row, step), so chunked and resumed generation give the same tokens."""
import dataclasses

import torch
from transformers.generation.logits_process import (
                                                    MinNewTokensLengthLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper,
                                                    )

from plumbing.config import fail
from rloo import sampling_mask
from step.sampler_rules import active_filters


def sampling_processors(cfg, prompt_ids, eos_ids):
    """--generation_kwargs' options in vLLM's order (allowed tokens, bad words, logit bias, min
    tokens, penalties), then HF's own penalty, the temperature and the filters, as vLLM does;
    applied to the logits after log pi_T is recorded. A model's shipped generation_config (e.g.
    top_k=20) adds none of its own, so it cannot silently change the sampling. Bad words are token
    ids here (with_bad_word_ids)."""
    extra, processors, prompt_length = cfg.generation_kwargs or {}, [], prompt_ids.shape[1]
    if extra.get("allowed_token_ids"):
        processors.append(allowed_only(extra["allowed_token_ids"]))
    if extra.get("bad_words_ids"):
        processors.append(ban_sequences(prompt_length, extra["bad_words_ids"]))
    if extra.get("logit_bias"):
        processors.append(logit_bias(extra["logit_bias"]))
    if extra.get("min_tokens"):
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, extra["min_tokens"],
                                                            eos_ids, prompt_ids.device))
    if extra.get("presence_penalty") or extra.get("frequency_penalty"):
        processors.append(completion_penalties(prompt_length, extra.get("presence_penalty", 0.0),
                                               extra.get("frequency_penalty", 0.0)))
    if cfg.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.temperature not in (0.0, 1.0):  # 0: evaluation's greedy decoding (draw)
        processors.append(TemperatureLogitsWarper(cfg.temperature))
    if active_filters(cfg):  # vLLM's, which the training forward replays exactly
        processors.append(logit_filters(active_filters(cfg)))
    return processors


def logit_filters(filters):
    """Top-k, top-p, min-p ({flag: value}): every token outside rloo.sampling_mask gets
    probability 0."""
    def truncate(ids, scores):
        return scores.masked_fill(~sampling_mask(scores, **filters), float("-inf"))
    return truncate


def allowed_only(allowed):
    """vLLM's allowed_token_ids: every other token gets probability 0."""
    def mask(ids, scores):
        banned = torch.ones(scores.shape[-1], dtype=torch.bool, device=scores.device)
        banned[allowed] = False
        return scores.masked_fill(banned, float("-inf"))
    return mask


def ban_sequences(prompt_length, sequences):
    """vLLM's bad words, as token ids: a token that would complete one of the sequences at the end
    of the completion so far (the prompt is not looked at) gets probability 0."""
    def ban(ids, scores):
        completion, hits = ids[:, prompt_length:], []
        for *prefix, last in sequences:
            if len(prefix) > completion.shape[1]:
                continue
            tail = completion[:, completion.shape[1] - len(prefix):]
            hit = (tail == torch.tensor(prefix, device=ids.device)).all(-1)  # [B]
            hits.append((hit, last))
        for hit, last in hits:
            scores = scores.index_put((hit.nonzero()[:, 0], torch.tensor(last, device=ids.device)),
                                      torch.tensor(float("-inf"), device=ids.device))
        return scores
    return ban


def logit_bias(bias):
    """vLLM's (and OpenAI's) logit_bias: z_v += bias[v]."""
    def add(ids, scores):
        index = torch.tensor(list(bias), device=scores.device)
        values = torch.tensor(list(bias.values()), dtype=scores.dtype, device=scores.device)
        return scores.index_add(-1, index, values.expand(len(scores), -1))
    return add


def bad_word_ids(tokenizer, words):
    """vLLM's tokenization of bad_words (SamplingParams.update_from_tokenizer): each word without
    and, where that gives another first token of the same length, with a leading space."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            fail(f"--generation_kwargs bad_words: {word!r} is no token of this tokenizer")
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def with_bad_word_ids(cfg, tokenizer):
    """cfg with generation_kwargs' bad_words turned into token ids, beside bad_words_ids."""
    extra = cfg.generation_kwargs or {}
    if not extra.get("bad_words"):
        return cfg
    ids = extra.get("bad_words_ids", []) + bad_word_ids(tokenizer, extra["bad_words"])
    options = {**{k: v for k, v in extra.items() if k != "bad_words"}, "bad_words_ids": ids}
    return dataclasses.replace(cfg, generation_kwargs=options)


def check_token_ids(cfg, model, tokenizer):
    """Token ids in --generation_kwargs exist in the model's vocabulary, and a bad word is at
    least one token (at start-up)."""
    vocab, extra = model.config.get_text_config().vocab_size, cfg.generation_kwargs or {}
    bad_word_ids(tokenizer, extra.get("bad_words", []))
    named = {"stop_token_ids": extra.get("stop_token_ids", []),
             "allowed_token_ids": extra.get("allowed_token_ids", []),
             "logit_bias": list(extra.get("logit_bias", {})),
             "bad_words_ids": [i for ids in extra.get("bad_words_ids", []) for i in ids]}
    for key, ids in named.items():
        outside = [i for i in ids if not 0 <= i < vocab]
        if outside:
            fail(f"--generation_kwargs {key}: token ids {outside[:5]} are not in the model's "
                 f"vocabulary of {vocab}")


def completion_penalties(prompt_length, presence, frequency):
    """OpenAI's (and vLLM's) penalties: z_v -= frequency * c_v + presence * [c_v > 0], c_v the
    count of v in the completion so far (the prompt is not counted)."""
    def penalize(ids, scores):
        completion = ids[:, prompt_length:]
        ones = torch.ones_like(completion, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, completion, ones)
        return scores - frequency * counts - presence * (counts > 0).float()
    return penalize


# splitmix64 (Steele et al. 2014) in int64 arithmetic, which wraps as uint64 does; the shifts are
# masked to act as logical ones. Counter-based: the uniform of (row, step) needs no state.
GOLDEN, MIX1, MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def splitmix(x):
    x = (x ^ ((x >> 30) & (2**34 - 1))) * MIX1
    x = (x ^ ((x >> 27) & (2**37 - 1))) * MIX2
    return x ^ ((x >> 31) & (2**33 - 1))


def row_keys(seed, num_rows, device):
    """One int64 key per completion row, from the call's seed (None: a draw from torch's
    checkpointed RNG).  [B]"""
    if seed is None:
        seed = int(torch.randint(2**62, ()).item())
    rows = torch.arange(1, num_rows + 1, device=device)
    return splitmix(splitmix(torch.tensor(seed % 2**62, device=device)) + rows * GOLDEN)


def row_uniforms(keys, t):
    """U[0, 1) [B] at step t, a pure function of (row key, t): 53 bits, float64. One draw per row
    and step is all an inverse CDF needs, so the hashing runs over [B], not [B, V]."""
    step = ((t + 1) * GOLDEN + 2**63) % 2**64 - 2**63  # (t + 1) * GOLDEN, wrapped as int64's
    bits = splitmix(keys + step)  # [B] the splitmix64 stream of each row's key
    return ((bits >> 11) & (2**53 - 1)).double().mul_(2.0**-53)


def draw(scores, keys, t, greedy=False):
    """Each row's next token [B]: an exact sample of softmax(scores) at the row's uniform of step t,
    or, greedy (evaluation at --eval_temperature 0), its most likely token."""
    if greedy:
        return scores.argmax(-1)
    return inverse_cdf(torch.softmax(scores, -1), row_uniforms(keys, t))  # [B, V] -> [B]


def inverse_cdf(probs, uniforms):
    """token ~ probs [B, V], exactly: the first token whose cumulative probability exceeds u times
    the row's total (a zero-probability token never does). The cumsum runs in float64: in fp32,
    past a running sum of 1/2 each token's step is rounded to a multiple of 6e-8, far above a 152k
    vocabulary's tail tokens (their draw 20-100% off, total variation ~1e-3).
    Over [B, V]: a cast, a cumsum, a binary search. -> [B]"""
    cdf = probs.double().cumsum(-1)  # [B, V]
    targets = uniforms[:, None] * cdf[:, -1:]  # [B, 1] below the total (u < 1)
    # a row of NaN (every token banned) gets the last id, not one outside the vocabulary
    tokens = torch.searchsorted(cdf, targets, right=True)[:, 0]  # [B]
    return tokens.clamp_(max=probs.shape[-1] - 1)
