"""plumbing/user_code.py: user code (reward functions, environments, tools, a file's top level) runs inside the
trainer's process, and what it changes there is taken back after each call, said once, naming the function: the
working directory, autograd, torch's global modes, the signal handlers; the non-daemon threads it leaves running do
not hold the end of a run; its files import the helpers beside them; it may return what TRL takes (0-d tensors and
arrays). Runs here are train.main in this process, but those that need their own (a signal, the exit)."""

import os
import signal
import subprocess
import sys
import time

import numpy
import pytest
import torch

import rewards
from conftest import ROOT, in_process
from plumbing import user_code
from test_train import read_metrics

TINY = ["--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "16", "--num_generations", "4"]


def reward_file(tmp_path, body, name="grader.py"):
    """A reward file whose function `score` runs `body` (indented, with `calls`, a counter from 0) before scoring
    with task_reward."""
    code = "import os, signal, threading, time\nimport torch\nfrom rewards import task_reward\ncalls = [0]\n\n\n" \
           "def score(**kw):\n" + "".join(f"    {line}\n" for line in body.splitlines()) + \
           "    calls[0] += 1\n    return task_reward(**kw)\n"
    (tmp_path / name).write_text(code)
    return f"{tmp_path / name}:score"


CHANGES = {  # what the reward does at every call: the warning names it, and the run trains as if it had not
    "the working directory (issue)": ("os.chdir(os.path.dirname(__file__) + '/elsewhere')", "the working directory"),
    "autograd off (issue)": ("torch.set_grad_enabled(False)", "autograd (torch.set_grad_enabled)"),
    "float64 default dtype": ("torch.set_default_dtype(torch.float64)", "torch's default dtype"),
    "anomaly detection": ("torch.autograd.set_detect_anomaly(True)", "anomaly detection"),
    "deterministic algorithms": ("torch.use_deterministic_algorithms(True)", "deterministic algorithms"),
    "the SIGTERM handler (issue)": ("signal.signal(signal.SIGTERM, lambda *a: None)", "the SIGTERM handler"),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_what_a_reward_changes_in_the_process_is_taken_back_and_said_once(tmp_path, monkeypatch, case):
    """A relative --output_dir stays where it was given (checkpoints and the final model), the loss still has its
    gradient, and the process after the run is as before it."""
    body, what = CHANGES[case]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    out = in_process(TINY + ["--reward_funcs", reward_file(tmp_path, body), "--output_dir", "run", "--save_steps",
                             "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(f"reward function 'score' changed {what}") == 1, out.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and (tmp_path / "run" / "model.safetensors").exists()
    assert not os.listdir(tmp_path / "elsewhere")
    assert os.getcwd() == str(tmp_path) and torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
    assert not torch.is_anomaly_enabled() and not torch.are_deterministic_algorithms_enabled()
    assert signal.getsignal(signal.SIGTERM) is handler
    assert len(read_metrics(tmp_path / "run")) == 3


def test_an_environment_and_a_file_s_top_level_that_change_directory_are_taken_back(tmp_path, monkeypatch):
    """Ours: the same through the other doors user code comes in by: a reward file whose import changes directory,
    and an environment whose step does (in a thread of its own, with a timeout)."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loud.py").write_text("import os\nos.chdir('elsewhere')\nfrom rewards import task_reward as score\n")
    (tmp_path / "env.py").write_text(
        "import os\nclass Env:\n    def step(self, text):\n        os.chdir('/')\n        return '', True\n"
        "def make_env(row):\n    return Env()\n")
    out = in_process(TINY + ["--reward_funcs", "loud.py:score", "--output_dir", "run"])
    assert out.returncode == 0 and "reward function file 'loud.py' changed the working directory" in out.stderr
    out = in_process(TINY + ["--environment", "env.py:make_env", "--reward_funcs", "task_reward", "--output_dir",
                             "run2", "--max_completion_length", "4"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("--environment env.py:make_env's step changed the working directory") == 1
    assert (tmp_path / "run2" / "model.safetensors").exists() and os.getcwd() == str(tmp_path)


def test_a_reward_file_imports_the_helpers_beside_it_and_forgets_them_after(tmp_path, monkeypatch):
    """Issue: `from grading_helpers import score` beside the reward file, as when Python runs it as a script."""
    folder = tmp_path / "graders"
    folder.mkdir()
    (folder / "grading_helpers.py").write_text("from rewards import task_reward as score\n")
    (folder / "grader.py").write_text("from grading_helpers import score\n")
    out = in_process(TINY + ["--reward_funcs", f"{folder / 'grader.py'}:score", "--output_dir", str(tmp_path / "r")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "grading_helpers" not in sys.modules and str(folder) not in sys.path


def test_rewards_of_0_d_tensors_and_arrays_are_taken_as_trl_takes_them():
    """Issue: a list of 0-d tensors (TRL takes them) or of 0-d numpy arrays, and numpy scalars."""
    from test_bad_inputs_user_code import rollout
    values = [[torch.tensor(v) for v in (1.0, 0.0, 0.5, 0.25)], [numpy.array(v) for v in (1.0, 0.0, 0.5, 0.25)],
              [numpy.float32(v) for v in (1.0, 0.0, 0.5, 0.25)], [torch.tensor(True), None, 0.5, numpy.int64(0)]]
    out = rewards.RewardFunctions([lambda completions, v=v, **kw: v for v in values])(rollout(), 2, 0)
    assert out.T[:3].tolist() == [[1.0, 0.0, 0.5, 0.25]] * 3
    assert out.T[3, [0, 2, 3]].tolist() == [1.0, 0.5, 0.0] and out.T[3, 1].isnan()


@pytest.mark.slow
def test_a_non_daemon_thread_a_reward_leaves_does_not_hold_the_end_of_the_run(tmp_path):
    """Issue: a metrics flusher (a non-daemon thread that never ends) started by a reward: the run says which thread
    and which function started it, and the process exits with the run's code instead of waiting forever."""
    spec = reward_file(tmp_path, "if not calls[0]:\n    threading.Thread(target=time.sleep, args=(10**6,), "
                                 "name='flusher').start()")
    start = time.time()
    out = subprocess.run([sys.executable, "train.py", *TINY, "--reward_funcs", spec, "--output_dir",
                          str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and time.time() - start < 200, out.stderr[-3000:]
    assert "thread 'flusher' (started by reward function 'score') still running" in out.stderr, out.stderr[-3000:]
    assert "final model in" in out.stdout and (tmp_path / "run" / "model.safetensors").exists()


@pytest.mark.slow
def test_sigterm_checkpoints_though_a_reward_installed_its_own_handler(tmp_path):
    """Issue: a sandbox client's SIGTERM handler installed by a reward; the preemption then comes (here the reward
    sends it at its fourth call): the run's handler, taken back, checkpoints and stops as it would have."""
    spec = reward_file(tmp_path, "if not calls[0]:\n    signal.signal(signal.SIGTERM, lambda *a: None)\n"
                                 "if calls[0] == 3:\n    os.kill(os.getpid(), signal.SIGTERM)")
    out = subprocess.run([sys.executable, "train.py", *TINY[:1], "100", *TINY[2:], "--reward_funcs", spec,
                          "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert "reward function 'score' changed the SIGTERM handler" in out.stderr, out.stderr[-3000:]
    assert "stopped by a signal: saved checkpoint-" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert any(name.startswith("checkpoint-") for name in os.listdir(tmp_path / "run"))


def test_a_call_that_changes_nothing_says_nothing(capsys):
    with user_code.taken_back("reward function 'quiet'"):
        torch.zeros(2).sum()
    assert capsys.readouterr().err == ""
