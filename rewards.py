"""Reward functions: loading by name, the built-in rewards, the weights, and what they log.

Interface (same as TRL's GRPOTrainer/RLOOTrainer; docs/rewards.md 'Writing a reward function'): a
reward function is called as
    f(prompts=[...], completions=[...], completion_ids=[...], **dataset_columns, step=...,
      trainer_state=..., log_extra=..., log_metric=...)
with one entry per completion (each prompt repeated G times) and returns a list of float | None of
the same length. None means "does not apply to this completion". Multi-turn runs add `environments`,
the completions' environment objects (options/environments.py). How the functions are called (each
on its own copy of the arguments, async ones concurrently, within their time) is
step/reward_calls.py. As in TRL, trainer_state is a transformers.TrainerState (global_step,
max_steps, epoch, ...), log_extra(column, values) adds a column of one value per completion to the
completions table, and log_metric(name, value) logs a scalar: the mean over the step's calls on all
ranks.
"""

import importlib
import importlib.util
import os
import re
import sys
import threading

import torch
from transformers import TrainerState

from plumbing import distributed, user_code
from plumbing.config import fail
from step.metrics import TABLE_COLUMNS, trainer_metric
from plumbing.models import load_reward_model, prepare_model
from step.reward_calls import RewardError, compute_rewards, reward_name, user_error
from step.prompting import is_conversational, repeat_each
from rloo import combine_rewards


# ---------------------------------------------------------------------------------------------
# Built-in rewards
# ---------------------------------------------------------------------------------------------

def _text(completion):
    """Completion text, for standard (str) and conversational ([{"role": "assistant", "content":
    ...}]) prompts."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def task_reward(completions, target, **kwargs):
    """Embedded task: per-position partial credit, matches / max(len(completion), len(target)), in
    [0, 1].

    1.0 only for the exact target; extra or missing characters cost as much as wrong ones.
    """
    rewards = []
    for completion, want in zip(completions, target):
        got = _text(completion)
        rewards.append(sum(a == b for a, b in zip(got, want)) / max(len(got), len(want), 1))
    return rewards


def accuracy_reward(completions, solution, **kwargs):
    """1.0 if the completion's final answer equals `solution` (math-verify), else 0.0; None if the
    gold won't parse."""
    from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify

    # math-verify's timeouts use signal.alarm, which only works on the main thread (reward fns may
    # run in threads)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer_config = [LatexExtractionConfig(
        normalization_config=LatexNormalizationConfig(nits=False, malformed_operators=False,
                                                      basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards = []
    for completion, gold in zip(completions, solution):
        gold_parsed = parse(gold, extraction_mode="first_match", parsing_timeout=timeout)
        if not gold_parsed:
            rewards.append(None)
            continue
        answer = parse(_text(completion), extraction_config=answer_config,
                       extraction_mode="first_match",
                       parsing_timeout=timeout)
        rewards.append(float(verify(gold_parsed, answer, timeout_seconds=timeout)))
    return rewards


def last_number_reward(completions, solution, **kwargs):
    """1.0 if the last number in the completion equals `solution` (a number, or text holding one),
    else 0.0; None if the solution holds no number. For arithmetic answers in plain text, which
    accuracy_reward (LaTeX) does not read."""
    number = re.compile(r"-?\d+(?:\.\d+)?")
    rewards = []
    for completion, gold in zip(completions, solution):
        want, got = number.findall(str(gold)), number.findall(_text(completion).replace(",", ""))
        rewards.append(None if not want else float(bool(got) and float(got[-1]) == float(want[-1])))
    return rewards


def think_format_reward(completions, **kwargs):
    """1.0 if the completion is `<think>...</think>` followed by an answer, with exactly one think
    block."""
    pattern = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)
    return [1.0 if pattern.match(_text(c)) else 0.0 for c in completions]


def soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """DAPO's soft overlong penalty (Yu et al. 2025, eq. 13) as a reward function of completion
    length L: 0 if L <= max - cache;  (max - cache - L) / cache if max - cache < L <= max;  -1
    beyond.
    """
    def soft_overlong_punishment_reward(completion_ids, **kwargs):
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= max_completion_len - soft_punish_cache:
                rewards.append(0.0)
            elif length <= max_completion_len:
                start = max_completion_len - soft_punish_cache
                rewards.append((start - length) / soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards
    return soft_overlong_punishment_reward


BUILTINS = {f.__name__: f for f in (task_reward, accuracy_reward, last_number_reward,
                                    think_format_reward)}
# every name --reward_funcs takes as a built-in (--help and docs/rewards.md list them; a test
# checks)
BUILTIN_NAMES = (*BUILTINS, "soft_overlong_punishment")


# ---------------------------------------------------------------------------------------------
# Loading by name (CLI) and calling
# ---------------------------------------------------------------------------------------------

def looks_like_model(spec):
    """A local directory, or a Hub id such as 'org/name' (no ':' and no '.py')."""
    hub_id = bool(re.fullmatch(r"[\w.-]+/[\w.-]+", spec)) and not spec.endswith(".py")
    return os.path.isdir(spec) or hub_id


def load_reward_func(spec, prepare_model=None, device="cpu", max_completion_length=None):
    """'accuracy_reward' (built-in) | 'pkg.module:fn' | 'path/to/file.py:fn' | 'path/to/package:fn'
    | a sequence-classification model (local directory or Hub id) -> callable. prepare_model
    places/shards a reward model like the reference model."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    # DAPO's cache: the last fifth of the budget (4096 of 20480)
    if spec == "soft_overlong_punishment":
        return soft_overlong_punishment(max_completion_length, max(1, max_completion_length // 5))
    if ":" in spec:
        source, name = spec.rsplit(":", 1)
        module = reward_module(source, spec)
        if not hasattr(module, name):
            raise ValueError(f"{source!r} has no function {name!r} (reward function {spec!r})"
                             f"{shadowed(module, source, name)}")
        if not callable(getattr(module, name)):
            raise ValueError(f"{source}:{name} is a {type(getattr(module, name)).__name__}, not a "
                             "function")
        return getattr(module, name)
    if looks_like_model(spec):
        return reward_model(spec, prepare_model or (lambda m: m.to(device)), device)
    raise ValueError(f"unknown reward function {spec!r}: use a built-in "
                     f"({', '.join(BUILTIN_NAMES)}), 'module:function', 'file.py:function', or the "
                     "path of a sequence-classification model")


def reward_module(source, spec):
    """The module of 'SOURCE:function': a .py file or a package directory, by path, else a module
    name on sys.path. A failure is a ValueError of one line."""
    if source.endswith(".py") or os.path.isdir(source):
        return user_code.load(source, "reward function")
    try:
        return importlib.import_module(source)
    except BaseException as e:  # noqa: BLE001 (a failing import inside it, sys.exit)
        local = source.replace(".", os.sep) + ".py"
        hint = f"; to load the {local} here, pass {local}:FUNCTION" if os.path.isfile(local) else ""
        raise ValueError(f"cannot import module {source!r} for reward function {spec!r}: "
                         f"{user_error(e)}{hint}") from None


def shadowed(module, source, name):
    """Why a module lacks the function: it is one of rloo's own (rewards, rollout, a folder's
    module ...), found before a file of the same name in the current directory."""
    local = source.replace(".", os.sep) + ".py"
    path = os.path.abspath(getattr(module, "__file__", None) or "")
    if not (path.startswith(PROJECT + os.sep) and os.path.isfile(local)) or \
            os.path.samefile(path, local):
        return ""
    return (f": {source!r} is rloo's own {os.path.basename(module.__file__)}, which shadows the "
            f"{local} here; pass {local}:{name} (a path) or rename the file")


PROJECT = os.path.dirname(os.path.abspath(__file__))


def reward_model(path, prepare_model, device):
    """A sequence-classification model as a reward function: prompt + completion (through the chat
    template for conversations), right-padded, no gradient, reward = logits[:, 0] at the last token.
    Named after the path."""
    try:  # its files, weights and pad id checked at start-up, not at the first batch it scores
        model, tokenizer = load_reward_model(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot load reward model {path!r}: {str(e).splitlines()[0]}") from None
    model = prepare_model(model)

    @torch.no_grad()
    def score(prompts, completions, **kwargs):
        texts = [tokenizer.apply_chat_template(p + c, tokenize=False) if isinstance(p, list)
                 else p + c
                 for p, c in zip(prompts, completions)]
        enc = tokenizer(texts, padding=True, return_tensors="pt",
                        add_special_tokens=False).to(device)
        return model(**enc).logits[:, 0].float().tolist()

    score.__name__ = os.path.basename(os.path.normpath(path))
    return score


def unique_names(funcs, specs=None):
    """The functions' metric names (reward_name), each made distinct from those before it and from
    the table's columns by a suffix, with a warning: a second `score` logs as rewards/score_1/mean
    rather than overwrite the first's rewards/score/mean. specs: --reward_funcs, to name them."""
    def label(i):
        return f"reward function {i + 1} ({specs[i] if specs else reward_name(funcs[i])})"

    names = []
    for k, func in enumerate(funcs):
        name = unique = reward_name(func)
        suffix = 0
        while unique in names or unique in TABLE_COLUMNS:
            suffix += 1
            unique = f"{name}_{suffix}"
        if unique != name and distributed.is_main():
            same = (f"as is {label(names.index(name))}" if name in names
                    else "a column of the completions table")
            print(f"rloo: WARNING: {label(k)} is named {name!r}, {same}: it logs as "
                  f"rewards/{unique}/mean and rewards/{unique}/std", file=sys.stderr)
        names.append(unique)
    return names


class RewardFunctions:
    """The run's reward functions, loaded once (--reward_funcs): each callable, its metric name, its
    weight w_k of R = sum_k w_k R_k (--reward_weights, or 1.0 each) and the time it may take.
    max_steps and the last training batch's epoch (passes over the prompts before it was read;
    None for a stream) fill trainer_state."""

    def __init__(self, funcs, weights=None, timeout=None, cfg=None):
        self.funcs, self.timeout, self.cfg = funcs, timeout, cfg
        specs = cfg and cfg.reward_funcs
        self.names = unique_names(funcs, specs if specs and len(specs) == len(funcs) else None)
        self.weights = torch.tensor(weights or [1.0] * len(funcs))  # [K]
        self.max_steps, self.epoch = 0, None

    def trainer_state(self, step):
        """TRL's trainer_state argument: the fields of transformers.TrainerState a run has."""
        cfg = self.cfg
        return TrainerState(
            global_step=step, max_steps=self.max_steps, epoch=self.epoch,
            num_train_epochs=cfg and cfg.num_train_epochs, logging_steps=cfg and cfg.logging_steps,
            eval_steps=cfg and cfg.eval_steps, save_steps=cfg and cfg.save_steps,
            train_batch_size=cfg and cfg.per_device_train_batch_size,
            is_local_process_zero=distributed.local_rank() == 0,
            is_world_process_zero=distributed.is_main())

    def combine(self, rewards_per_func, clipped=True):
        """R_i = sum_k w_k R_ik over the functions that scored completion i (rloo.combine_rewards),
        clipped to --reward_clip_range; clipped=False: raw (what dynamic sampling filters on and
        the reward metric reports). Every caller combines here. [B, K] -> [B]"""
        clip = self.cfg.reward_clip_range if clipped and self.cfg else None
        return combine_rewards(rewards_per_func, self.weights.to(rewards_per_func.device), clip)

    def __call__(self, rollout, G, step):
        """The functions on a Rollout's B = P*G completions: each prompt and dataset column repeated
        G times; conversational prompts get [{"role": "assistant", "content": text}] completions.
        What they log goes to the Rollout's logged_columns and logged_metrics. -> [B, K], NaN
        where a function returned None. A failure stops the run with one line."""
        prompts = repeat_each(rollout.rows["prompt"], G)
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                       for p, t in zip(prompts, rollout.texts)]
        if rollout.turns is not None:  # multi-turn: the conversation after the prompt
            completions = rollout.turns
        columns = {c: repeat_each(v, G) for c, v in rollout.rows.items() if c != "prompt"}
        if rollout.environments is not None:  # shared, not copied: get_reward reads their state
            columns["environments"] = rollout.environments
        log = RewardLog(rollout, len(completions), self.names)
        if rollout.epochs:  # a training batch (an evaluation's keeps the last one's)
            self.epoch = rollout.epochs[0]
        try:
            rewards = compute_rewards(self.funcs, prompts, completions, rollout.completion_lists,
                                      columns, self.timeout, self.names, step=step,
                                      trainer_state=self.trainer_state(step),
                                      log_extra=log.log_extra, log_metric=log.log_metric)
        except RewardError as e:
            fail(f"{e}. Checkpoints already written are intact")
        rollout.logged_columns.update(log.columns)
        return rewards.to(rollout.completion_mask.device)


class RewardLog:
    """What reward functions log on one batch, TRL's log_extra(column, values) (columns of the
    completions table) and log_metric(name, value) (into the Rollout's logged_metrics), checked as
    user code calls them: a table column's name or a trainer metric's, a count other than B, a value
    that is not a number is a ValueError, which the calling function's one line names."""

    def __init__(self, rollout, B, reward_names):
        self.rollout, self.B, self.reward_names = rollout, B, reward_names
        self.columns = {}  # column -> values, one per completion

    def log_extra(self, column, values):
        column, values = str(column), list(values)
        if column in TABLE_COLUMNS or column in self.reward_names:
            raise ValueError(f"log_extra({column!r}, ...): the completions table has a column "
                             f"{column!r} of its own; choose another name")
        if len(values) != self.B:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {self.B} "
                             "completions: give one per completion")
        self.columns[column] = values

    def log_metric(self, name, value):
        name = str(name)
        if trainer_metric(name):
            raise ValueError(f"log_metric({name!r}, ...): {name!r} is the trainer's own metric "
                             "name (or in its eval_, rewards/, time/... groups); choose another")
        try:
            value = float(value)  # a number, or a tensor of one
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"log_metric({name!r}, {str(value)[:40]!r}): the value must be a "
                             "number") from None
        self.rollout.logged_metrics.setdefault(name, []).append(value)


def load_rewards(cfg, device, owned=()):
    """--reward_funcs, then the reward functions environments own (environment_rewards) ->
    RewardFunctions; reward models are placed and sharded like the reference model. A function
    that does not load is one line naming it. --reward_weights weighs the first, or all of them;
    an environment's weight is 1 unless it says (TRL's rule)."""
    funcs, weights = [], cfg.reward_weights
    for spec in cfg.reward_funcs or []:
        try:
            place = lambda m: prepare_model(m, cfg, False, device)  # noqa: E731
            funcs.append(load_reward_func(spec, place, device, cfg.max_completion_length))
        except ValueError as e:
            fail(str(e))
    if not funcs + list(owned):
        fail("no reward function: pass --reward_funcs NAME [NAME ...], or an --environment whose "
             "environments score themselves (get_reward)")
    if weights is not None and len(weights) not in (len(funcs), len(funcs) + len(owned)):
        fail(f"{len(weights)} reward_weights for {len(funcs)} reward_funcs and "
             f"{len(owned)} environment rewards; give one weight each")
    weights = weights and weights + [1.0] * (len(funcs) + len(owned) - len(weights))
    return RewardFunctions(funcs + list(owned), weights, cfg.reward_timeout, cfg)
