"""Multi-turn rollouts: the model talks to an environment (a game, a tutor, a verifier that answers
back, tools) between its turns, and the whole trajectory is one RLOO action.

Interface (README 'Multi-turn: tools and environments'): --environment FILE.py:make_env names a
factory called once per trajectory with its dataset row (a dict of the row's columns) that returns
an object with
    step(text) -> (reply, done)    after each model turn: text is the turn, decoded;
    reset() -> prompt or None      optional, before the first turn: a prompt that replaces the row's
reply is a list of messages for conversational prompts (rendered by the chat template, e.g.
{"role": "tool", ...} or {"role": "user", ...}) and a string for standard ones (appended as is).
The trajectory ends when step says done, when the model's token budget (max_completion_length over
all turns) is spent, or when the next reply would not fit in max_trajectory_length (truncated).

The trajectory is prompt, model turn, reply, model turn, ...: every token after the prompt is in the
Rollout's completion, and `generated_mask` says which ones the model sampled. Only those enter the
sequence log-prob s_i, the KL, the entropy and the lengths; the replies are context (paper §3: the
trajectory is one action, its log-prob the sum over the model's own tokens).
"""
import dataclasses

import torch

import data
import tools
from batches import Rollout
from config import fail
from forward import micro_batches
from prompting import is_conversational, pad, prompt_tensors, repeat_each, tokenize_prompts


# ---------------------------------------------------------------------------------------------
# The embedded multi-turn task
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class LookupEnvironment:
    """The embedded task with the string hidden: the prompt is "=" only, and the string is shown
    ("4172=") only in answer to the model's first turn (its question, whatever it says), to be
    copied in the second. One turn can only guess the digits (reward about 0.05)."""
    target: str
    asked: bool = False

    def reset(self):
        return "="

    def step(self, text):
        if self.asked:
            return None, True
        self.asked = True
        return self.target + "=", False


def lookup_environment(row):
    return LookupEnvironment(row["target"])


BUILTINS = {"lookup": lookup_environment}


def load_environment(spec):
    """--environment: a built-in name or FILE.py:FACTORY -> the factory. One line if it does not
    load."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    source, _, name = spec.rpartition(":")
    if not source.endswith(".py") or not name:
        fail(f"--environment {spec}: give FILE.py:FACTORY or one of {sorted(BUILTINS)}")
    factory = getattr(tools.import_file(source, "environment file"), name, None)
    if not callable(factory):
        fail(f"--environment {spec}: {source} has no callable {name!r}")
    return factory


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
        self.cfg, self.generator, self.make_env = cfg, generator, make_env
        self.tokenizer, self.eos_ids, self.max_length = tokenizer, set(eos_ids), max_length

    def push_weights(self):
        self.generator.push_weights()

    def close(self):
        self.generator.close()

    def generate(self, rows, seed=None):
        """rows -> Rollout of G trajectories per prompt, generated_mask marking the model's
        tokens. Our decode loop runs the turns of --generation_chunk_size trajectories at a time
        (0: all), each chunk a session that keeps its KV cache from turn to turn."""
        trajectories = [self.start(row) for row in row_dicts(rows, self.cfg.num_generations)]
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
            for key, value in out.timings.items():
                timings[key] = timings.get(key, 0.0) + value
            for j, t in enumerate(going):
                ids = out.completion_lists[j][:self.room(t)]
                logps = out.sampler_logps
                self.model_turn(t, ids, None if logps is None else logps[j, :len(ids)].tolist())
            turn += 1
        return out.sampler_logps is not None

    def room(self, t):
        """Tokens the model may still write in this turn: its budget, within the bound."""
        return min(t.budget, self.max_length - len(t.prompt_ids) - len(t.ids))

    def start(self, row):
        """A trajectory's environment (from its row), its prompt and the prompt's tokens. A factory
        or reset that raises, hangs past --environment_timeout or returns something other than an
        environment and a prompt stops the run with one line: no trajectory could start."""
        spec = self.cfg.environment or self.cfg.tools
        outcome = tools.in_thread(lambda: open_environment(self.make_env, row),
                                  self.cfg.environment_timeout)
        if "value" not in outcome:  # a hung factory is abandoned in its daemon thread
            e = outcome.get("error")
            why = (f"raised {type(e).__name__}: {e}" if e else "did not return within "
                   f"--environment_timeout {self.cfg.environment_timeout:g} s")
            fail(f"--environment {spec}: making the environment of a row {why}")
        env, prompt = outcome["value"]
        if not callable(getattr(env, "step", None)):
            fail(f"--environment {spec}: the factory returned {str(env)[:60]!r} (a "
                 f"{type(env).__name__}), which has no step(text) method; return an environment")
        problem = None if prompt is None else reset_problem(prompt)
        if problem is not None:
            fail(f"--environment {spec}: reset() returned {problem}; return a prompt (a non-empty "
                 "string or a list of {'role', 'content'} messages), or None for the row's")
        prompt = row["prompt"] if prompt is None else prompt
        if self.cfg.tools and not is_conversational(prompt):
            fail("--tools needs conversational prompts ([{'role': 'user', 'content': ...}]): tool "
                 f"calls and results are chat messages; got {str(prompt)[:80]!r}")
        (ids,) = tokenize_prompts(self.tokenizer, [prompt], self.cfg.chat_template_kwargs)
        return Trajectory(env, prompt, ids, self.cfg.max_completion_length)

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
        if t.done:
            return
        reply_ids = self.reply_ids(t, text, reply, ids[-1])
        if t.budget == 0 or len(t.prompt_ids) + len(t.ids) + len(reply_ids) >= self.max_length:
            t.done = t.truncated = True  # no room for another model turn
            return
        t.add(reply_ids, 0)
        t.turns += reply if isinstance(reply, list) else [{"role": "environment", "content": reply}]

    def step(self, t, text):
        """env.step(text) within --environment_timeout. An exception or a timeout ends this
        trajectory with an error turn the reward functions see (counted in the metrics); a reply
        of the wrong kind is a bug in the environment: one line."""
        outcome = tools.in_thread(lambda: t.env.step(text), self.cfg.environment_timeout)
        if "value" not in outcome:  # a hung step is abandoned in its daemon thread
            t.env_failures += 1
            e = outcome.get("error")
            why = (f"raised {type(e).__name__}: {e}" if e else "did not return within "
                   f"--environment_timeout {self.cfg.environment_timeout:g} s")
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
        one as the chat template renders it after the model's turn, i.e. the rest of the assistant
        turn after the model's EOS, the reply's messages and the next generation prompt."""
        tokenizer = self.tokenizer
        if isinstance(reply, str):
            return tokenizer(reply, add_special_tokens=False).input_ids
        options = self.cfg.chat_template_kwargs or {}
        render = lambda conversation, **kw: tokenizer.apply_chat_template(  # noqa: E731
            conversation, tokenize=False, **options, **kw)
        said = t.prompt + t.turns  # the model's turn is the last
        before, after = render(said), render(said + reply, add_generation_prompt=True)
        if not after.startswith(before):
            fail("the chat template renders a conversation's beginning differently once it goes "
                 "on (e.g. it drops earlier reasoning): multi-turn training needs a template "
                 "whose rendering of a conversation extends that of its beginning")
        opened = render(said[:-1], add_generation_prompt=True)
        marked = render(said[:-1] + [{"role": "assistant", "content": MARK}])
        closing = marked[marked.index(MARK) + len(MARK):] if marked.startswith(opened) else ""
        eos_text = tokenizer.decode([eos_id])  # the model wrote this much of the closing itself
        glue = closing[len(eos_text):] if closing.startswith(eos_text) else closing
        return tokenizer(glue + after[len(before):], add_special_tokens=False).input_ids

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
                          self.tokenizer.batch_decode(lists, skip_special_tokens=True), logps,
                          generated_mask=generated, turns=[t.turns for t in trajectories])
        rollout.turn_stats = turn_stats(trajectories, device)
        return rollout


def open_environment(make_env, row):
    """make_env(row) and its reset(), if it has one -> (environment, prompt or None)."""
    env = make_env(row)
    return env, env.reset() if callable(getattr(env, "reset", None)) else None


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
