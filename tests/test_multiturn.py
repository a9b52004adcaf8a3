"""Multi-turn trajectories (options/environments.py): the mask that keeps the environment's tokens out of the loss, checked
against a brute-force computation on hand-built two- and three-turn trajectories; the turn loop over our decode loop
(sampler log-probs of model tokens = the trainer's); environments that fail; the embedded lookup task learning."""
import copy
import inspect
import json
import pathlib

import pytest
import torch

import rewards
import rollout
import train
from options import environments
from step import batches, data, forward, prompting
from conftest import in_process, requires_vllm
from test_rollout import vllm_server  # noqa: F401  (the server fixture)
from test_train import cfg_for, read_metrics, run

CPU = torch.device("cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
EOS = 0


def trajectory_batch():
    """Two prompts, G = 2: trajectories of two and three model turns, with environment replies between them (0 in
    the generated mask), of different lengths so that padding is exercised too."""
    prompts = [[3, 4, 1], [5, 1]]  # "12=", "3="
    turns = [  # (tokens, generated)
        [([6, EOS], 1), ([7, 8, 1], 0), ([7, 8, EOS], 1)],
        [([9, 2, EOS], 1), ([4, 1], 0), ([4, EOS], 1), ([5, 5, 1], 0), ([5, EOS], 1)],
        [([EOS], 1), ([3, 1], 0), ([3, 4, 5, EOS], 1)],
        [([2, 2, 2, 2], 1)],  # one turn, truncated
    ]
    ids = [[t for piece, _ in traj for t in piece] for traj in turns]
    generated = [[g for piece, g in traj for _ in piece] for traj in turns]
    prompt_lists = [prompts[0], prompts[0], prompts[1], prompts[1]]
    prompt_ids, prompt_mask = prompting.prompt_tensors(prompt_lists, EOS, 1, CPU)
    batch = batches.Rollout(
        {"prompt": ["12=", "3="]}, prompt_ids, prompt_mask, prompting.pad(ids, EOS), prompting.pad([[1] * len(i) for i in ids], 0),
        torch.tensor([False, False, False, True]), ids, ["x"] * 4, generated_mask=prompting.pad(generated, 0))
    return batch, prompt_lists, ids, generated


def brute_force(model, prompt_lists, ids, generated, temperature=1.0):
    """Each model token's log pi_T and entropy from a forward over exactly its prefix (no padding, no cache). ->
    per-trajectory sums of log-probs over model tokens [B], per-token log-probs (lists), entropy sum, token count"""
    sums, per_token, entropy, count = [], [], 0.0, 0
    for prompt, traj, flags in zip(prompt_lists, ids, generated):
        total, row = 0.0, []
        for t, (token, flag) in enumerate(zip(traj, flags)):
            prefix = torch.tensor([prompt + traj[:t]])
            logits = model(input_ids=prefix).logits[0, -1] / temperature
            logp = torch.log_softmax(logits, -1)
            row.append(logp[token])
            if flag:
                total = total + logp[token]
                entropy = entropy + -(logp.exp() * logp).sum()
                count += 1
        sums.append(total)
        per_token.append(row)
    return torch.stack(sums), per_token, entropy, count


def fixed_rewards(values):
    def fixed(completions, **kwargs):
        return list(values)
    return rewards.RewardFunctions([fixed])


def test_the_loss_kl_entropy_and_gradient_are_those_of_the_model_tokens_alone():
    """A real training step on hand-built 2- and 3-turn trajectories (SGD with lr 1, so the parameter change is
    minus the gradient) against autograd on the brute-force loss -mean(A_i s_i), s_i summed over the model's tokens
    only; the KL summed over them too (log pi_old - log pi_ref), the entropy their mean. The same batch without the
    mask would give another gradient, so the check has teeth."""
    model, _, _ = data.embedded_task(seed=0)
    ref = data.embedded_task(seed=1)[0]
    batch, prompt_lists, ids, generated = trajectory_batch()
    s_brute, per_token, entropy, count = brute_force(model, prompt_lists, ids, generated)
    # the sampler's log-probs at model tokens (0 at the environment's), as the decode loop reports them
    batch.sampler_logps = prompting.pad([[float(lp) * g for lp, g in zip(row, flags)]
                                       for row, flags in zip(per_token, generated)], 0.0)
    cfg = cfg_for(num_generations=2, beta=0.1, per_device_train_batch_size=4, max_grad_norm=0.0, bf16=False,
                  temperature=1.0)
    scores = train.score(cfg, batch, fixed_rewards([1.0, 0.0, 0.3, 0.9]), model, ref, step=0)
    with torch.no_grad():
        s_ref, _, _, _ = brute_force(ref, prompt_lists, ids, generated)
    torch.testing.assert_close(scores.kl_sums, s_brute.detach() - s_ref, atol=1e-5, rtol=1e-5)
    advantages = scores.advantages

    def step(batch, scores):
        m = copy.deepcopy(model)
        before = [p.detach().clone() for p in m.parameters()]
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        logps, sums, _, _ = train.policy_step(cfg, m, opt, sched, batch, scores)
        return (logps * scores.loss_mask).sum(-1), sums, torch.cat([(b - p.detach()).flatten() for b, p in zip(before, m.parameters())])

    seq, sums, minus_delta = step(batch, scores)
    torch.testing.assert_close(seq, s_brute.detach(), atol=1e-5, rtol=1e-5)
    assert float(sums["entropy"] / sums["tokens"]) == pytest.approx(float(entropy / count), rel=1e-5)
    assert int(sums["tokens"]) == count == sum(map(sum, generated))
    model.zero_grad()
    (-(advantages * s_brute).sum() / len(advantages)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(minus_delta, grad, atol=1e-6, rtol=1e-4)
    unmasked = copy.copy(batch)
    unmasked.generated_mask = None
    _, _, other = step(unmasked, train.score(cfg, unmasked, fixed_rewards([1.0, 0.0, 0.3, 0.9]), model, ref, 0))
    assert (other - grad).abs().max() > 1e-3


def test_environment_tokens_get_no_gradient():
    """The log-probs of the environment's tokens do not reach the loss: d loss / d log pi(o_t) is 0 at every
    environment token and nonzero at the model's."""
    model, _, _ = data.embedded_task(seed=0)
    batch, _, _, generated = trajectory_batch()
    logps, _, T, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
    logps.retain_grad()
    cfg = cfg_for(num_generations=2, beta=0.0, bf16=False)
    scores = train.score(cfg, batch, fixed_rewards([1.0, 0.0, 0.3, 0.9]), model, None, step=0)
    seq = (logps * scores.loss_mask[:, :T]).sum(-1)
    train.rloo_loss(seq, seq.detach(), scores.advantages, 0.2, 0.2, 4)[0].backward()
    mask = prompting.pad(generated, 0).bool()
    assert (logps.grad[~mask & batch.completion_mask.bool()] == 0).all()
    assert (logps.grad[mask].abs() > 0).all()


# ------------------------------------------------------------------------------------------------ the turn loop

def lookup_loop(cfg, make_env=environments.lookup_environment, max_length=64):
    model, tokenizer, dataset = data.embedded_task(seed=0)
    inner = rollout.DecodeLoop(cfg, model, tokenizer, None, CPU)
    eos_ids = prompting.eos_token_ids(tokenizer, model, cfg)
    return environments.MultiTurn(cfg, inner, make_env, tokenizer, eos_ids, max_length), model, dataset


def test_the_decode_loop_samples_each_turn_and_its_log_probs_are_the_trainers():
    """The lookup environment over our decode loop: prompts become "=", a model turn that ends in EOS gets the
    string back, the model's tokens are marked, and the sampler's log-probs of the model's tokens equal the
    trainer's forward over the whole trajectory (fp32, < 1e-4); the environment's are 0."""
    cfg = cfg_for(num_generations=4, max_completion_length=12, bf16=False)
    loop, model, dataset = lookup_loop(cfg)
    batch = loop.generate(dataset[:8], seed=3)
    assert batch.prompt_ids.shape == (32, 1) and (batch.prompt_ids == 1).all()  # "="
    assert batch.turn_stats["turns"].max() == 2 and batch.turn_stats["turns"].min() == 1
    for b, turns in enumerate(batch.turns):
        model_ids = batch.completion_ids[b][batch.model_tokens()[b].bool()].tolist()
        assert len(model_ids) <= 12
        if len(turns) == 3:  # asked, was told, answered
            target = dataset[:8]["target"][b // 4]
            assert turns[1] == {"role": "environment", "content": target + "="}
            env_ids = batch.completion_ids[b][(batch.completion_mask - batch.model_tokens())[b].bool()].tolist()
            assert env_ids == [int(c) + 2 for c in target] + [1]
    with torch.no_grad():
        logps = forward.batch_logps(model, batch, cfg)
    mask = batch.model_tokens().bool()
    assert (batch.sampler_logps[~mask] == 0).all()
    torch.testing.assert_close(batch.sampler_logps[mask], logps[mask], atol=1e-4, rtol=0)


class Replies:
    """Answers the model's first turn with `first` and its second with nothing (the model goes on after its own
    EOS), then ends."""
    def __init__(self, first):
        self.first, self.said = first, 0

    def step(self, text):
        self.said += 1
        return [self.first, ""][self.said - 1] if self.said < 3 else None, self.said >= 3


def own_tokens_fed(loop, model, num_trajectories):
    """Counts, per trajectory, its own tokens that the forwards of the loop's decode sessions feed the model (the
    new columns of the attention mask; not the padding, nor the columns a row waits in)."""
    fed, sessions = torch.zeros(num_trajectories, dtype=torch.long), []
    loop.generator.session = lambda rows: sessions.append(rollout.DecodeSession(loop.generator, rows)) or sessions[-1]

    def hook(module, args, kwargs):
        new = kwargs["attention_mask"][:, -kwargs["input_ids"].shape[1]:].sum(-1)
        session = sessions[-1]
        fed[[session.rows.start + i for i in session.members]] += new
    return fed, sessions, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_the_decode_loop_keeps_each_trajectorys_kv_cache_from_turn_to_turn():
    """Three turns over our decode loop: every token of a trajectory enters the model once however many turns it
    has (the last one, sampled, need not; after a reply of no tokens the model's EOS is fed again, its cached column
    hidden), and sessions of --generation_chunk_size 5 trajectories sample what one session does. The sampler's
    log-probs of the model's tokens are the trainer's (fp32, < 1e-4)."""
    cfg = cfg_for(num_generations=4, max_completion_length=40, bf16=False)
    loop, model, dataset = lookup_loop(cfg, lambda row: Replies(row["target"] + "="), max_length=128)
    fed, sessions, hook = own_tokens_fed(loop, model, 24)
    try:
        batch = loop.generate(dataset[:6], seed=3)
    finally:
        hook.remove()
    assert batch.turn_stats["turns"].max() == 3 and (batch.turn_stats["turns"] > 1).sum() > 4
    assert len(sessions[0].members) < 24  # the rows of trajectories that ended left the cache
    lengths = batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)
    again = (batch.turn_stats["turns"] == 3).long()  # had the empty reply
    assert (fed >= lengths - 1).all()
    finished = ~batch.truncated  # (a truncated row may have run past its budget, the tail cut)
    assert finished.sum() > 8 and (fed[finished] <= lengths[finished] + again[finished]).all()
    with torch.no_grad():
        logps = forward.batch_logps(model, batch, cfg)
    mask = batch.model_tokens().bool()
    torch.testing.assert_close(batch.sampler_logps[mask], logps[mask], atol=1e-4, rtol=0)
    loop.cfg = cfg_for(num_generations=4, max_completion_length=40, bf16=False, generation_chunk_size=5)
    sessions.clear()
    chunked = loop.generate(dataset[:6], seed=3)
    assert [len(s.rows) for s in sessions] == [5, 5, 5, 5, 4] and all(len(s.state.ids) <= 5 for s in sessions)
    assert torch.equal(chunked.completion_ids, batch.completion_ids) and chunked.turns == batch.turns
    torch.testing.assert_close(chunked.sampler_logps, batch.sampler_logps, atol=1e-5, rtol=0)


@pytest.mark.stack
def test_the_static_cache_grows_across_turns_and_samples_what_the_growing_one_does(monkeypatch):
    """The GPU path's static cache (fixed shapes, in 256-column steps) over turns whose replies take a trajectory
    past 256 columns: the buffers move to 512 columns and the samples equal those of the growing cache. With
    --compile_decode (its compilation left out here) the rows of ended trajectories stay and sit the turn out, so
    the batch keeps its shape; the samples are the same again."""
    loop, model, dataset = lookup_loop(None, lambda row: Replies("1234567890" * 26 + "="), max_length=400)
    monkeypatch.setattr(rollout, "decode_step", lambda model, cfg: model)
    rollouts, sessions = [], []
    for static, compile_decode in [(False, False), (True, False), (None, True)]:
        loop.cfg = loop.generator.cfg = cfg_for(num_generations=2, max_completion_length=12, bf16=False,
                                                compile_decode=compile_decode)
        loop.generator.session = lambda rows, static=static: sessions.append(
            rollout.DecodeSession(loop.generator, rows, static=static)) or sessions[-1]
        rollouts.append(loop.generate(dataset[:3], seed=0))
    turns = rollouts[0].turn_stats["turns"]
    assert turns.max() == 3 and turns.min() < 3 and rollouts[0].completion_ids.shape[1] > 256
    assert len(sessions[0].members) < 6 and len(sessions[2].members) == 6
    for session in sessions[1:]:
        assert session.state.ids.shape[1] == 512 and session.state.cache.layers[0].keys.shape[2] == 512
    for other in rollouts[1:]:
        assert torch.equal(other.completion_ids, rollouts[0].completion_ids)
        torch.testing.assert_close(other.sampler_logps, rollouts[0].sampler_logps, atol=1e-5, rtol=0)
    # the next generation decodes into the same kept caches, 256 columns then 512: a compiled step's CUDA graphs
    # would replay, not record again (the grown cache once replaced the kept 256-column one: moved)
    moved = rollout.STATIC_INPUTS_MOVED[0]
    again = loop.generate(dataset[:3], seed=0)
    assert rollout.STATIC_INPUTS_MOVED[0] == moved and torch.equal(again.completion_ids, rollouts[2].completion_ids)


def test_a_sliding_window_model_decodes_each_turn_afresh():
    """A cache that cannot keep a trajectory's columns across turns (sliding-window layers: the waiting columns
    would eat the window) falls back to decoding each turn from the whole trajectory; the log-probs stay the
    trainer's."""
    cfg = cfg_for(num_generations=2, max_completion_length=30, bf16=False)
    loop, model, dataset = lookup_loop(cfg, lambda row: Replies(row["target"] * 3 + "="), max_length=128)
    config = copy.deepcopy(model.config)
    config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 6
    model = loop.generator.model = type(model)(config)
    sessions = []
    loop.generator.session = lambda rows: sessions.append(rollout.DecodeSession(loop.generator, rows)) or sessions[-1]
    batch = loop.generate(dataset[:4], seed=2)
    assert not sessions[0].state.reusable() and batch.turn_stats["turns"].max() > 1
    with torch.no_grad():
        logps = forward.batch_logps(model, batch, cfg)
    mask = batch.model_tokens().bool()
    torch.testing.assert_close(batch.sampler_logps[mask], logps[mask], atol=1e-4, rtol=0)


def test_the_trajectory_bound_and_the_budget_end_an_environment_that_never_ends():
    """An environment that always answers: the model's budget ends each trajectory (truncated), and a trajectory
    bound stops it earlier, before a reply that would not fit."""
    class Chatty:
        def step(self, text):
            return "12=", False

    cfg = cfg_for(num_generations=2, max_completion_length=6, bf16=False)
    loop, _, dataset = lookup_loop(cfg, lambda row: Chatty())
    batch = loop.generate(dataset[:4], seed=0)
    assert batch.truncated.all() and (batch.model_tokens().sum(-1) <= 6).all()
    loop.max_length = 8
    batch = loop.generate(dataset[:4], seed=0)
    assert batch.truncated.all()
    lengths = batch.prompt_mask.sum(-1) + batch.completion_mask.sum(-1)
    assert (lengths <= 8).all()


def test_an_environment_that_fails_inside_a_trajectory_gives_an_error_turn_and_is_counted(capsys):
    """A step that raises or hangs past --environment_timeout ends that trajectory with an error turn the reward
    functions see; the count goes to environment/failure_frequency, and the first failure is one warning naming the
    line that raised (a bug would otherwise pass for a low reward). A step returning the wrong kind of reply is a
    bug: one line."""
    class Flaky:
        def __init__(self, row):
            self.fails = int(row["target"][0]) % 2

        def step(self, text):
            if self.fails:
                raise ValueError("no such room")
            return None, True

    class Hangs:
        def step(self, text):
            import time
            time.sleep(30)

    cfg = cfg_for(num_generations=2, max_completion_length=6, bf16=False, environment_timeout=0.3)
    loop, _, dataset = lookup_loop(cfg, Flaky)
    batch = loop.generate(dataset[:8], seed=0)
    expected = [int(t[0]) % 2 for t in dataset[:8]["target"] for _ in range(2)]
    ended = [not batch.truncated[b] for b in range(16)]  # only a turn that ended reaches the environment
    assert batch.turn_stats["env_failures"].tolist() == [float(e and x) for e, x in zip(ended, expected)]
    for b, turns in enumerate(batch.turns):
        if ended[b] and expected[b]:
            assert turns[-1] == {"role": "environment", "content": "error: step raised ValueError: no such room"}
    warned = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    line = inspect.getsourcelines(Flaky.step)[1] + 2
    assert len(warned) == 1 and f"ValueError: no such room ({__file__}, line {line})" in warned[0], warned
    loop.routes = {None: lambda row: Hangs()}
    batch = loop.generate(dataset[:2], seed=0)
    assert any("did not return within --environment_timeout 0.3 s" in t[-1]["content"] for t in batch.turns)
    loop.routes[None] = lambda row: type("Bad", (), {"step": lambda self, text: "just a string"})()
    with pytest.raises(SystemExit, match=r"step must return \(reply, done\) with reply a string"):
        loop.generate(dataset[:2], seed=0)


def test_a_conversational_reply_is_the_chat_templates_rendering(smollm2_dir):
    """On SmolLM2's chat template: prompt + the model's turn (its own tokens, ending in <|im_end|>) + the
    environment's tokens equal the template's tokenization of the whole conversation with the next generation
    prompt: the environment tokens are exactly what the template adds after the model's EOS."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    cfg = cfg_for(num_generations=2)
    loop = environments.MultiTurn(cfg, None, None, tokenizer, [tokenizer.eos_token_id], 2048)
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    (prompt_ids,) = prompting.tokenize_prompts(tokenizer, [prompt])
    text = "Let me check with the calculator."
    model_ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    t = environments.Trajectory(None, prompt, prompt_ids, 100)
    t.turns.append({"role": "assistant", "content": text})
    reply = [{"role": "user", "content": "The calculator says 5."}]
    env_ids = loop.reply_ids(t, text, reply, model_ids[-1])
    whole = tokenizer.apply_chat_template(prompt + t.turns + reply, add_generation_prompt=True, tokenize=False)
    assert prompt_ids + model_ids + env_ids == tokenizer(whole, add_special_tokens=False).input_ids


def test_an_environment_file_that_does_not_load_is_one_line(tmp_path):
    broken = tmp_path / "env.py"
    broken.write_text("def make_env(row):\n    return 1 +\n")
    for spec, message in [(f"{broken}:make_env", "cannot load environment file"),
                          (f"{tmp_path}/none.py:make_env", "does not exist"),
                          ("lookupp", "give FILE.py:FACTORY or one of ['lookup', 'lookup_scored']")]:
        out = in_process(["--environment", spec, "--max_steps", "1"])
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_the_embedded_lookup_task_learns_what_one_turn_cannot(tmp_path):
    """`python train.py --environment lookup`: the string is shown only in answer to the model's first turn, so a
    single turn can only guess (reward about 0.05); the multi-turn policy learns to ask and copy."""
    # measured: 0.04 at step 10, 0.47 at 230, 0.75 at 290, 0.90 at 350; 500 steps (the default) reach 0.95
    out = in_process(["--environment", "lookup", "--max_steps", "300", "--logging_steps", "10", "--output_dir",
                      str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path)
    first, last = metrics[0], metrics[-1]
    assert first["reward"] < 0.1 and last["reward"] > 0.5, (first["reward"], last["reward"])
    assert last["turns/mean"] > 1.9 and 0 < last["completions/environment_token_fraction"] < 1


# ------------------------------------------------------------------------------------------------ tools

CALCULATOR = (ROOT / "tests" / "data" / "calculator.py").read_text()


class ScriptedPolicy:
    """Writes the given turns, in order, for every trajectory, as token ids ending in <|im_end|>, through
    rollout.finish as every backend does: the policy is scripted so that the tool loop's own code (parsing,
    calling, rendering, masking, counting) is what runs."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.calls, self.device = tokenizer, turns, 0, CPU
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, rows, seed=None, cfg=None):
        text = self.turns[min(self.calls, len(self.turns) - 1)]
        self.calls += 1
        ids = [self.tokenizer(text, add_special_tokens=False).input_ids + [self.eos]] * len(rows["prompt"])
        prompt_ids, prompt_mask = prompting.prompt_tensors(rows["prompt"], self.tokenizer.pad_token_id, 1, CPU)
        return rollout.finish(rows, prompt_ids, prompt_mask, prompting.pad(ids, 0), None, [self.eos], self.tokenizer)


def tool_loop(smollm2_dir, tmp_path, turns, max_tool_calls=10):
    from transformers import AutoTokenizer

    from chat_templates import QWEN2_5
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokenizer.chat_template = QWEN2_5
    (tmp_path / "calc.py").write_text(CALCULATOR)
    cfg = environments.with_tools(cfg_for(num_generations=2, max_completion_length=200,
                                          tools=f"{tmp_path / 'calc.py'}:calculator", max_tool_calls=max_tool_calls))
    policy = ScriptedPolicy(tokenizer, turns)
    loop = environments.multi_turn(cfg, policy, tokenizer, None, [policy.eos], 2048)
    rows = {"prompt": [[{"role": "user", "content": "What is 2 + 3?"}]]}
    return loop.generate(rows, seed=0), tokenizer, cfg, rows


def call(expression):
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression


def test_a_tool_call_is_run_and_its_result_rendered_by_the_template(smollm2_dir, tmp_path):
    """Qwen2.5's format: the call is parsed from the model's turn, run, and its result enters as the template's
    tool message; the trajectory's tokens are exactly the template's rendering of the conversation (tools in the
    system prompt), the model's tokens marked, the tool's not; tools/call_frequency counts the call."""
    batch, tokenizer, cfg, rows = tool_loop(smollm2_dir, tmp_path, [call("2 + 3"), "The answer is 5."])
    turns = batch.turns[0]
    assert [m["role"] for m in turns] == ["assistant", "tool", "assistant"]
    assert turns[1]["content"] == "5" and turns[2]["content"] == "The answer is 5."
    assert batch.turn_stats["tool_calls"].tolist() == [1.0, 1.0] and batch.turn_stats["tool_failures"].sum() == 0
    whole = tokenizer.apply_chat_template(rows["prompt"][0] + turns, tokenize=False,
                                          **cfg.chat_template_kwargs)  # the last turn closed: "<|im_end|>\n"
    ids = batch.prompt_ids[0][batch.prompt_mask[0].bool()].tolist() + batch.completion_ids[0].tolist()
    assert tokenizer.decode(ids) == whole.removesuffix("\n")
    assert '"name": "calculator"' in tokenizer.decode(batch.prompt_ids[0])  # the schema is in the prompt
    env_text = tokenizer.decode(batch.completion_ids[0][(batch.completion_mask - batch.model_tokens())[0].bool()])
    assert env_text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_failed_and_malformed_tool_calls_are_error_results_the_model_reads(smollm2_dir, tmp_path):
    """A tool that raises and a call that is not JSON each become a tool message with the error, counted in
    tool_failures; past --max_tool_calls the trajectory ends."""
    bad_json = "<tool_call>\n{not json}\n</tool_call>"
    batch, *_ = tool_loop(smollm2_dir, tmp_path, [call("1 / 0"), bad_json, call("1 + 1")], max_tool_calls=2)
    turns = batch.turns[0]
    assert [m["role"] for m in turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "ZeroDivisionError" in turns[1]["content"] and turns[3]["content"].startswith("error")
    assert batch.turn_stats["tool_calls"].tolist() == [2.0, 2.0]
    assert batch.turn_stats["tool_failures"].tolist() == [2.0, 2.0]
    assert not batch.truncated.any()


def test_a_template_without_tools_and_a_tool_without_hints_are_one_line(smollm2_dir, tmp_path):
    (tmp_path / "calc.py").write_text(CALCULATOR + "\ndef untyped(x):\n    '''No hints.'''\n    return x\n")
    data_file = tmp_path / "data.jsonl"
    data_file.write_text('{"prompt": [{"role": "user", "content": "2 + 3?"}]}\n' * 8)
    base = ["--model", str(smollm2_dir), "--dataset", str(data_file), "--reward_funcs", "think_format_reward",
            "--max_steps", "1"]
    out = in_process(base + ["--tools", f"{tmp_path / 'calc.py'}:untyped"])
    assert out.returncode != 0 and "untyped" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    out = in_process(base + ["--tools", f"{tmp_path / 'calc.py'}:calculator"])  # SmolLM2's template has no tools
    assert out.returncode != 0 and "tool" in out.stderr.splitlines()[-1] and "Traceback" not in out.stderr, \
        out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ every backend

THREE_TURNS = '''
import json, os

class Again:
    """Answers the model's first two turns, so every trajectory has three model turns."""
    def __init__(self, row):
        self.turn = 0

    def step(self, text):
        self.turn += 1
        return ([{"role": "user", "content": f"again {self.turn}"}], False) if self.turn < 3 else (None, True)

def make_env(row):
    return Again(row)

def record(completions, **kwargs):
    with open(os.environ["TRAJECTORIES"], "a") as f:
        f.write(json.dumps(completions) + "\\n")
    return [float(len(c[-1]["content"])) for c in completions]
'''


@requires_vllm
def test_vllm_colocated_and_server_give_the_decode_loops_trajectories(tmp_path, chat_model_dir, vllm_server):
    """The greedy policy (top_k 1; min_tokens 2 and a bias on <|im_end|> make each turn two tokens and EOS) over
    three turns: our decode loop, a colocated engine and a server write the same conversations token for token,
    since every turn continues from the trajectory's own token ids. Then --async_generation on the server, with
    plain sampling (turns end at stop ids, which keep the log-probs exact): the engine's log-probs of the model's
    tokens are the trainer's."""
    from transformers import AutoTokenizer
    eos = AutoTokenizer.from_pretrained(chat_model_dir).convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "env.py").write_text(THREE_TURNS)
    data_file = tmp_path / "data.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}?"}]}) + "\n"
                                 for i in range(4)))
    base = ["--model", str(chat_model_dir), "--dataset", str(data_file), "--environment", f"{tmp_path}/env.py:make_env",
            "--reward_funcs", f"{tmp_path}/env.py:record", "--top_k", "1", "--generation_kwargs",
            json.dumps({"min_tokens": 2, "logit_bias": {str(eos): 30.0}}), "--max_completion_length", "24",
            "--num_generations", "2", "--per_device_train_batch_size", "8", "--bf16", "false", "--max_steps", "1",
            "--shuffle_dataset", "false"]
    server = ["--use_vllm", "--vllm_mode", "server", "--vllm_server_port", str(vllm_server)]
    seen = {}
    for name, flags in [("decode", []), ("colocate", ["--use_vllm"]), ("server", server)]:
        log = tmp_path / f"{name}.jsonl"
        out = run(base + flags + ["--output_dir", str(tmp_path / name)], env={"TRAJECTORIES": str(log)})
        assert out.returncode == 0, (name, out.stderr[-3000:])
        seen[name] = json.loads(log.read_text().splitlines()[0])
    first = seen["decode"]
    assert len(first) == 8 and all([m["role"] for m in c] == ["assistant", "user"] * 2 + ["assistant"] for c in first)
    assert all(len(m["content"]) == 2 for c in first for m in c if m["role"] == "assistant")
    for name in ("colocate", "server"):
        assert seen[name] == first, name
    stops = AutoTokenizer.from_pretrained(chat_model_dir).convert_tokens_to_ids(list("aeiou0123456789 "))
    plain = list(base)
    del plain[plain.index("--top_k"):plain.index("--top_k") + 2]
    plain[plain.index("--generation_kwargs") + 1] = json.dumps({"stop_token_ids": stops})
    plain[plain.index("--max_steps") + 1] = "2"
    out = run(plain + server + ["--async_generation", "--logging_steps", "1", "--output_dir", str(tmp_path / "async")],
              env={"TRAJECTORIES": str(tmp_path / "async.jsonl")})
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "async")
    assert len(metrics) == 2 and all(m["turns/mean"] > 1.5 for m in metrics)
    # step 1 trains on samples of the weights it starts from (later ones: one step stale, by design)
    assert metrics[0]["sampling/sampling_logp_difference/mean"] < 1e-4


@requires_vllm
def test_a_colocated_engines_log_probs_of_model_tokens_are_the_trainers(tmp_path):
    """The lookup task on a colocated engine (plain sampling, fp32): the engine's log-probs of the model's tokens
    over two-turn trajectories equal the trainer's forward over the whole trajectory (sampler drift < 1e-4 a
    token), the environment's tokens leaving the sums."""
    out = run(["--environment", "lookup", "--use_vllm", "--max_steps", "2", "--logging_steps", "1",
               "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    for m in read_metrics(tmp_path):
        assert m["sampling/sampling_logp_difference/mean"] < 1e-4 and m["turns/mean"] > 1.2


@pytest.mark.slow
def test_a_real_model_calls_a_tool_and_reads_its_result(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct's own template has no tools; --chat_template_path gives it Qwen2.5's (ChatML too). With
    three worked examples in each prompt (tests/data/multiply_tools.jsonl, the README's example) the model writes
    <tool_call> blocks: at temperature 0.7 most of 8 trajectories call the calculator, the results come back as tool
    tokens (context, not the model's), and some final answers are right; the step trains."""
    from chat_templates import QWEN2_5
    (tmp_path / "qwen.jinja").write_text(QWEN2_5)
    (tmp_path / "calc.py").write_text(CALCULATOR)
    data_file = tmp_path / "data.jsonl"
    with open(ROOT / "tests" / "data" / "multiply_tools.jsonl") as f:
        data_file.write_text("".join(f.readlines()[:4]))
    out = in_process(["--model", str(smollm2_dir), "--dataset", str(data_file), "--reward_funcs", "last_number_reward",
               "--chat_template_path", str(tmp_path / "qwen.jinja"), "--tools", f"{tmp_path / 'calc.py'}:calculator",
               "--max_completion_length", "40", "--num_generations", "2", "--per_device_train_batch_size", "8",
               "--temperature", "0.7", "--beta", "0", "--max_steps", "1", "--bf16", "false", "--logging_steps", "1",
               "--save_strategy", "no", "--output_dir", str(tmp_path / "run")])
    assert out.returncode == 0, out.stderr[-3000:]
    (m,) = read_metrics(tmp_path / "run")
    assert m["tools/call_frequency"] > 0.25 and m["tools/failure_frequency"] < 0.5 and m["turns/mean"] > 1.2
    assert m["completions/environment_token_fraction"] > 0 and m["reward"] > 0
    assert m["completions/mean_length"] <= 40
