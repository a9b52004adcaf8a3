"""What a TRL user brings: mixture-of-experts models (the router's load-balancing loss, LoRA on fused experts), reward
functions that use TRL's trainer_state / log_extra / log_metric, generation_kwargs, named eval sets, mini-batches of
one generated batch (steps_per_generation), the KL estimator, and the smaller RLOOConfig fields."""

import copy
import dataclasses
import glob
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import rewards
import rollout
import train
from options import evaluation, lora
from plumbing import checks, config, models, schedule
from step import batches, data, forward, metrics, sampler, sampler_rules
from test_train import cfg_for, read_metrics, run

CPU = torch.device("cpu")
EMBEDDED_VOCAB = 12  # the embedded task's character tokenizer


def tiny_moe(kind, vocab=EMBEDDED_VOCAB, seed=0):
    """A two-layer mixture-of-experts model (4 experts, 2 per token) built from a config, random weights."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=1, num_key_value_heads=1,
                  head_dim=64, num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=0, pad_token_id=0,
                  bos_token_id=0)
    if kind == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                                  **common))
    return GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=4, sliding_window=8,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                          **common))


def random_batch(B, prompt_len, T, vocab, seed=0):
    """A hand-built Rollout without padding: every prompt and completion full length."""
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(1, vocab, (B, T), generator=g)
    return batches.Rollout(rows={"prompt": ["x"] * (B // 2)}, prompt_ids=torch.randint(1, vocab, (B, prompt_len), generator=g),
                           prompt_mask=torch.ones(B, prompt_len, dtype=torch.long), completion_ids=completion_ids,
                           completion_mask=torch.ones(B, T, dtype=torch.long), truncated=torch.ones(B, dtype=torch.bool),
                           completion_lists=completion_ids.tolist(), texts=[""] * B)


def router_weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp.gate." in n or ".mlp.router." in n}


# ------------------------------------------------------------------------------------------------ MoE

@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_router_load_balancing_loss_enters_the_loss_and_moves_the_router(kind):
    """With every advantage 0 the policy term has no gradient, so one SGD step (lr 1, no clipping) moves the router
    by exactly -coef * d aux / dW, aux each micro-batch's load-balancing loss (transformers' own, from the model's
    router logits) weighted by its share of the step; loss and aux_loss are logged as TRL logs them. Coefficient 0:
    nothing moves and nothing is logged."""
    model = tiny_moe(kind)
    cfg = cfg_for(per_device_train_batch_size=2, num_generations=2, bf16=False)
    batch = random_batch(4, 3, 5, EMBEDDED_VOCAB)
    scores = train.Scores(None, None, batch.completion_mask.float(), torch.zeros(4))
    coef = model.config.router_aux_loss_coef
    assert coef == 0.001 and models.router_aux_coef(cfg, model) == coef  # the model config's default
    cfg.router_aux_loss_coef = coef = 0.5  # large enough to move the router visibly

    expected = copy.deepcopy(model)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    auxes = [expected(input_ids=ids[mb], output_router_logits=True).aux_loss for mb in (slice(0, 2), slice(2, 4))]
    (coef * sum(a * 2 / 4 for a in auxes)).backward()
    before = router_weights(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cfg.max_grad_norm = 0.0
    _, sums, _, _ = train.policy_step(cfg, model, optimizer, scheduler, batch, scores)
    step = metrics.step_metrics({k: float(v) for k, v in sums.items()}, torch.tensor(1.0), scheduler, {"time/training": 1.0}, 1)
    mean_aux = sum(a.item() for a in auxes) / 2
    assert step["aux_loss"] == pytest.approx(mean_aux, rel=1e-5) and step["loss"] == pytest.approx(coef * mean_aux, rel=1e-5)
    expected_params = dict(expected.named_parameters())
    for name, old in before.items():
        torch.testing.assert_close(router_weights(model)[name] - old, -expected_params[name].grad, atol=1e-6, rtol=1e-4)
        assert expected_params[name].grad.abs().max() > 1e-4  # the gradient does reach the router

    cfg.router_aux_loss_coef = 0.0
    before = router_weights(model)
    _, sums, _, _ = train.policy_step(cfg, model, optimizer, scheduler, batch, scores)
    assert "aux_loss" not in sums
    assert all(torch.equal(router_weights(model)[n], p) for n, p in before.items())


def test_router_loss_coefficient_on_a_model_without_one_is_one_line():
    model, _, _ = data.embedded_task(seed=0)
    assert models.router_aux_coef(cfg_for(), model) == 0.0
    with pytest.raises(SystemExit, match="computes no router load-balancing loss; drop the flag"):
        models.router_aux_coef(cfg_for(router_aux_loss_coef=0.1), model)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """Tiny Qwen3-MoE and GPT-OSS models with the embedded task's tokenizer, and the task's prompts as files."""
    root = tmp_path_factory.mktemp("moe")
    _, tokenizer, dataset = data.embedded_task(seed=0)
    dirs = {}
    for kind in ("qwen3_moe", "gpt_oss"):
        tiny_moe(kind).save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        dirs[kind] = root / kind
    dataset.select(range(64)).to_json(root / "train.jsonl")
    dataset.select(range(64, 72)).to_json(root / "held.jsonl")
    dataset.select(range(72, 76)).to_json(root / "other.jsonl")
    return dirs, root


def test_moe_run_logs_aux_loss_and_evaluates_named_sets(moe_dirs, tmp_path):
    """End to end on a Qwen3-MoE from a local directory: aux_loss in every step's metrics; two named eval sets
    (--eval_dataset NAME=SOURCE) each with its own prefixed metrics, eval_<name>_loss and eval_<name>_aux_loss."""
    dirs, root = moe_dirs
    out = run(["--model", str(dirs["qwen3_moe"]), "--dataset", str(root / "train.jsonl"), "--reward_funcs", "task_reward",
               "--bf16", "false", "--max_steps", "2", "--logging_steps", "1", "--eval_steps", "2",
               "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "5",
               "--learning_rate", "1e-3", "--eval_dataset", f"held={root / 'held.jsonl'}", f"other={root / 'other.jsonl'}",
               "--num_generations_eval", "2", "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = read_metrics(tmp_path)
    train_lines = [m for m in lines if "loss" in m]
    assert len(train_lines) == 2 and all(0 < m["aux_loss"] < 10 for m in train_lines)
    (evaluated,) = [m for m in lines if "eval_held_reward" in m]
    for name in ("held", "other"):
        assert 0 <= evaluated[f"eval_{name}_reward"] <= 1
        assert 0 < evaluated[f"eval_{name}_aux_loss"] < 10
        # leave-one-out advantages sum to 0 in each group: the loss at rho = 1 is coef * aux_loss
        assert evaluated[f"eval_{name}_loss"] == pytest.approx(0.001 * evaluated[f"eval_{name}_aux_loss"], abs=1e-5)
    assert not any(k.startswith("eval_reward") for k in evaluated)


def test_lora_on_gpt_oss_experts_trains_the_adapter_only(moe_dirs, tmp_path):
    """TRL's test_train_moe_peft_model: LoRA on GPT-OSS's fused experts (peft's target_parameters), lr 0.1. The base
    weights stay as they were, every adapter weight moves, the reference (adapter off) is the base, and the saved
    model is the merged one, as peft's merge_and_unload makes it."""
    dirs, root = moe_dirs
    base = AutoModelForCausalLM.from_pretrained(dirs["gpt_oss"])
    cfg = cfg_for(use_peft=True, lora_target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                  lora_target_modules=["q_proj"], per_device_train_batch_size=4, num_generations=2, bf16=False,
                  max_completion_length=4)
    model = lora.add_adapter(copy.deepcopy(base), lora.settings(cfg))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    _, tokenizer, dataset = data.embedded_task(seed=0)
    for step in range(2):
        batch = rollout.generate(model, tokenizer, dataset[:2], cfg, CPU, seed=step)
        scores = train.Scores(None, None, batch.completion_mask.float(), torch.tensor([1.0, -1.0, 0.5, -0.5]))
        train.policy_step(cfg, model, optimizer, scheduler, batch, scores)
    after = dict(model.named_parameters())
    adapter = [n for n in before if "lora_" in n]
    assert any("experts.lora_A" in n for n in adapter) and any("experts.base_layer.lora_B" in n for n in adapter)
    assert all(not torch.equal(before[n], after[n]) for n in adapter)
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)
    with torch.no_grad(), lora.reference(model, None) as reference:
        off = reference(batch.prompt_ids).logits
    torch.testing.assert_close(off, base(batch.prompt_ids).logits)
    merged = dict(lora.hf_weights(((n, t.detach()) for n, t in model.state_dict().items()), model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    for name in want:
        torch.testing.assert_close(merged[name], want[name], atol=1e-6, rtol=1e-5)
    assert not torch.equal(merged["model.layers.0.mlp.experts.down_proj"], base.state_dict()["model.layers.0.mlp.experts.down_proj"])

    out = run(["--model", str(dirs["gpt_oss"]), "--dataset", str(root / "train.jsonl"), "--reward_funcs", "task_reward",
               "--bf16", "false", "--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "8",
               "--num_generations", "4", "--max_completion_length", "4", "--learning_rate", "0.1", "--use_peft",
               "--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
               "--output_dir", str(tmp_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert all("aux_loss" in m for m in read_metrics(tmp_path))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert not torch.equal(saved["model.layers.0.mlp.experts.gate_up_proj"],
                           base.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])
    assert os.path.exists(tmp_path / "adapter" / "adapter_config.json")


@pytest.mark.parametrize("settings", [
    dict(target_modules="all-linear", use_dora=True),
    dict(target_modules="all-linear", use_rslora=True, modules_to_save=["lm_head"]),
    dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
         modules_to_save=["gate"]),
], ids=["dora", "rslora+modules_to_save", "qwen3-moe-experts+router"])
def test_merged_weights_equal_peft_merge_and_unload(settings):
    """What vLLM and the saved model get (lora.hf_weights, streamed from the state dict) is peft's own merge, for
    DoRA, rsLoRA, a module trained in full, and experts with a router trained beside them."""
    base = tiny_moe("qwen3_moe") if "target_parameters" in settings else data.embedded_task(seed=0)[0]
    torch.manual_seed(1)
    model = lora.add_adapter(base, dict(r=4, lora_alpha=8, lora_dropout=0.0, **settings))
    with torch.no_grad():  # a trained adapter: B, the magnitudes and the saved modules away from their start
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    merged = dict(lora.hf_weights(state.items(), model))
    want = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    for name in want:
        torch.testing.assert_close(merged[name], want[name], atol=1e-6, rtol=1e-5)
    unmerged = {lora.hf_name(n): t for n, t in state.items() if "lora_" not in n and "modules_to_save" not in n}
    assert any(not torch.equal(merged[n], unmerged[n]) for n in merged if n in unmerged)


# ------------------------------------------------------------------------------------------------ reward kwargs

TRL_REWARDS = '''
import os


def reward_func_accessing_trainer_state(completions, **kwargs):  # TRL's test_train_with_reward_func_accessing_trainer_state
    trainer_state = kwargs.get("trainer_state")
    assert trainer_state is not None
    # transformers.TrainerState instance should have a `global_step` property.
    assert hasattr(trainer_state, "global_step")
    with open(os.environ["STATE_LOG"], "a") as f:
        f.write(f"{trainer_state.global_step} {trainer_state.max_steps} {trainer_state.epoch}\\n")
    return [float(len(set(completion))) for completion in completions]


def reward_func_with_log_extra(completions, **kwargs):  # TRL's test_train_reward_func_with_log_extra
    log_extra = kwargs.get("log_extra")
    assert log_extra is not None
    log_extra("test_column", [completion[:5] for completion in completions])
    return [float(len(completion)) for completion in completions]


def reward_func_with_log_metric(completions, **kwargs):  # TRL's test_train_reward_func_with_log_metric
    log_metric = kwargs.get("log_metric")
    assert log_metric is not None
    log_metric("custom_accuracy", 0.75)
    return [float(len(completion)) for completion in completions]


def rank_dependent_metric(completions, **kwargs):
    """rank 0 logs 1.0 twice, rank 1 logs 4.0 once and a name rank 0 never logs."""
    if int(os.environ.get("RANK", 0)) == 0:
        kwargs["log_metric"]("per_call", 1.0)
        kwargs["log_metric"]("per_call", 1.0)
    else:
        kwargs["log_metric"]("per_call", 4.0)
        kwargs["log_metric"]("only_rank_1", 7.0)
    return [0.0] * len(completions)
'''


@pytest.fixture
def trl_rewards(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return path


def test_trl_reward_functions_with_trainer_state_log_extra_and_log_metric_run_unchanged(trl_rewards, tmp_path):
    """TRL's own three reward functions: trainer_state has global_step (and max_steps, epoch), log_extra's column
    is in the printed completions and the wandb table, log_metric's value is in metrics.jsonl (TRL:
    log_history). One run also shows --log_unique_prompts (one table row per prompt), --num_completions_to_print
    and --report_to tensorboard beside wandb."""
    names = ["reward_func_accessing_trainer_state", "reward_func_with_log_extra", "reward_func_with_log_metric"]
    out = run(["--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations",
               "4", "--reward_funcs", "task_reward", *[f"{trl_rewards}:{n}" for n in names], "--log_completions",
               "--num_completions_to_print", "2", "--log_unique_prompts", "--report_to", "wandb", "tensorboard",
               "--output_dir", str(tmp_path / "run")],
              env={"STATE_LOG": str(tmp_path / "state.log"), "WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert out.returncode == 0, out.stderr[-3000:]
    logged = read_metrics(tmp_path / "run")
    assert [m["custom_accuracy"] for m in logged] == [0.75] * 3
    states = [line.split() for line in (tmp_path / "state.log").read_text().splitlines()]
    assert [int(s[0]) for s in states] == [0, 1, 2] and {s[1] for s in states} == {"3"}
    # epoch: 4 prompts a step over the embedded task's 4096, in trainer_state and as the Trainer logs it
    assert [float(s[2]) for s in states] == pytest.approx([0, 4 / 4096, 8 / 4096])
    assert [m["epoch"] for m in logged] == pytest.approx([4 / 4096, 8 / 4096, 12 / 4096])
    printed = [line for line in out.stdout.splitlines() if line.startswith("  step=")]
    assert len(printed) == 3 * 2 and all("test_column=" in line for line in printed)
    tables = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json")))
    table = json.load(open(tables[0]))
    assert table["columns"] == ["step", "prompt", "completion", "task_reward", *names, "test_column", "advantage"]
    assert len(table["data"]) == 4 and len({row[1] for row in table["data"]}) == 4  # 16 completions of 4 prompts
    assert all(row[7] == row[2][:5] for row in table["data"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (events,) = glob.glob(str(tmp_path / "run" / "runs" / "events.out.tfevents.*"))
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    rewards_seen = [e.value for e in accumulator.Scalars("reward")]
    assert rewards_seen == pytest.approx([m["reward"] for m in logged], rel=1e-6)
    assert [e.step for e in accumulator.Scalars("custom_accuracy")] == [1, 2, 3]


@pytest.mark.slow
def test_log_metric_is_the_mean_over_every_call_on_every_rank(trl_rewards, tmp_path):
    """Two processes: rank 0 logs 1.0 twice, rank 1 logs 4.0 once (and a name rank 0 never logs): per_call is
    (1 + 1 + 4) / 3 = 2, only_rank_1 is 7, and the run does not hang on the name only one rank knows."""
    out = run(["--max_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "8", "--num_generations",
               "4", "--reward_funcs", "task_reward", f"{trl_rewards}:rank_dependent_metric",
               "--output_dir", str(tmp_path)], torchrun=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [(m["per_call"], m["only_rank_1"]) for m in read_metrics(tmp_path)] == [(2.0, 7.0)] * 2


def test_log_extra_columns_follow_their_completions_through_dynamic_sampling():
    """A Rollout keeps what reward functions logged: take() keeps the chosen completions' values, concat() joins
    parts (None where a part's functions did not log a column), log_metric's values accumulate."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    cfg = cfg_for(num_generations=2, max_completion_length=3)
    first = rollout.generate(model, tokenizer, dataset[:2], cfg, CPU, seed=0)
    second = rollout.generate(model, tokenizer, dataset[2:3], cfg, CPU, seed=1)

    def tag(completions, log_extra, log_metric, **kwargs):
        log_extra("index", list(range(len(completions))))
        log_metric("calls", 1.0)
        return [0.0] * len(completions)

    R = rewards.RewardFunctions([tag])
    R(first, 2, step=0)
    assert first.logged_columns == {"index": [0, 1, 2, 3]} and first.logged_metrics == {"calls": [1.0]}
    picked = first.take([2, 3])
    assert picked.logged_columns == {"index": [2, 3]}
    joined = batches.concat([picked, second], tokenizer.pad_token_id)
    assert joined.logged_columns == {"index": [2, 3, None, None]}

    def wrong_length(completions, log_extra, **kwargs):
        log_extra("short", [1])
        return [0.0] * len(completions)

    with pytest.raises(SystemExit, match="log_extra\\('short', ...\\) got 1 values for 4 completions"):
        rewards.RewardFunctions([wrong_length])(first, 2, step=0)


def test_trainer_state_has_the_run_schedule():
    R = rewards.RewardFunctions([], cfg=cfg_for())
    R.max_steps, R.epoch = 40, 1.5
    state = R.trainer_state(30)
    assert (state.global_step, state.max_steps, state.epoch, state.is_world_process_zero) == (30, 40, 1.5, True)


# ------------------------------------------------------------------------------------------------ generation_kwargs

def test_generation_kwargs_shape_what_is_sampled_and_keep_the_log_probs_of_the_policy():
    """Each accepted option reaches our decode loop: allowed_token_ids bounds the tokens, bad_words_ids (and
    bad_words, tokenized as vLLM does) never complete, logit_bias -100 removes a token; the recorded log-probs stay
    log softmax(z / T) of the unmodified logits, equal to the training forward's."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    eos = tokenizer.eos_token_id
    cases = {
        "allowed_token_ids": ({"allowed_token_ids": digits[:3] + [eos]},
                              lambda ids: set(ids) <= set(digits[:3] + [eos])),
        "bad_words_ids": ({"bad_words_ids": [[digits[1], digits[2]], [digits[7]]]},
                          lambda ids: digits[7] not in ids and not any(a == digits[1] and b == digits[2]
                                                                      for a, b in zip(ids, ids[1:]))),
        "bad_words": ({"bad_words": ["12", "7"]},
                      lambda ids: digits[7] not in ids and "12" not in tokenizer.decode(ids)),
        "logit_bias": ({"logit_bias": {str(d): -100.0 for d in digits[4:]}},
                       lambda ids: not set(ids) & set(digits[4:])),
    }
    for name, (options, holds) in cases.items():
        cfg = config.parse_config(["--num_generations", "16", "--max_completion_length", "6", "--temperature", "1.5",
                                   "--generation_kwargs", json.dumps(options)])
        batch = rollout.generate(model, tokenizer, dataset[:4], cfg, CPU, seed=0)
        assert all(holds(ids) for ids in batch.completion_lists), name
        with torch.no_grad():
            logps, _, T, *_ = forward.forward_logps(model, batch, slice(None), cfg.temperature)
        mask = batch.completion_mask[:, :T].bool()
        torch.testing.assert_close(batch.sampler_logps[:, :T][mask], logps[mask], atol=1e-5, rtol=0)
    plain = config.parse_config(["--num_generations", "16", "--max_completion_length", "6"])
    unconstrained = rollout.generate(model, tokenizer, dataset[:4], plain, CPU, seed=0).completion_lists
    assert any(digits[7] in ids for ids in unconstrained)  # the constraints above did bind


def test_generation_kwargs_flags_aliases_and_vllm_sampling_params():
    """Keys that are flags set them (generation_kwargs wins, as in TRL), aliases are renamed, and every option
    reaches vLLM's SamplingParams (bad words as vLLM's own ids in a colocated engine); then vLLM's processed
    log-probs are no longer log pi_T, so the KL's old log-probs come from a forward."""
    cfg = config.parse_config(["--use_vllm", "--generation_kwargs", json.dumps(
        {"top_k": 5, "max_new_tokens": 7, "min_new_tokens": 2, "logit_bias": {"3": -2.5}, "bad_words": ["ab"],
         "bad_words_ids": [[4, 5]], "allowed_token_ids": [1, 2, 3], "do_sample": True})])
    assert (cfg.top_k, cfg.max_completion_length) == (5, 7)
    assert cfg.generation_kwargs == {"min_tokens": 2, "logit_bias": {3: -2.5}, "bad_words": ["ab"],
                                     "bad_words_ids": [[4, 5]], "allowed_token_ids": [1, 2, 3]}
    from options import vllm_rollout
    sampling = vllm_rollout.vllm_sampling(cfg, [0], logprobs=True)
    assert sampling["top_k"] == 5 and sampling["max_tokens"] == 7 and sampling["min_tokens"] == 2
    assert sampling["logit_bias"] == {3: -2.5} and sampling["allowed_token_ids"] == [1, 2, 3]
    for key in ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens"):
        only = dataclasses.replace(cfg, top_k=0, generation_kwargs={key: cfg.generation_kwargs[key]})
        assert not sampler_rules.sampler_logps_exact(dataclasses.replace(only, temperature=0.7)), key
    assert sampler_rules.sampler_logps_exact(dataclasses.replace(cfg, top_k=0, generation_kwargs={"stop_token_ids": [1]},
                                                          temperature=0.7))
    _, tokenizer, _ = data.embedded_task(seed=0)
    converted = sampler.with_bad_word_ids(cfg, tokenizer).generation_kwargs
    assert "bad_words" not in converted and converted["bad_words_ids"][0] == [4, 5]


# ------------------------------------------------------------------------------------------------ batch geometry

def test_steps_per_generation_splits_a_batch_into_optimizer_steps_against_the_sampling_policy():
    """steps_per_generation = 4 micro-batches with gradient_accumulation_steps = 2: one generated batch of 16 feeds
    two optimizer steps of 8 (times num_iterations). Every step's s_old is the sampling weights' sequence log-prob:
    the first mini-batch is on-policy (rho = 1), the second is not (the first step moved the weights)."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    cfg = cfg_for(num_generations=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  steps_per_generation=4, max_completion_length=4, beta=0.0, num_iterations=2)
    assert data.prompts_per_rank(cfg) == 4 and schedule.steps_per_batch(cfg) == 4
    batch = rollout.generate(model, tokenizer, dataset[:4], cfg, CPU, seed=0)
    scores = train.Scores(None, None, batch.completion_mask.float(), torch.linspace(-1, 1, 16))
    with torch.no_grad():
        sampling = (forward.forward_logps(model, batch, slice(None), 1.0)[0] * scores.loss_mask).sum(-1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    seen = []
    real_step = train.policy_step

    def recording_step(cfg, model, optimizer, scheduler, batch, scores, old_logps=None, rows=None):
        seen.append((rows, (old_logps * scores.loss_mask[:, :old_logps.shape[1]]).sum(-1)))
        return real_step(cfg, model, optimizer, scheduler, batch, scores, old_logps, rows)

    train.policy_step = recording_step
    try:
        steps = list(train.update(cfg, model, optimizer, scheduler, batch, scores))
    finally:
        train.policy_step = real_step
    assert len(steps) == 4 and [r for r, _ in seen] == [slice(0, 8), slice(8, 16)] * 2
    for _, old in seen:
        torch.testing.assert_close(old, sampling, atol=1e-5, rtol=0)
    sums = [s for s, _, _ in steps]
    assert sums[0]["sequences"] == 8 and sums[0]["clipped_low"] + sums[0]["clipped_high"] == 0


def test_generation_batch_size_sets_steps_per_generation_and_counts_the_run():
    cfg = config.parse_config(["--generation_batch_size", "64", "--per_device_train_batch_size", "16",
                               "--gradient_accumulation_steps", "2", "--num_generations", "4"])
    checks.check_config(cfg, world_size=2)
    assert config.generation_steps(cfg, world_size=2) == 2
    with pytest.raises(SystemExit, match="generation_batch_size=48 is not a multiple"):
        checks.check_config(dataclasses.replace(cfg, generation_batch_size=48), world_size=2)


def test_pad_to_multiple_of_pads_the_forward_and_changes_no_log_prob():
    model, tokenizer, dataset = data.embedded_task(seed=0)
    batch = rollout.generate(model, tokenizer, dataset[:3], cfg_for(num_generations=2, max_completion_length=5), CPU,
                             seed=0)
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    with torch.no_grad():
        plain, _, T, *_ = forward.forward_logps(model, batch, slice(None), 1.0)
        padded, _, T_padded, *_ = forward.forward_logps(model, batch, slice(None), 1.0, pad_to=8)
    hook.remove()
    assert lengths[1] % 8 == 0 and lengths[1] > lengths[0] and T == T_padded
    torch.testing.assert_close(padded, plain, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ evaluation, optimizer

def test_per_device_eval_batch_size_sets_the_generate_calls():
    """Evaluation over 12 prompts with num_generations_eval 2: per_device_eval_batch_size 8 is 4 prompts a call, so
    3 calls; the metrics do not depend on the chunking's count beyond sampling."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    cfg = cfg_for(num_generations_eval=2, per_device_eval_batch_size=8, max_completion_length=5)
    generator = rollout.DecodeLoop(evaluation.eval_config(cfg), model, tokenizer, None, CPU)
    calls = []
    generate = generator.generate
    generator.generate = lambda rows, seed=None: calls.append(len(rows["prompt"])) or generate(rows, seed)
    R = rewards.load_rewards(cfg, CPU)
    out = evaluation.evaluate(cfg, generator, {"test": dataset.select(range(12))}, R, model, step=0)
    assert calls == [4, 4, 4] and 0 <= out["eval_reward"] <= 1 and out["eval_loss"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(SystemExit, match="per_device_eval_batch_size=7 is not a multiple of num_generations_eval=2"):
        checks.check_config(dataclasses.replace(cfg, per_device_eval_batch_size=7))


def test_adam_settings_and_scheduler_kwargs_reach_the_optimizer():
    model, _, dataset = data.embedded_task(seed=0)
    cfg = config.parse_config(["--adam_beta1", "0.8", "--adam_beta2", "0.95", "--adam_epsilon", "1e-6",
                               "--lr_scheduler_type", "cosine_with_min_lr", "--lr_scheduler_kwargs",
                               '{"min_lr_rate": 0.1}', "--max_steps", "10", "--learning_rate", "1e-3"])
    checks.check_config(cfg)
    optimizer, scheduler, total = schedule.make_optimization(cfg, model, dataset, CPU)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.95) and optimizer.param_groups[0]["eps"] == 1e-6
    for _ in range(total):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-4)
    # transformers 5's warmup_steps: below 1 a fraction of the run, else a count
    assert schedule.warmup_steps(cfg_for(warmup_steps=0.5), 10) == 5 and schedule.warmup_steps(cfg_for(warmup_steps=3), 10) == 3
    assert schedule.warmup_steps(cfg_for(warmup_ratio=0.2), 10) == 2


def test_kl_estimator_k3_shapes_the_reward():
    """score() with --kl_estimator k3: kl_sums are sum_t exp(-d) - 1 + d over the loss tokens, d the log ratio of
    the policy (its sampler's log-probs) to the reference."""
    model, tokenizer, dataset = data.embedded_task(seed=0)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cfg = cfg_for(num_generations=2, max_completion_length=4, per_device_train_batch_size=4, beta=0.1,
                  kl_estimator="k3", bf16=False)
    batch = rollout.generate(model, tokenizer, dataset[:2], cfg, CPU, seed=0)
    R = rewards.RewardFunctions([lambda completions, **kw: [1.0] * len(completions)])
    out = train.score(cfg, batch, R, model, ref, 0)
    d = (out.old_logps - out.ref_logps) * out.loss_mask
    want = ((torch.exp(-d) - 1 + d) * out.loss_mask).sum(-1)
    torch.testing.assert_close(out.kl_sums, want, atol=1e-6, rtol=0)
    assert (out.kl_sums >= 0).all()
    torch.testing.assert_close(out.rewards, 1.0 - 0.1 * want, atol=1e-6, rtol=0)


def test_completions_table_images_follow_log_multimodal(tmp_path):
    """With images, the table's last column is each row's first image, unless --log_multimodal false."""
    from PIL import Image
    image = Image.new("RGB", (4, 4), "red")
    batch = random_batch(4, 2, 3, EMBEDDED_VOCAB)
    batch.rows = {"prompt": ["a", "b"], "image": [image, None]}
    batch.pixel_inputs = lambda rows: {}
    scores = train.Scores(torch.zeros(4, 1), None, None, torch.zeros(4))
    R = rewards.RewardFunctions([lambda completions, **kw: [0.0] * len(completions)])
    columns, rows = metrics.completions_table(7, batch, scores, R, log_multimodal=True)
    assert columns[-1] == "image" and rows[0][-1].size == (4, 4) and rows[3][-1] is None
    columns, rows = metrics.completions_table(7, batch, scores, R, log_multimodal=False)
    assert "image" not in columns and len(rows[0]) == len(columns)


def test_a_head_trained_apart_from_its_tied_embeddings_is_saved_untied(tmp_path):
    """--lora_modules_to_save lm_head on a model with tied embeddings (the embedded one, SmolLM2, Qwen2-0.5B): the
    saved merged model keeps the trained head (loading would otherwise tie the untrained one back), and vLLM, which
    ties them again at load, is refused in one line."""
    from options import vllm_rollout
    model = lora.add_adapter(data.embedded_task(seed=0)[0],
                             dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                  modules_to_save=["lm_head"]))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    assert lora.trains_tied_head(model)
    lora.save_adapted(model, {n: t.detach() for n, t in model.state_dict().items()}, str(tmp_path))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[3, 4, 5, 1]])
    with torch.no_grad():
        torch.testing.assert_close(saved(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(SystemExit, match="vLLM ties them again"):
        vllm_rollout.make_generator(cfg_for(use_vllm=True, model="a-model"), model, None, None, CPU)
