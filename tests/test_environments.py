"""Environments as users write them (options/environments.py): TRL's environment classes (GRPOTrainer's environment_factory:
reset(**columns), get_reward(), public methods as tools) beside rloo's step(text) environments, environment-owned
rewards and data, several environments routed by the `environment` column, groups that share their task, and
multi-turn on chat templates that are not prefix-preserving (Qwen3, DeepSeek-R1), trained on exactly the tokens the
sampler saw."""
import json
import os
import pathlib
import signal

import sys

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import rewards
import rollout
from options import environments
from step import forward, prompting
from options.vllm_server import wait_for_server
from chat_templates import QWEN2_5, QWEN3
from conftest import build_chat_model, in_process, requires_vllm
from test_multiturn import THREE_TURNS, ScriptedPolicy
from test_rollout import free_port, start_server
from test_train import cfg_for, read_metrics, run

CPU = torch.device("cpu")
CALL_START = '<tool_call>\n{"name": "increment", "arguments": {"step": '
CALL_END = '}}\n</tool_call>'

# TRL's IncrementEnv, as its GRPO docs give it (the trainer lines left out): the environment owns the data (reset
# samples the task and returns the prompt), scores itself (get_reward) and shows `increment` as a tool
INCREMENT_ENV = '''
import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''

# ... and its dataset variant: the row's `target` column reaches reset(target=...)
INCREMENT_ENV_DATASET = '''
class IncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

''' + INCREMENT_ENV[INCREMENT_ENV.index("    def increment"):].rstrip() + '''

def counter_read(environments, **kwargs):  # a reward function reading the environments' state
    return [float(e.counter) for e in environments]
'''


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """The tiny chat model with Qwen2.5's template, its vocabulary making a call of `increment` three tokens."""
    return build_chat_model(tmp_path_factory.mktemp("tool_model"), template=QWEN2_5, max_positions=2048,
                            words=(CALL_START, CALL_END))


def tokenizer_of(path):
    """The tiny model's tokenizer as built (AutoTokenizer would take Qwen2's class for a qwen2 config, whose byte-level
    pre-tokenizer drops this vocabulary's spaces and newlines), so that the texts below are exact."""
    return PreTrainedTokenizerFast.from_pretrained(path)


def increment_loop(tmp_path, model_dir, source, turns, G=4, **flags):
    (tmp_path / "incr.py").write_text(source)
    flags.setdefault("reward_funcs", None)  # not the embedded preset's task_reward
    cfg = cfg_for(num_generations=G, max_completion_length=64, environment=f"{tmp_path / 'incr.py'}:IncrementEnv",
                  **flags)
    tokenizer = tokenizer_of(model_dir)
    policy = ScriptedPolicy(tokenizer, turns)
    return environments.multi_turn(cfg, policy, tokenizer, None, [policy.eos], 4096), cfg, tokenizer


def environment_text(batch, b, tokenizer):
    return tokenizer.decode(batch.completion_ids[b][(batch.completion_mask - batch.model_tokens())[b].bool()])


def test_trls_increment_env_owns_its_data_and_reward_and_a_group_shares_its_task(tmp_path, tool_model_dir):
    """TRL's IncrementEnv unchanged: the prompt is the empty user message with reset's string appended, the tool's
    schema is in it, the scripted call of increment(3) runs on that trajectory's own instance and its result comes
    back as the template's tool message; get_reward scores each; the G = 4 of a group share one target (reset once,
    then copied) while the groups draw their own."""
    loop, cfg, tokenizer = increment_loop(tmp_path, tool_model_dir, INCREMENT_ENV, [CALL_START + "3" + CALL_END,
                                                                                   "Done."])
    rows = {"prompt": [[{"role": "user", "content": ""}]] * 6}
    batch = loop.generate(rows, seed=0)
    envs = batch.environments
    assert len(envs) == 24 and len({id(e) for e in envs}) == 24 and type(envs[0]).__name__ == "IncrementEnv"
    targets = [e.target for e in envs]
    assert all(len(set(targets[g * 4:(g + 1) * 4])) == 1 for g in range(6)) and len(set(targets)) > 1
    assert all(e.counter == 3 for e in envs)
    prompt = tokenizer.decode(batch.prompt_ids[0][batch.prompt_mask[0].bool()])
    assert f"<|im_start|>user\nIncrement the counter by {targets[0]}.<|im_end|>" in prompt
    assert '"name": "increment"' in prompt and '"step"' in prompt
    assert [m["role"] for m in batch.turns[0]] == ["assistant", "tool", "assistant"]
    assert batch.turns[0][1]["content"] == "3"
    assert environment_text(batch, 0, tokenizer) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>"
                                                     "<|im_end|>\n<|im_start|>assistant\n")
    funcs = rewards.load_rewards(cfg, CPU, environments.environment_rewards(cfg, None))
    assert funcs.names == ["IncrementEnv"] and funcs.weights.tolist() == [1.0]
    scores = funcs(batch, 4, step=0)
    assert scores[:, 0].tolist() == [float(t == 3) for t in targets]


def test_a_file_named_by_environment_and_reward_funcs_is_one_module(tmp_path, tool_model_dir):
    """--environment env.py:IncrementEnv --reward_funcs env.py:solved: one execution of env.py, so the reward's
    isinstance(e, IncrementEnv) holds for the environments the run made (two modules made it False: reward 0), and
    the file's top-level state exists once."""
    source = INCREMENT_ENV.replace("import random\n", "import random\n\nLOADS = []\nLOADS.append(1)\n").replace(
        "random.randint(1, 6)", "3") + \
        "\n\ndef solved(environments, **kwargs):\n" \
        "    return [float(isinstance(e, IncrementEnv) and e.counter == e.target) for e in environments]\n"
    loop, cfg, tokenizer = increment_loop(tmp_path, tool_model_dir, source, [CALL_START + "3" + CALL_END, "Done."],
                                          reward_funcs=[f"{tmp_path / 'incr.py'}:solved"])
    batch = loop.generate({"prompt": [[{"role": "user", "content": ""}]] * 6}, seed=0)
    funcs = rewards.load_rewards(cfg, CPU, environments.environment_rewards(cfg, None))
    assert funcs.names == ["solved", "IncrementEnv"]
    scores = funcs(batch, 4, step=0)
    assert scores.tolist() == [[1.0, 1.0]] * 24
    (module,) = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(tmp_path / "incr.py")]
    assert module.LOADS == [1] and type(batch.environments[0]) is module.IncrementEnv


UNCOPYABLE = INCREMENT_ENV.replace("        self.counter = 0\n        self.target = random", """        import threading
        self.lock = threading.Lock()  # deepcopy cannot copy it
        self.counter = 0
        self.target = random""", 1)


def test_an_environment_that_cannot_be_copied_is_made_per_trajectory_with_the_groups_seed(tmp_path, tool_model_dir):
    """An instance holding a lock cannot be deep-copied: each of the G is made and reset on its own, with `random`
    seeded from the group's key, so the group still shares its task and the groups differ."""
    loop, *_ = increment_loop(tmp_path, tool_model_dir, UNCOPYABLE, ["Done."])
    batch = loop.generate({"prompt": [[{"role": "user", "content": ""}]] * 6}, seed=0)
    targets = [e.target for e in batch.environments]
    assert len({id(e.lock) for e in batch.environments}) == 24
    assert all(len(set(targets[g * 4:(g + 1) * 4])) == 1 for g in range(6)) and len(set(targets)) > 1


def test_the_dataset_variant_gets_the_rows_columns_and_reward_functions_get_the_environments(tmp_path,
                                                                                          tool_model_dir):
    """reset(target, **kwargs) gets the row's columns; reset returning None keeps the row's prompt; a reward
    function's `environments` are the trajectories' own instances (it reads their state after the last step), and
    --reward_weights weighs it and, when given for both, the environment's reward."""
    loop, cfg, _ = increment_loop(tmp_path, tool_model_dir, INCREMENT_ENV_DATASET,
                                  [CALL_START + "2" + CALL_END, CALL_START + "2" + CALL_END, "Done."], G=2,
                                  reward_funcs=[f"{tmp_path / 'incr.py'}:counter_read"], reward_weights=[0.5, 2.0])
    rows = {"prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in (4, 5)],
            "target": [4, 5]}
    batch = loop.generate(rows, seed=0)
    assert [e.target for e in batch.environments] == [4, 4, 5, 5]
    assert batch.turns[0][-1] == {"role": "assistant", "content": "Done."}
    funcs = rewards.load_rewards(cfg, CPU, environments.environment_rewards(cfg, None))
    assert funcs.names == ["counter_read", "IncrementEnv"] and funcs.weights.tolist() == [0.5, 2.0]
    assert funcs(batch, 2, step=0).tolist() == [[4.0, 1.0], [4.0, 1.0], [4.0, 0.0], [4.0, 0.0]]


TWO_ENVIRONMENTS = '''
import asyncio


class CountEnv:
    def reset(self, **kwargs) -> str:
        self.count = 0
        return "Count to two."

    def tick(self) -> int:
        """
        Count one more.

        Returns:
            The count so far.
        """
        self.count += 1
        return self.count

    async def get_reward(self) -> float:  # async, as an LLM judge would be
        await asyncio.sleep(0)
        return float(self.count == 2)


class EchoEnv:
    def reset(self, word, **kwargs) -> str:
        self.word, self.said = word, ""
        return f"Say {word}."

    async def say(self, text: str) -> str:  # async tools too
        """
        Say something.

        Args:
            text: What to say.

        Returns:
            What was heard.
        """
        self.said = text
        return text

    def get_reward(self) -> float:
        return float(self.said == self.word)


ENVIRONMENTS = {"count": CountEnv, "echo": EchoEnv}
'''


def test_two_environments_route_by_the_environment_column_each_showing_its_own_tools(tmp_path, tool_model_dir):
    """A dict of factories: each row's `environment` picks one (the column is not passed to reset), its prompt
    shows only that environment's tools, and each class's get_reward (one async) is a reward of its own, None for
    the other's trajectories."""
    (tmp_path / "envs.py").write_text(TWO_ENVIRONMENTS)
    cfg = cfg_for(num_generations=2, max_completion_length=300, environment=f"{tmp_path / 'envs.py'}:ENVIRONMENTS",
                  reward_funcs=None)
    tokenizer = tokenizer_of(tool_model_dir)
    tick = '<tool_call>\n{"name": "tick", "arguments": {}}\n</tool_call>'
    policy = ScriptedPolicy(tokenizer, [tick, tick, "Done."])
    loop = environments.multi_turn(cfg, policy, tokenizer, None, [policy.eos], 4096)
    empty = [{"role": "user", "content": ""}]
    rows = {"prompt": [empty, empty], "environment": ["count", "echo"], "word": [None, "hi"]}
    batch = loop.generate(rows, seed=0)
    prompts = [tokenizer.decode(batch.prompt_ids[b][batch.prompt_mask[b].bool()]) for b in (0, 2)]
    assert '"name": "tick"' in prompts[0] and '"name": "say"' not in prompts[0] and "Count to two." in prompts[0]
    assert '"name": "say"' in prompts[1] and '"name": "tick"' not in prompts[1] and "Say hi." in prompts[1]
    assert [type(e).__name__ for e in batch.environments] == ["CountEnv"] * 2 + ["EchoEnv"] * 2
    assert batch.turns[2][1]["content"].startswith("error")  # echo has no tick: an error the model reads
    dataset = type("Rows", (list,), {"column_names": ["prompt", "environment", "word"]})(
        [{"prompt": empty, "environment": "count", "word": None}, {"prompt": empty, "environment": "echo",
                                                                   "word": "hi"}])
    dataset.select = lambda index: [dataset[i] for i in index]
    funcs = rewards.load_rewards(cfg, CPU, environments.environment_rewards(cfg, dataset))
    scores = funcs(batch, 2, step=0)
    assert funcs.names == ["CountEnv", "EchoEnv"]
    assert scores[:2, 0].tolist() == [1.0, 1.0] and scores[2:, 0].isnan().all()
    assert scores[:2, 1].isnan().all() and scores[2:, 1].tolist() == [0.0, 0.0]


def test_a_run_of_two_environments_without_reward_funcs_logs_each_ones_reward(tmp_path, tool_model_dir):
    """train.py end to end: a dataset that only routes rows (no prompt column), no --reward_funcs: each
    environment's reward is logged under its class name."""
    (tmp_path / "envs.py").write_text(TWO_ENVIRONMENTS)
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"environment": e, "word": "hi"}) + "\n" for e in ["count", "echo"] * 4))
    out = run(["--model", str(tool_model_dir), "--dataset", str(data_file), "--environment",
               f"{tmp_path / 'envs.py'}:ENVIRONMENTS", "--max_completion_length", "12", "--num_generations", "2",
               "--per_device_train_batch_size", "8", "--max_steps", "1", "--bf16", "false", "--logging_steps", "1",
               "--output_dir", str(tmp_path / "run")], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (m,) = read_metrics(tmp_path / "run")
    assert {"rewards/CountEnv/mean", "rewards/EchoEnv/mean"} <= set(m) and m["rewards/EchoEnv/mean"] == 0.0


def test_trls_increment_env_trains_without_a_dataset_and_needs_max_steps(tmp_path, tool_model_dir):
    """No --dataset, no --reward_funcs: the environment owns the data and the reward. Without --max_steps the run
    has no length: one line."""
    (tmp_path / "incr.py").write_text(INCREMENT_ENV)
    base = ["--model", str(tool_model_dir), "--environment", f"{tmp_path / 'incr.py'}:IncrementEnv",
            "--max_completion_length", "8", "--num_generations", "2", "--per_device_train_batch_size", "4",
            "--bf16", "false", "--logging_steps", "1", "--log_completions", "--output_dir", str(tmp_path / "run")]
    out = in_process(base)
    assert out.returncode != 0 and "set --max_steps" in out.stderr and "Traceback" not in out.stderr, out.stderr
    out = in_process(base + ["--max_steps", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(0 <= m["rewards/IncrementEnv/mean"] <= 1 for m in metrics)


# ------------------------------------------------------------------------------------------------ templates

def r1_template():
    import trl
    return (pathlib.Path(trl.__file__).parent / "chat_templates" / "deepseek_r1_distill.jinja").read_text()


R1_SPECIALS = ("<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜begin▁of▁sentence｜>")
TEMPLATES = {  # name: (build_chat_model's arguments, the reply's tokens after the model's turn)
    "qwen3": (dict(template=QWEN3),  # enable_thinking false: an empty think block opens each turn
              "\n<|im_start|>user\nagain 1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "deepseek-r1": (dict(template=None, specials=R1_SPECIALS, eos=R1_SPECIALS[0], bos=R1_SPECIALS[3]),
                    "<｜User｜>again 1<｜Assistant｜><think>\n"),
}


Again = {}
exec(THREE_TURNS, Again)  # test_multiturn's environment: user replies to the first two model turns
Again = Again["Again"]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def template_model(request, tmp_path_factory):
    kwargs, reply = TEMPLATES[request.param]
    kwargs = {**kwargs, "template": kwargs["template"] or r1_template()}
    return request.param, build_chat_model(tmp_path_factory.mktemp(request.param), **kwargs), reply


def test_a_template_that_drops_earlier_reasoning_keeps_the_tokens_the_model_sampled(template_model):
    """Qwen3 and DeepSeek-R1 render an earlier turn without its reasoning once the conversation goes on. The
    trajectory is the model's own tokens, its <think> block kept, then the reply rendered on its own (the exact
    tokens below): not the template's re-rendering of the conversation, which would drop the reasoning."""
    name, path, reply = template_model
    tokenizer = tokenizer_of(path)
    cfg = cfg_for(num_generations=2, max_completion_length=200, chat_template_kwargs={"enable_thinking": False})
    policy = ScriptedPolicy(tokenizer, ["<think>\nhmm\n</think>\n\nok"])
    if name == "deepseek-r1":
        policy.eos = tokenizer.eos_token_id
    loop = environments.MultiTurn(cfg, policy, Again, tokenizer, [policy.eos], 4096)
    prompt = [{"role": "user", "content": "hi"}]
    batch = loop.generate({"prompt": [prompt]}, seed=0)
    ids = batch.completion_ids[0][batch.completion_mask[0].bool()].tolist()
    text = tokenizer.decode(ids)
    eos = tokenizer.decode([policy.eos])
    assert text.count("<think>\nhmm\n</think>") == 3
    assert text.startswith("<think>\nhmm\n</think>\n\nok" + eos + reply)
    assert environment_text(batch, 0, tokenizer) == reply + reply.replace("again 1", "again 2")
    rerendered = tokenizer.apply_chat_template(prompt + batch.turns[0], tokenize=False, enable_thinking=False)
    assert rerendered.count("hmm") < 3  # what re-rendering would have trained on instead


def test_a_sampled_multi_turn_run_on_such_a_template_has_the_trainers_log_probs(template_model):
    """Our decode loop samples three turns per trajectory on the tiny model under each template: the sampler's
    log-probs of the model's tokens equal the trainer's forward over the whole trajectory (fp32, < 1e-4), the
    environment's tokens in the context and out of the sums."""
    _, path, _ = template_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    tokenizer = tokenizer_of(path)
    cfg = cfg_for(num_generations=2, max_completion_length=30, bf16=False,
                  chat_template_kwargs={"enable_thinking": False},
                  generation_kwargs={"stop_token_ids": tokenizer.convert_tokens_to_ids(list("aeiou "))})
    inner = rollout.DecodeLoop(cfg, model, tokenizer, None, CPU)
    eos_ids = prompting.eos_token_ids(tokenizer, model, cfg)
    loop = environments.MultiTurn(cfg, inner, Again, tokenizer, eos_ids, 4096)
    batch = loop.generate({"prompt": [[{"role": "user", "content": f"{i}?"}] for i in range(4)]}, seed=1)
    assert batch.turn_stats["turns"].max() == 3
    with torch.no_grad():
        logps = forward.batch_logps(model, batch, cfg)
    mask = batch.model_tokens().bool()
    assert (batch.sampler_logps[~mask] == 0).all() and (~mask & batch.completion_mask.bool()).any()
    torch.testing.assert_close(batch.sampler_logps[mask], logps[mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
def test_tool_results_are_the_tokens_trls_grpo_trainer_renders(smollm2_dir, template):
    """TRL as the oracle: GRPOTrainer._get_tool_suffix_ids (the suffix after a dummy tool-calling turn, trimmed at
    its EOS) for two tool results, on Qwen2.5's template and, for Qwen3, on the training template TRL swaps in
    (get_training_chat_template); ours renders Qwen3's own template and gets the same tokens."""
    import types

    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    from trl.chat_template_utils import get_training_chat_template
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.chat_template = {"qwen2.5": QWEN2_5, "qwen3": QWEN3}[template]
    options = {"enable_thinking": False}
    trl_template = get_training_chat_template(tokenizer) if template == "qwen3" else None
    trainer = types.SimpleNamespace(processing_class=tokenizer, chat_template=trl_template, _tokenizer=tokenizer,
                                    chat_template_kwargs=options, _is_vlm=False)
    results = [{"role": "tool", "name": "calculator", "content": "5"},
               {"role": "tool", "name": "calculator", "content": "7"}]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    loop = environments.MultiTurn(cfg_for(chat_template_kwargs=options), None, None, tokenizer, [eos], 4096)
    t = environments.Trajectory(None, [{"role": "user", "content": "2 + 3 and 3 + 4?"}], [], 100)
    assert loop.reply_ids(t, "calls", results, eos) == GRPOTrainer._get_tool_suffix_ids(trainer, results)


@requires_vllm
def test_vllm_colocated_and_server_sample_such_templates_trajectories_as_the_decode_loop(tmp_path, template_model):
    """Greedy (top_k 1; min_tokens 2 and a bias on the end of turn make each turn two tokens) over three turns under
    Qwen3's and DeepSeek-R1's templates: our decode loop, a colocated engine and a server write the same
    conversations, since each turn continues from the trajectory's own token ids. Then plain sampling (turns end at
    stop ids) on the colocated engine: its log-probs of the model's tokens are the trainer's (< 1e-4)."""
    name, path, _ = template_model
    eos = tokenizer_of(path).eos_token_id
    (tmp_path / "env.py").write_text(THREE_TURNS)
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}?"}]}) + "\n"
                                 for i in range(4)))
    base = ["--model", str(path), "--dataset", str(data_file), "--environment", f"{tmp_path}/env.py:make_env",
            "--reward_funcs", f"{tmp_path}/env.py:record", "--max_completion_length", "24", "--num_generations", "2",
            "--per_device_train_batch_size", "8", "--bf16", "false", "--max_steps", "1", "--shuffle_dataset", "false",
            "--chat_template_kwargs", json.dumps({"enable_thinking": False}), "--logging_steps", "1"]
    greedy = ["--top_k", "1", "--generation_kwargs", json.dumps({"min_tokens": 2, "logit_bias": {str(eos): 30.0}})]
    port = free_port()
    server = start_server(path, port)
    seen = {}
    try:
        wait_for_server(f"http://127.0.0.1:{port}", timeout=240)
        for run_name, flags in [("decode", []), ("colocate", ["--use_vllm"]),
                                ("server", ["--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(port)])]:
            log = tmp_path / f"{run_name}.jsonl"
            out = run(base + greedy + flags + ["--output_dir", str(tmp_path / run_name)],
                      env={"TRAJECTORIES": str(log)})
            assert out.returncode == 0, (run_name, out.stderr[-3000:])
            seen[run_name] = json.loads(log.read_text().splitlines()[0])
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    assert all([m["role"] for m in c] == ["assistant", "user"] * 2 + ["assistant"] for c in seen["decode"])
    assert seen["colocate"] == seen["decode"] and seen["server"] == seen["decode"]
    stops = tokenizer_of(path).convert_tokens_to_ids(list("aeiou0123456789 "))
    out = run(base + ["--use_vllm", "--generation_kwargs", json.dumps({"stop_token_ids": stops}), "--output_dir",
                      str(tmp_path / "sampled")], env={"TRAJECTORIES": str(tmp_path / "sampled.jsonl")})
    assert out.returncode == 0, out.stderr[-3000:]
    (m,) = read_metrics(tmp_path / "sampled")
    assert m["sampling/sampling_logp_difference/mean"] < 1e-4 and m["turns/mean"] > 1.5, m


# ------------------------------------------------------------------------------------------------ learning

@pytest.mark.slow
def test_the_lookup_environment_scoring_itself_learns(tmp_path):
    """`--environment lookup_scored`: the embedded lookup task with get_reward in place of task_reward (no reward
    function at all) learns to ask and copy as the plain one does. Measured: 0.01 at step 10, 0.26 at 170, 0.70 at
    230 (0.75 at 350, where it levels off)."""
    out = in_process(["--environment", "lookup_scored", "--max_steps", "230", "--logging_steps", "10",
                      "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    first, last = metrics[0], metrics[-1]
    assert "rewards/ScoredLookup/mean" in last and "rewards/task_reward/mean" not in last
    assert first["reward"] < 0.1 and last["reward"] > 0.4, (first["reward"], last["reward"])


# ------------------------------------------------------------------------------------------------ bad input

NO_REWARD = '''
class Plain:
    def reset(self, **kwargs):
        return None

    def look(self, where: str) -> str:
        """
        Look somewhere.

        Args:
            where: The place.
        """
        return where
'''
UNDOCUMENTED = '''
class Undocumented:
    def reset(self, **kwargs):
        return None

    def look(self, where: str) -> str:
        return where
'''
SETUPS = {  # case: (file text, NAME, flags, the line's words)
    "a dict value that is not a factory": ("ENVS = {'a': 3}", "ENVS", {}, "must map environment names"),
    "an empty dict": ("ENVS = {}", "ENVS", {}, "it is empty"),
    "a dict and no environment column": (TWO_ENVIRONMENTS, "ENVIRONMENTS", {}, "and the dataset has none"),
    "no reward source at all": (NO_REWARD, "Plain", {"reward_funcs": None}, "no reward function"),
    "weights for neither count": (INCREMENT_ENV, "IncrementEnv", {"reward_funcs": None, "reward_weights": [1, 2]},
                                  "2 reward_weights for 0 reward_funcs and 1 environment rewards"),
    "a factory that raises": ("def make():\n    raise OSError('no server')\n", "make", {},
                              "making an environment raised OSError: no server"),
}


class Rows(list):
    """A few dataset rows with the column_names and select a datasets.Dataset has."""
    column_names = ["prompt"]

    def select(self, index):
        return [self[i] for i in index]


@pytest.mark.parametrize("case", list(SETUPS))
def test_an_environment_setup_that_cannot_work_is_one_line_at_start_up(tmp_path, case):
    text, name, flags, words = SETUPS[case]
    (tmp_path / "env.py").write_text(text)
    cfg = cfg_for(environment=f"{tmp_path / 'env.py'}:{name}", **flags)
    with pytest.raises(SystemExit) as info:
        rewards.load_rewards(cfg, CPU, environments.environment_rewards(cfg, Rows([{"prompt": "1="}])))
    assert words in str(info.value) and "\n" not in str(info.value).strip(), str(info.value)


ROW_CASES = {  # case: (file text, NAME, row, the line's words)
    "a row naming no environment": (TWO_ENVIRONMENTS, "ENVIRONMENTS", {"prompt": "x", "environment": "chess"},
                                    "a row has environment='chess', which is not one of ['count', 'echo']"),
    "reset missing a column": (INCREMENT_ENV_DATASET, "IncrementEnv", {"prompt": [{"role": "user", "content": "x"}]},
                               "raised TypeError"),
    "a tool without a docstring": (UNDOCUMENTED, "Undocumented", {"prompt": [{"role": "user", "content": "x"}]},
                                   "tool look has no docstring"),
}


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_an_environment_that_cannot_start_on_a_row_is_one_line(tmp_path, tool_model_dir, case):
    text, name, row, words = ROW_CASES[case]
    (tmp_path / "env.py").write_text(text)
    cfg = cfg_for(environment=f"{tmp_path / 'env.py'}:{name}", reward_funcs=None)
    tokenizer = tokenizer_of(tool_model_dir)
    loop = environments.multi_turn(cfg, None, tokenizer, None, [tokenizer.eos_token_id], 4096)
    with pytest.raises(SystemExit) as info:
        loop.start(row)
    assert words in str(info.value), str(info.value)
