"""Multi-turn rollouts: the model talks to an environment (a game, a tutor, a verifier that answers
back, tools) between its turns, and the whole trajectory is one RLOO action.

Interface (docs/multi-turn.md 'Multi-turn: tools and environments'): --environment FILE.py:NAME
names a factory, or a dict of named factories that routes each row by its `environment` column.
Two shapes of environment meet in one interface, step(text) -> (reply, done):
- rloo's: the factory takes the row (a dict of its columns) and returns an object with
    step(text) -> (reply, done)    after each model turn: text is the turn, decoded;
    reset() -> prompt or None      optional, before the first turn: a prompt that replaces the row's
    get_reward() -> float          optional, after the last step: the environment's own reward
  reply is a list of messages for conversational prompts (rendered by the chat template, e.g.
  {"role": "tool", ...} or {"role": "user", ...}) and a string for standard ones (appended as is).
- TRL's (GRPOTrainer's environment_factory): the factory takes nothing and returns an object
  without `step`, whose reset(**columns) -> str or None gets the row's columns (the string is
  appended to the last user message), whose optional get_reward() scores it, and whose other
  public methods are tools; tools.ToolEnvironment (owner=the object) gives it `step`.
The factory is told apart by whether it requires an argument (takes_row), the object by `step`.
The trajectory ends when step says done, when the model's token budget (max_completion_length over
all turns) is spent, or when the next reply would not fit in max_trajectory_length (truncated).
The G trajectories of a group share one reset: one environment is made and reset per prompt, then
deep-copied (or, where it cannot be, made G times with `random` and numpy seeded alike).

The trajectory is prompt, model turn, reply, model turn, ...: every token after the prompt is in the
Rollout's completion, and `generated_mask` says which ones the model sampled. Only those enter the
sequence log-prob s_i, the KL, the entropy and the lengths; the replies are context (paper §3: the
trajectory is one action, its log-prob the sum over the model's own tokens).
"""
import copy
import dataclasses
import inspect
import random
import sys
import weakref

import numpy as np
import torch
from tqdm import tqdm

from options import tools
from step import data
from step.batches import Rollout
from plumbing.config import fail
from step.forward import micro_batches
from options.lookup import ScoredLookup, lookup_environment
from step.metrics import merge_timings
from step.prompting import (completion_texts, is_conversational, message_text, pad,
                            prompt_tensors, repeat_each, tokenize_prompts, unknown_token,
                            unrepresented)
from step.reward_calls import user_error


# --environment NAME: the embedded multi-turn tasks (options/lookup.py)
BUILTINS = {"lookup": lookup_environment,
            "lookup_scored": lambda row: ScoredLookup(row["target"])}


def load_environment(spec):
    """--environment: a built-in name or FILE.py:NAME -> NAME, a factory or a dict of named
    factories (the file's one module of the run: user_code). One line if it does not load."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    source, _, name = spec.rpartition(":")
    if not source.endswith(".py") or not name:
        fail(f"--environment {spec}: give FILE.py:FACTORY or one of {sorted(BUILTINS)}")
    factory = getattr(tools.import_file(source, "environment"), name, None)
    if isinstance(factory, dict):
        bad = [k for k, f in factory.items() if not isinstance(k, str) or not callable(f)]
        if bad or not factory:
            fail(f"--environment {spec}: {name} must map environment names (strings) to "
                 f"factories; {'it is empty' if not factory else f'{bad[0]!r} does not'}")
    elif not callable(factory):
        fail(f"--environment {spec}: {source} has no callable {name!r} (nor a dict of them)")
    return factory


def takes_row(factory):
    """Whether a factory is rloo's (it requires an argument: the row) or TRL's (it takes none)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: rloo's
        return True
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in params)


def tool_methods(env):
    """A TRL environment's tools: its public methods but reset and get_reward, listed on the
    class (getattr on the instance would evaluate properties), bound to the instance."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")]


def open_environment(factory, row):
    """One row's environment and its reset -> (environment, prompt or None). rloo's
    factory gets the row and reset() nothing, its prompt replacing the row's; TRL's gets nothing
    and reset the row's columns but the routing `environment`, a string it returns appended to
    the last user message (TRL's rule)."""
    if takes_row(factory):
        env = factory(row)
        return env, env.reset() if callable(getattr(env, "reset", None)) else None
    env = factory()
    if not callable(getattr(env, "reset", None)):
        return env, None  # start() names the problem
    observation = env.reset(**{k: v for k, v in row.items() if k != "environment"})
    if isinstance(observation, str):
        prompt = row["prompt"]
        observation = (prompt + observation if isinstance(prompt, str) else
                       prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] +
                                       observation}])
    return env, observation


SCHEMAS = weakref.WeakKeyDictionary()  # TRL environment class -> its chat template kwargs


def class_tools(cls, methods):
    """{"tools": the JSON schemas of a TRL environment class's methods}, built once per class;
    one line naming a method the model cannot be shown (no type hints or docstring)."""
    if cls not in SCHEMAS:
        SCHEMAS[cls] = {"tools": tools.tool_schemas(methods)} if methods else {}
    return SCHEMAS[cls]


def user_object(env):
    """What the user's code made: a TRL environment behind its ToolEnvironment, or the
    environment itself. Reward functions get these (`environments`), get_reward is theirs."""
    owner = getattr(env, "owner", None)
    return env if owner is None else owner


def environment_rewards(cfg, dataset):
    """The reward sources environments own: one per class with get_reward (sync or async), named
    after it, scoring the trajectories of that class (None, left out of R, for others), as TRL's
    GRPOTrainer does. Each factory is made once here on a row it routes (TRL's probe), so one that
    cannot start is one line at start-up."""
    if not cfg.environment:
        return []
    factories = routes(cfg.environment, dataset)
    if dataset is None:
        rows = []
    elif hasattr(dataset, "__len__"):
        rows = dataset.select(range(min(len(dataset), 100)))
    else:  # a stream
        rows = [next(iter(dataset))]
    classes = []
    for name, factory in factories.items():
        row = next((r for r in rows if name is None or r.get("environment") == name),
                   rows[0] if rows else {"prompt": ""})
        outcome = tools.in_thread(lambda: factory(row) if takes_row(factory) else factory(),
                                  cfg.environment_timeout, f"--environment {cfg.environment}")
        if "value" not in outcome:
            fail(f"--environment {cfg.environment}: making an environment"
                 f"{f' {name!r}' if name else ''} {why_not(outcome, cfg)}")
        cls = type(outcome["value"])
        if callable(getattr(cls, "get_reward", None)) and cls not in classes:
            classes.append(cls)
    return [owned_reward(cls) for cls in classes]


def owned_reward(cls):
    """A reward function over `environments` calling get_reward on those of exactly this class."""
    if inspect.iscoroutinefunction(cls.get_reward):
        async def reward(environments, **kwargs):
            return [await e.get_reward() if type(e) is cls else None for e in environments]
    else:
        def reward(environments, **kwargs):
            return [e.get_reward() if type(e) is cls else None for e in environments]
    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward


def routes(spec, dataset=None):
    """--environment -> {name: factory}, None the name of a single factory for every row. A dict
    needs a dataset with an `environment` column naming its factories: one line if not."""
    factory = load_environment(spec)
    if not isinstance(factory, dict):
        return {None: factory}
    columns = None if dataset is None else (dataset.column_names or list(next(iter(dataset))))
    if columns is not None and "environment" not in columns:
        fail(f"--environment {spec} names several environments: each row picks one in its "
             "`environment` column, and the dataset has none; add it, or give one factory")
    return factory


def why_not(outcome, cfg, located=True):
    """Why a call in tools.in_thread gave no value: what it raised (located: and where in the
    user's code), or that it hung."""
    e = outcome.get("error")
    if e is None:
        return f"did not return within --environment_timeout {cfg.environment_timeout:g} s"
    return f"raised {user_error(e) if located else f'{type(e).__name__}: {e}'}"


# ---------------------------------------------------------------------------------------------
# The turn loop over any generator
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Trajectory:
    """One trajectory as it grows: its tokens after the prompt, which of them the model sampled
    (1) or the environment wrote (0), the sampler's log-probs (0 at the environment's), its turns
    as messages (what reward functions get as the completion) and the model tokens left."""
    env: object
    prompt: object  # str or messages: what the model saw first
    prompt_ids: list
    budget: int
    ids: list = dataclasses.field(default_factory=list)
    generated: list = dataclasses.field(default_factory=list)
    logps: list = dataclasses.field(default_factory=list)
    turns: list = dataclasses.field(default_factory=list)
    done: bool = False
    truncated: bool = False
    env_failures: int = 0
    template_kwargs: dict | None = None  # the chat template's, with this environment's tools

    def add(self, ids, generated, logps=None):
        self.ids += ids
        self.generated += [generated] * len(ids)
        self.logps += logps if logps is not None else [0.0] * len(ids)


# stands for an assistant turn's content, to find where the template closes the turn
MARK = "\u2063rloo\u2063"


def row_dicts(rows, G):
    """{column: [P values]} -> B = P*G row dicts, each prompt's G adjacent."""
    P = len(rows["prompt"])
    return repeat_each([{k: v[p] for k, v in rows.items()} for p in range(P)], G)


def turn_stats(trajectories, device):
    """Per trajectory [B]: model turns, tool calls and failures (where the environment counts them,
    as tools.ToolEnvironment does) and environment failures."""
    def column(values):
        return torch.tensor(values, dtype=torch.float, device=device)
    return {"turns": column([sum(m["role"] == "assistant" for m in t.turns) for t in trajectories]),
            "tool_calls": column([getattr(t.env, "tool_calls", 0) for t in trajectories]),
            "tool_failures": column([getattr(t.env, "tool_failures", 0) for t in trajectories]),
            "env_failures": column([t.env_failures for t in trajectories])}


class MultiTurn:
    """The generator interface (generate, push_weights, close) over an inner generator (DecodeLoop
    or VLLMGenerator), which samples each turn: one call per turn over the trajectories still
    going, each continuing from its own token ids, so every backend sees exactly the tokens the
    trainer will score. Neither computes a finished prefix again: vLLM's prefix cache, and our
    decode loop's session (DecodeSession), keep it."""

    def __init__(self, cfg, generator, make_env, tokenizer, eos_ids, max_length):
        self.cfg, self.generator = cfg, generator
        self.routes = make_env if isinstance(make_env, dict) else {None: make_env}
        self.tokenizer, self.eos_ids, self.max_length = tokenizer, set(eos_ids), max_length
        self.style = None  # the template's tool-call format, read when a TRL environment needs it
        self.failed = False  # a step failed already (said once)
        # a tokenizer with an unknown token (the embedded model's): text it cannot read, said once
        self.unread = unknown_token(tokenizer) is not None

    def push_weights(self):
        self.generator.push_weights()

    def close(self):
        self.generator.close()

    def generate(self, rows, seed=None):
        """rows -> Rollout of G trajectories per prompt, generated_mask marking the model's
        tokens. Our decode loop runs the turns of --generation_chunk_size trajectories at a time
        (0: all), each chunk a session that keeps its KV cache from turn to turn."""
        G, base = self.cfg.num_generations, random.randrange(2**31) if seed is None else seed
        trajectories = [t for p, row in enumerate(row_dicts(rows, 1))
                        for t in self.start_group(row, G, base * 100003 + p)]
        B, timings, session = len(trajectories), {}, getattr(self.generator, "session", None)
        size = (self.cfg.generation_chunk_size if session else 0) or B
        reported = [self.turns(session(range(B)[chunk]) if session else self.generator,
                               trajectories, range(B)[chunk], seed, timings)
                    for chunk in micro_batches(B, size)]
        rollout = self.rollout(rows, trajectories, all(reported))
        rollout.timings = timings
        return rollout

    def turns(self, generator, trajectories, chunk, seed, timings):
        """All turns of trajectories[chunk]: one call per turn over those still going, each
        trajectory named by its index. -> whether the generator reported its log-probs"""
        turn = 0
        while active := [i for i in chunk if not trajectories[i].done]:
            going = [trajectories[i] for i in active]
            call_cfg = dataclasses.replace(self.cfg, num_generations=1,
                                           max_completion_length=max(map(self.room, going)))
            # each turn its own seed: the samples stay a function of (seed, turn, trajectory)
            turn_seed = None if seed is None else seed + 7919 * turn
            out = generator.generate({"prompt": [t.prompt_ids + t.ids for t in going],
                                      "trajectory": active}, turn_seed, cfg=call_cfg)
            merge_timings(timings, out.timings)
            for j, t in enumerate(going):
                ids = out.completion_lists[j][:self.room(t)]
                logps = out.sampler_logps
                self.model_turn(t, ids, None if logps is None else logps[j, :len(ids)].tolist())
            turn += 1
        return out.sampler_logps is not None

    def room(self, t):
        """Tokens the model may still write in this turn: its budget, within the bound."""
        return min(t.budget, self.max_length - len(t.prompt_ids) - len(t.ids))

    def start_group(self, row, G, key):
        """G trajectories sharing one environment's reset: deep copies of the one started, or,
        for an environment that cannot be copied (a socket, a lock), G started with `random` and
        numpy seeded from the group's key, so a reset that samples its task samples the same."""
        first = self.start(row)
        try:
            envs = [copy.deepcopy(first.env) for _ in range(G - 1)]
        except Exception:  # noqa: BLE001 (whatever the user's object holds)
            state = random.getstate(), np.random.get_state()
            group = []
            for _ in range(G):
                random.seed(key)
                np.random.seed(key % 2**32)
                group.append(self.start(row))
            random.setstate(state[0])
            np.random.set_state(state[1])
            return group
        return [first] + [Trajectory(env, first.prompt, list(first.prompt_ids), first.budget,
                                     template_kwargs=first.template_kwargs) for env in envs]

    def start(self, row):
        """A trajectory's environment (from its row), its prompt and the prompt's tokens. A factory
        or reset that raises, hangs past --environment_timeout or returns something other than an
        environment and a prompt stops the run with one line: no trajectory could start."""
        spec = self.cfg.environment or self.cfg.tools
        factory = self.route(row, spec)
        outcome = tools.in_thread(lambda: open_environment(factory, row),
                                  self.cfg.environment_timeout, f"--environment {spec}")
        if "value" not in outcome:  # a hung factory is abandoned in its daemon thread
            fail(f"--environment {spec}: making the environment of a row "
                 f"{why_not(outcome, self.cfg)}")
        env, prompt = outcome["value"]
        env = self.adapt(env)
        if not callable(getattr(env, "step", None)):
            fail(f"--environment {spec}: the factory returned {str(env)[:60]!r} (a "
                 f"{type(env).__name__}), which has no step(text) method; return an environment "
                 "(or, as TRL's environment classes, an object with reset() and tool methods)")
        problem = None if prompt is None else reset_problem(prompt)
        if problem is not None:
            fail(f"--environment {spec}: reset() returned {problem}; return a prompt (a non-empty "
                 "string or a list of {'role', 'content'} messages), or None for the row's")
        prompt = row["prompt"] if prompt is None else prompt
        self.check_readable(prompt)
        kwargs = {**(self.cfg.chat_template_kwargs or {}), **getattr(env, "template_kwargs", {})}
        if (self.cfg.tools or "tools" in kwargs) and not is_conversational(prompt):
            fail("--tools needs conversational prompts ([{'role': 'user', 'content': ...}]): tool "
                 f"calls and results are chat messages; got {str(prompt)[:80]!r}")
        (ids,) = tokenize_prompts(self.tokenizer, [prompt], kwargs)
        return Trajectory(env, prompt, ids, self.cfg.max_completion_length, template_kwargs=kwargs)

    def route(self, row, spec):
        """The factory of a row: the only one, or the one its `environment` column names."""
        if None in self.routes:
            return self.routes[None]
        name = row.get("environment")
        if name not in self.routes:
            fail(f"--environment {spec}: a row has environment={str(name)[:40]!r}, which is not "
                 f"one of {sorted(self.routes)}; fix the row or add the environment")
        return self.routes[name]

    def adapt(self, env):
        """An environment with step as it is; TRL's class (reset and tool methods, no step) as a
        tools.ToolEnvironment over its methods, their schemas shown in its prompt only."""
        if callable(getattr(env, "step", None)) or not callable(getattr(env, "reset", None)):
            return env
        methods = tool_methods(env)
        if methods and self.style is None:
            self.style = tools.template_style(self.tokenizer)  # one line if it has no tools
        return tools.ToolEnvironment(methods, self.style, self.cfg.max_tool_calls,
                                     self.cfg.environment_timeout, owner=env,
                                     template_kwargs=class_tools(type(env), methods))

    def model_turn(self, t, ids, logps):
        """The model's turn into the trajectory, then the environment's answer to it, or the
        end."""
        t.add(ids, 1, logps)
        t.budget -= len(ids)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        t.turns.append({"role": "assistant", "content": text})
        if not ids or ids[-1] not in self.eos_ids:  # the budget ran out inside the turn
            t.done = t.truncated = True
            return
        reply, t.done = self.step(t, text)
        if t.done:  # a last reply (a verdict, a score) is the rewards' to read; no turn follows
            if isinstance(reply, str) and reply or isinstance(reply, list) and reply and \
                    data.prompt_problem(reply) is None:
                t.turns += as_messages(reply)
            return
        reply_ids = self.reply_ids(t, text, reply, ids[-1])
        if t.budget == 0 or len(t.prompt_ids) + len(t.ids) + len(reply_ids) >= self.max_length:
            t.done = t.truncated = True  # no room for another model turn
            return
        t.add(reply_ids, 0)
        t.turns += as_messages(reply)

    def step(self, t, text):
        """env.step(text) within --environment_timeout. An exception or a timeout ends this
        trajectory with an error turn the reward functions see (counted; the first said on
        stderr, where in the user's code); a reply of the wrong kind is a bug: one line."""
        outcome = tools.in_thread(lambda: t.env.step(text), self.cfg.environment_timeout,
                                  f"--environment {self.cfg.environment}'s step")
        if "value" not in outcome:  # a hung step is abandoned in its daemon thread
            t.env_failures += 1
            why = why_not(outcome, self.cfg, located=False)
            if not self.failed:  # a bug in the environment would otherwise pass as a low reward
                self.failed = True
                tqdm.write(f"rloo: WARNING: --environment {self.cfg.environment}: step "
                           f"{why_not(outcome, self.cfg)}; "
                           "the trajectory ends with an error turn the reward functions see, and "
                           "later failures are only counted (environment/failure_frequency)",
                           file=sys.stderr)
            t.turns.append({"role": "environment", "content": f"error: step {why}"})
            return None, True
        result = outcome["value"]
        problem = step_problem(result, is_conversational(t.prompt))
        if problem is not None:
            kind = "a list of messages" if is_conversational(t.prompt) else "a string"
            fail(f"--environment {self.cfg.environment}: step must return (reply, done) with "
                 f"reply {kind} (or anything with done=True); got {problem}")
        return result[0], bool(result[1])

    def reply_ids(self, t, text, reply, eos_id):
        """The environment's tokens: a standard reply as the tokenizer encodes it; a conversational
        one as the chat template renders it after an assistant turn that stands for the model's
        (the prompt, an assistant turn of content MARK, the reply, the next generation prompt),
        from where MARK's turn closes, less the EOS the model wrote itself. Rendered on their own,
        the reply's tokens never depend on how the template re-renders the model's earlier turns
        (Qwen3 and DeepSeek-R1 drop their reasoning once a conversation goes on): the model's
        turns stay the tokens it sampled, so it is trained on exactly what it saw."""
        tokenizer = self.tokenizer
        self.check_readable(as_messages(reply))
        if isinstance(reply, str):
            return tokenizer(reply, add_special_tokens=False).input_ids
        options = self.cfg.chat_template_kwargs if t.template_kwargs is None else t.template_kwargs
        render = lambda conversation, **kw: tokenizer.apply_chat_template(  # noqa: E731
            conversation, tokenize=False, **(options or {}), **kw)
        turn = list(t.prompt) + [{"role": "assistant", "content": MARK}]
        alone, followed = render(turn), render(turn + reply, add_generation_prompt=True)
        closing = alone[alone.find(MARK) + len(MARK):]  # how the template closes the turn
        rest = followed[followed.find(MARK) + len(MARK):]
        if MARK not in alone or not rest.startswith(closing):
            fail("the chat template drops an assistant turn's content, or closes the turn "
                 "differently once messages follow it: multi-turn needs a template that renders "
                 f"a reply after an assistant turn; got {followed[-200:]!r}")
        eos_text = tokenizer.decode([eos_id])  # the model wrote this much of the closing itself
        glue = closing[len(eos_text):] if closing.startswith(eos_text) else closing
        return tokenizer(glue + rest[len(closing):], add_special_tokens=False).input_ids

    def check_readable(self, prompt):
        """The environment's text in characters the tokenizer reads as its unknown token (every
        character but the digits and '=', for the embedded model): one warning a run."""
        lost = self.unread and unrepresented(self.tokenizer, message_text(prompt))
        if lost:
            self.unread = False
            tqdm.write(f"rloo: WARNING: --environment {self.cfg.environment or self.cfg.tools}: "
                       f"the tokenizer reads {len(lost)} characters of the environment's text "
                       f"({''.join(dict.fromkeys(lost))[:24]!r}) as its unknown token; the model "
                       "does not see them", file=sys.stderr)

    def rollout(self, rows, trajectories, reported):
        """The trajectories as one Rollout: prompts left-padded, trajectories right-padded."""
        device, pad_id = self.generator.device, self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = prompt_tensors([t.prompt_ids for t in trajectories], pad_id, 1,
                                                 device)
        completion_ids = pad([t.ids for t in trajectories], pad_id).to(device)
        completion_mask = pad([[1] * len(t.ids) for t in trajectories], 0).to(device)
        generated = pad([t.generated for t in trajectories], 0).to(device)
        logps = pad([t.logps for t in trajectories], 0.0).float().to(device) if reported else None
        lists = [t.ids for t in trajectories]
        rollout = Rollout(rows, prompt_ids, prompt_mask, completion_ids, completion_mask,
                          torch.tensor([t.truncated for t in trajectories], device=device), lists,
                          completion_texts(self.tokenizer, lists), logps,
                          generated_mask=generated, turns=[t.turns for t in trajectories],
                          environments=[user_object(t.env) for t in trajectories],
                          prompts=[t.prompt for t in trajectories])
        rollout.turn_stats = turn_stats(trajectories, device)
        return rollout


def as_messages(reply):
    """A reply as conversation messages: a standard one's role is `environment`."""
    return reply if isinstance(reply, list) else [{"role": "environment", "content": reply}]


def reset_problem(prompt):
    """What is wrong with the prompt a reset() returned, or None (data.prompt_problem's rule)."""
    if not isinstance(prompt, (str, list)):
        return f"{str(prompt)[:60]!r} of type {type(prompt).__name__}"
    return data.prompt_problem(prompt)


def is_flag(value):
    """True or False, also as 0/1 or a numpy or torch bool: what step's `done` may be."""
    try:
        return not isinstance(value, (str, bytes)) and value in (0, 1)
    except (TypeError, ValueError, RuntimeError):  # an array of several values
        return False


def step_problem(result, conversational):
    """What is wrong with what env.step returned, or None: a (reply, done) pair, done a flag, and
    unless done, the reply a string (standard prompts) or a list of messages (conversational),
    each with a string role and content."""
    if not isinstance(result, tuple) or len(result) != 2:
        return str(result)[:200]
    reply, done = result
    if not is_flag(done):
        return f"done={str(done)[:60]!r} (a {type(done).__name__}), which is not True or False"
    if done:
        return None
    if not isinstance(reply, list if conversational else str):
        return f"a reply {str(reply)[:100]!r} of type {type(reply).__name__}"
    if conversational and reply and data.prompt_problem(reply) is not None:
        return f"a reply that is {data.prompt_problem(reply)}"
    return None


def context_length(cfg, model):
    """The trajectory bound: --max_trajectory_length within the model's context."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31
    return min(cfg.max_trajectory_length or limit, limit)


def with_tools(cfg):
    """--tools: the functions load (one line if not) and their schemas join chat_template_kwargs,
    so that every rendering of a prompt, the trainer's and the generator's, shows them."""
    if not cfg.tools:
        return cfg
    schemas = tools.tool_schemas(tools.load_tools(cfg.tools))
    return dataclasses.replace(cfg, chat_template_kwargs={**(cfg.chat_template_kwargs or {}),
                                                          "tools": schemas})


def multi_turn(cfg, generator, tokenizer, processor, eos_ids, max_length):
    """The generator turned multi-turn by --environment or --tools."""
    if processor is not None:
        fail("--environment and --tools take text models; this run has images")
    if cfg.tools:
        funcs = tools.load_tools(cfg.tools)
        style = tools.template_style(tokenizer)
        factory = tools.tool_environment(funcs, style, cfg.max_tool_calls, cfg.environment_timeout)
    else:
        factory = load_environment(cfg.environment)
    return MultiTurn(cfg, generator, factory, tokenizer, eos_ids, max_length)
