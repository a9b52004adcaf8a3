"""What a flag accepts: a Domain is a test and the words that name it (in --help and in the error
line). plumbing/config.py declares one beside each field; check_flags tests every value against it.
Also what --generation_kwargs accepts (generation_options), and the one line a bad value stops with
(fail).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm


class Failed(SystemExit):
    """A run stopped with one line: bad input, found where it enters, or a condition that makes the
    run meaningless. A SystemExit, as argparse's errors are: the command line prints the line and
    exits with status 1, no `except Exception` on the way wraps it, and a caller of train.main
    catches it by name (str(e) is the line)."""


def fail(message):
    """Stop with one clear line (no traceback). A progress bar on screen is wiped first, or the
    line would be printed onto the bar's."""
    for bar in list(tqdm._instances):
        bar.clear()
    raise Failed(f"error: {message}")


@dataclass(frozen=True)
class Domain:
    """The values a flag accepts: a test and the words that name them (--help, the error)."""
    text: str
    test: Callable[[object], bool]

    def allows(self, value):
        values = value if isinstance(value, list) else [value]
        return all(self.test(v) for v in values)


def number(text, test):
    """A numeric domain: finite numbers (NaN and inf fail) that pass test."""
    def finite_and(v):
        real = isinstance(v, (int, float)) and not isinstance(v, bool)
        return real and math.isfinite(v) and test(v)
    return Domain(text, finite_and)


def at_least(low):
    return number(f">= {low}", lambda v: v >= low)


def greater_than(low):
    return number(f"> {low}", lambda v: v > low)


def between(low, high, low_open=False, high_open=False):
    text = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return number(text, lambda v: (v > low if low_open else v >= low)
                  and (v < high if high_open else v <= high))


def one_of(*values):
    return Domain("one of " + ", ".join(values), lambda v: v in values)


def json_object(schema=None):
    """A JSON object (a dict once parsed); with a schema {key: (type, Domain or None)} only those
    keys, of those types."""
    def test(value):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return False
        if not isinstance(value, dict):
            return False
        return schema is None or all(k in schema and valid(v, *schema[k]) for k, v in value.items())
    keys = "" if schema is None else " with keys " + ", ".join(
        f"{k} ({getattr(kind, '__name__', kind)})" for k, (kind, _) in schema.items())
    return Domain("a JSON object" + keys, test)


# JSON values that are not one Python type
IDS, ID_LISTS = "a list of token ids", "a list of non-empty token-id lists"
WORDS, BIAS = "a list of non-empty strings", "an object {token id: finite number}"


def valid(value, kind, domain):
    """A JSON value of the given kind (a type, or one of the kinds above) within domain."""
    ints = lambda v: isinstance(v, list) and all(type(i) is int for i in v)  # noqa: E731
    if kind in (IDS, ID_LISTS):
        return ints(value) if kind == IDS else isinstance(value, list) and all(
            ints(v) and v for v in value)
    if kind == WORDS:
        return isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    if kind == BIAS:
        return isinstance(value, dict) and all(
            k.isdigit() and FINITE.allows(v) for k, v in value.items())
    if kind is bool:
        return isinstance(value, bool)
    typed = isinstance(value, kind) and not isinstance(value, bool)
    typed = typed or kind is float and type(value) is int
    return typed and (domain is None or domain.allows(value))


FINITE = number("finite", lambda v: True)
JSON_OBJECT = json_object()


# --generation_kwargs both generators implement, with vLLM SamplingParams' names and meanings,
# applied in vLLM's order: allowed_token_ids (all others banned), bad_words (token sequences the
# completion may not end with), logit_bias (added to the logits), EOS (and stop ids) suppressed
# until min_tokens completion tokens, OpenAI's penalties over the completion so far. The log-probs
# the trainer scores stay those of softmax(z / T): these shape what is sampled, as top-k does.
GENERATION_KWARGS = {"min_tokens": (int, at_least(0)), "presence_penalty": (float, FINITE),
                     "frequency_penalty": (float, FINITE), "stop_token_ids": (IDS, None),
                     "allowed_token_ids": (IDS, None), "bad_words": (WORDS, None),
                     "bad_words_ids": (ID_LISTS, None), "logit_bias": (BIAS, None),
                     "do_sample": (bool, None)}
# keys that are flags (generation_kwargs wins, as in TRL) or their Hugging Face / vLLM aliases
GENERATION_FLAGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "max_new_tokens": "max_completion_length",
                    "max_tokens": "max_completion_length"}
GENERATION_ALIASES = {"min_new_tokens": "min_tokens"}
# keys refused, and why
NOT_A_SAMPLE = ("is not a sample of the policy (the completions would not be drawn from pi, so "
                "the policy gradient would be wrong)")
GENERATION_REFUSED = {
    **{k: "beam search " + NOT_A_SAMPLE for k in (
        "num_beams", "num_beam_groups", "length_penalty", "early_stopping", "diversity_penalty",
        "use_beam_search", "best_of")},
    "num_return_sequences": "set --num_generations (completions per prompt)",
    "n": "set --num_generations (completions per prompt)",
    "seed": "set --seed (each request is seeded from it)",
    "structured_outputs": "set --vllm_structured_outputs_regex",
    "logprobs": "rloo asks for the log-probs it needs",
    "stop": "give token ids in stop_token_ids (a completion ends at a token, which both "
            "generators check)"}
# transformers' schedulers that step on the step count (reduce_lr_on_plateau and greedy step on
# an eval loss, which an RL run does not have)
SCHEDULERS = one_of("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                    "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr",
                    "cosine_warmup_with_min_lr", "warmup_stable_decay")
EVAL_SOURCE = Domain("NAME=SOURCE or NAME=SOURCE@SPLIT",
                     lambda v: v.partition("=")[0].isidentifier() and bool(v.partition("=")[2]))
STEPS = Domain("-1 (run num_train_epochs) or >= 1",
               lambda v: type(v) is int and (v == -1 or v >= 1))


def generation_options(cfg, options):
    """--generation_kwargs -> the options both generators implement (GENERATION_KWARGS); keys that
    are flags set them, aliases are renamed, any other key stops the run with why."""
    kept = {}
    for key, value in options.items():
        key = GENERATION_ALIASES.get(key, key)
        if key in GENERATION_FLAGS:
            setattr(cfg, GENERATION_FLAGS[key], value)
        elif key in GENERATION_REFUSED:
            fail(f"--generation_kwargs {key}: {GENERATION_REFUSED[key]}")
        elif key == "do_sample" and value is False:
            fail("--generation_kwargs do_sample=false: greedy decoding " + NOT_A_SAMPLE)
        elif key not in GENERATION_KWARGS:
            fail(f"--generation_kwargs {key}: not an option both generators implement; they are "
                 f"{', '.join(GENERATION_KWARGS)} and the flags {', '.join(GENERATION_FLAGS)}")
        elif not valid(value, *GENERATION_KWARGS[key]):
            kind = GENERATION_KWARGS[key][0]
            fail(f"--generation_kwargs {key}={json.dumps(value)}: must be "
                 f"{getattr(kind, '__name__', kind)}")
        elif key != "do_sample":
            kept[key] = {int(k): v for k, v in value.items()} if key == "logit_bias" else value
    return kept
