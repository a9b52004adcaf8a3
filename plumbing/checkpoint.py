"""Checkpoints: sharded save and exact resume (torch.distributed.checkpoint, written under a
temporary name and renamed), SIGTERM and Ctrl-C as requests to checkpoint and stop, the final
model in Hugging Face format, and `python train.py export CHECKPOINT [OUT_DIR]`. The directories
the run writes are checked and locked in plumbing/directories.py.

A checkpoint-N directory holds every rank's shards of the trained parameters (with LoRA: the adapter
only; the frozen base comes from --model again), the optimizer, the reference model when
--sync_ref_model moves it, rng_rank{r}.pt per rank, an async run's batches in flight in
in_flight_rank{r}.pt, trainer_state.json (a TrainerState, the scheduler, the run's flags, and how to
rebuild the model) and, written last, manifest.json: every file and its size.
"""

import dataclasses
import errno
import json
import os
import re
import resource
import shutil
import signal
import sys
import threading
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from tqdm import tqdm

from options import lora
from plumbing import distributed
from step import reward_calls
from plumbing.config import fail
from step.data import embedded_task, first_line
from plumbing.models import load_model

# DCP in a single process (no process group) is intended here; its warning says so on every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")


def checkpoint_dirs(output_dir):
    """Finished checkpoint-N directories, oldest first (written as checkpoint-N.tmp and renamed when
    complete)."""
    found = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


MANIFEST = "manifest.json"  # written last: every file of the checkpoint and its size


def write_manifest(path):
    written = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    files = {os.path.relpath(file, path): os.path.getsize(file) for file in written}
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump({"files": files}, f)


def damage(path):
    """What is wrong with a checkpoint directory (a file missing, truncated, unreadable), or None if
    it is whole."""
    if not os.path.exists(os.path.join(path, MANIFEST)):
        return (f"{MANIFEST}, written last, is missing: the save did not finish (or an older rloo "
                "wrote it)")
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        for name, size in files.items():
            if not os.path.exists(os.path.join(path, name)):
                return f"{name} is missing"
            if os.path.getsize(os.path.join(path, name)) != size:
                return f"{name} has {os.path.getsize(os.path.join(path, name))} bytes, not {size}"
        with open(os.path.join(path, "trainer_state.json")) as f:
            json.load(f)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} or trainer_state.json unreadable: {type(e).__name__}: {str(e)[:120]}"
    return None


def previous_whole(path):
    """The newest undamaged checkpoint older than path in its directory, for the error message, or
    None."""
    older = [d for d in checkpoint_dirs(os.path.dirname(os.path.abspath(path)))
             if step_of(d) < step_of(path)]
    return next((d for d in reversed(older) if damage(d) is None), None)


def step_of(path):
    return int(path.rstrip("/").rsplit("-", 1)[-1].removesuffix(".tmp")) if "-" in path else -1


def suggestion(path):
    previous = previous_whole(path)
    if previous:
        return f"resume from the previous complete one, --resume_from_checkpoint {previous}"
    return "no earlier complete checkpoint is there; start afresh with --overwrite_output_dir"


@dataclasses.dataclass
class TrainerState:
    """Where a run stands: what trainer_state.json keeps besides the scheduler and the flags."""
    step: int = 0  # optimizer steps taken
    num_tokens: float = 0  # prompt + completion tokens generated so far, all ranks
    window: dict = dataclasses.field(default_factory=dict)  # metrics since the last log line
    position: int = 0  # prompt batches drawn (batches.BatchSource)
    in_flight: list = dataclasses.field(default_factory=list)  # async batches, saved per rank
    data: dict | None = None  # what identifies the data at the position (batches.BatchSource.data)


def resume_or_start(cfg, model, optimizer, scheduler, ref_model=None):
    """Where the run starts: the saved TrainerState with --resume_from_checkpoint (model,
    optimizer, scheduler and RNG restored), else step 0, after removing another run's checkpoints
    under --overwrite_output_dir."""
    if cfg.resume_from_checkpoint:
        return load_checkpoint(cfg, model, optimizer, scheduler, ref_model)
    if distributed.is_main() and cfg.overwrite_output_dir:
        for old in checkpoint_dirs(cfg.output_dir):
            shutil.rmtree(old)
    return TrainerState()


# seconds a reward function may still run after SIGTERM or Ctrl-C before it is stopped (the step
# is then lost)
REWARD_GRACE = 10.0


def watch_signals(device, output_dir):
    """SIGTERM (SLURM's warning before a kill) and SIGINT (Ctrl-C) set a flag: the loop checkpoints
    and exits at the end of the step. Reward code (which may never return) gets REWARD_GRACE
    seconds, then is stopped; a second Ctrl-C exits at once. A lost peer process (torchrun's
    SIGTERM after it died, or the collective that failed) ends the run with one line instead
    (stop_for_lost_peer): no step can end, nor a checkpoint be saved, without it."""
    flag, main_thread = torch.zeros(1, device=device), threading.main_thread().ident

    def stop_reward_if_still_running():
        if reward_calls.calling[0]:
            signal.pthread_kill(main_thread, signal.SIGTERM)

    def handle(signum, frame):
        lost = distributed.lost_peers(wait=0)
        if lost:
            stop_for_lost_peer(output_dir, lost)
        name, again = signal.Signals(signum).name, bool(flag.item())
        if signum == signal.SIGINT and again:
            print("\nrloo: second Ctrl-C: exiting now, without a checkpoint", file=sys.stderr)
            os._exit(130)
        flag.fill_(1)
        if signum == signal.SIGINT:
            print(f"\nrloo: {name}: saving a checkpoint at the end of this step (Ctrl-C again: "
                  "exit at once)", file=sys.stderr)
        if reward_calls.calling[0] and again:
            raise reward_calls.Interrupted(name)
        if reward_calls.calling[0]:
            timer = threading.Timer(REWARD_GRACE, stop_reward_if_still_running)
            timer.daemon = True  # it must not hold the exit
            timer.start()

    if threading.current_thread() is not threading.main_thread():  # Python's rule (README 'Sweeps')
        if distributed.is_main():
            print(f"rloo: running in thread {threading.current_thread().name!r}, not the main one: "
                  "no SIGTERM or Ctrl-C handler, so a signal does not save a checkpoint",
                  file=sys.stderr)
        return flag
    # put back when the run ends (plumbing/process.py)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handle)
    return flag


def stop_if_a_peer_is_lost(output_dir, error):
    """An error on its way out of a run of several processes: a peer's that ended, or a collective
    that failed, is one line naming the peer and the checkpoint to resume from (stop_for_lost_peer,
    which exits); any other error goes on."""
    in_group = len(distributed.PEERS) > 1
    lost = distributed.lost_peers() if in_group else []
    if lost or (in_group and distributed.collective_failed(error)):
        stop_for_lost_peer(output_dir, lost, error)


def stop_for_lost_peer(output_dir, lost, error=None):
    """One line from the lowest surviving rank, naming the lost peer(s) (ranks; none when the peer
    is on another host) and the checkpoint to resume from; then exit at once, as every collective,
    and the interpreter's shutdown, would wait on the dead peer."""
    for signum in (signal.SIGTERM, signal.SIGINT):  # torchrun's SIGTERM must not add a line
        if threading.current_thread() is threading.main_thread():
            signal.signal(signum, signal.SIG_IGN)
    if distributed.rank() == min(set(range(distributed.world_size())) - set(lost)):
        for bar in list(tqdm._instances):
            bar.clear()
        ranks = ", ".join(map(str, lost))
        who = (f"lost peer: rank {ranks}'s process has ended (killed, out of memory, or stopped by "
               "its own error)" if lost else f"lost peer: a collective failed "
               f"({first_line(error)}), so a process on another host has stopped or hangs")
        whole = [path for path in checkpoint_dirs(output_dir) if damage(path) is None]
        where = (f"the last intact checkpoint is {whole[-1]}: resume with "
                 "--resume_from_checkpoint latest" if whole else "no checkpoint was saved")
        print(f"error: {who}, and the run cannot go on without it; {where}", file=sys.stderr,
              flush=True)
    sys.stdout.flush()
    os._exit(1)


def stop_requested(flag):
    """Whether any rank got SIGTERM: every rank stops at the same step."""
    if distributed.world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def save_due(cfg, step, saved_step, last, stopped=False):
    """Every save_steps optimizer steps (a μ-pass step may jump over a multiple), at the last step
    (max_steps, or --max_train_minutes ran out) and on a signal; never with --save_strategy no."""
    if cfg.save_strategy == "no":
        return False
    passed = cfg.save_steps > 0 and step // cfg.save_steps > saved_step // cfg.save_steps
    return stopped or passed or last


# the frozen base of a LoRA run is --model's, not ours to save
TRAINED = StateDictOptions(ignore_frozen_params=True)


def sharded_state(cfg, model, optimizer, ref_model):
    """The state DCP saves and loads: trained parameters, optimizer, and the reference when
    sync_ref_model moves it."""
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED)
    state = {"model": model_state, "optimizer": optim_state}
    if cfg.sync_ref_model:
        state["ref_model"] = get_model_state_dict(ref_model)
    return state


def rebuild_info(cfg, vision):
    """What export needs to rebuild the model this checkpoint trains."""
    return dict(model=cfg.model, model_init_kwargs=cfg.model_init_kwargs,
                trust_remote_code=cfg.trust_remote_code, lora=lora.settings(cfg), seed=cfg.seed,
                vision=vision)


def save_checkpoint(cfg, model, optimizer, scheduler, state, vision=False, ref_model=None):
    """Every rank writes its own shards (nobody gathers the model) into checkpoint-N.tmp; rank 0
    adds the manifest and renames it when all are done, so a kill mid-save leaves the previous
    checkpoint intact, and a full disk is one line (the partial directory removed). state: a
    TrainerState."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{state.step}")
    try:
        write_checkpoint(cfg, model, optimizer, scheduler, state, vision, ref_model, final + ".tmp")
    except (OSError, CheckpointException) as e:  # CheckpointException: DCP's, a BaseException
        # a full disk can surface as torch's own error (its zip writer's "unexpected pos"): say it
        full = shutil.disk_usage(cfg.output_dir).free < 2**20 and "No space left" not in reason(e)
        full = full and "No space left on device: "
        fix = write_fix(e, cfg.output_dir)
        if distributed.is_main():
            shutil.rmtree(final + ".tmp", ignore_errors=True)
        last = checkpoint_dirs(cfg.output_dir)
        kept = f"the last complete checkpoint, {last[-1]}, is intact" if last else \
            "no earlier checkpoint exists"
        then = "resume with --resume_from_checkpoint latest" if last else "run again"
        fail(f"cannot write {final} ({full or ''}{reason(e)}): the partial copy is removed and "
             f"{kept}. To go on, {fix}, then {then}")
    if distributed.is_main():
        shutil.rmtree(final, ignore_errors=True)
        os.rename(final + ".tmp", final)
        # the newest save_total_limit - 1 others stay, with the one just written whatever its number
        others = [d for d in checkpoint_dirs(cfg.output_dir) if d != final]
        if cfg.save_total_limit:
            for old in others[:max(0, len(others) - cfg.save_total_limit + 1)]:
                shutil.rmtree(old)
    distributed.barrier()


def cause(error):
    """An exception, or for DCP's CheckpointException the first rank's own exception."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def reason(error):
    """One line for an exception (its cause)."""
    error = cause(error)
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


# What to do when a write fails, by its cause (errno): a full disk is not a read-only one
FIXES = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free space within your disk quota",
         errno.EROFS: "the filesystem is read-only now: make it writable (or copy the run "
                      "somewhere that is)",
         errno.EACCES: "give this user write permission there",
         errno.EPERM: "give this user write permission there",
         errno.EFBIG: "a file passed this process's file-size limit: raise it (ulimit -f)",
         errno.ENOENT: "the directory was removed under the run: make it again"}


def write_fix(error, directory):
    """What to do about a failed write, from its errno: an OSError's, the one safetensors' writer
    names in its message (`File too large (os error 27)`), or, where torch's zip writer
    hides it ("unexpected pos"), the disk's free space or this process's file-size limit."""
    error = cause(error)
    code = error.errno if isinstance(error, OSError) else None
    found = re.search(r"\(os error (\d+)\)|Os \{ code: (\d+)", str(error))
    code = int(found.group(1) or found.group(2)) if code is None and found else code
    if code is None and "unexpected pos" in str(error):
        limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
        code = errno.ENOSPC if shutil.disk_usage(directory).free < 2**20 else \
            errno.EFBIG if limited else None
    return FIXES.get(code, "fix that")


def write_checkpoint(cfg, model, optimizer, scheduler, state, vision, ref_model, tmp):
    rank, world_size = distributed.rank(), distributed.world_size()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    distributed.barrier()
    dcp.save(sharded_state(cfg, model, optimizer, ref_model), checkpoint_id=tmp)
    if state.in_flight:  # async generation's batches, sampled by weights no checkpoint holds
        torch.save(state.in_flight, os.path.join(tmp, f"in_flight_rank{rank}.pt"))
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    rng = {"cpu": torch.get_rng_state(), "cuda": cuda_rng}
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank}.pt"))
    distributed.barrier()
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            saved = dataclasses.asdict(state)
            del saved["in_flight"]
            json.dump({**saved, "scheduler": scheduler.state_dict(), "world_size": world_size,
                       "config": effective_config(cfg, scheduler), **rebuild_info(cfg, vision)}, f)
        write_manifest(tmp)


def effective_config(cfg, scheduler):
    """The run's flags as they act: a resumed run's learning rate and weight decay are its
    checkpoint's."""
    return {**dataclasses.asdict(cfg), "learning_rate": scheduler.base_lrs[0],
            "weight_decay": max(g["weight_decay"] for g in scheduler.optimizer.param_groups)}


def find_checkpoint(cfg):
    """--resume_from_checkpoint PATH or 'latest' -> a whole checkpoint directory and its
    trainer_state.json. 'latest' passes over damaged ones, saying so; a damaged PATH is one line
    naming the previous whole one."""
    path = cfg.resume_from_checkpoint
    if path == "latest":
        found = checkpoint_dirs(cfg.output_dir)
        if not found:
            fail(f"--resume_from_checkpoint latest: no checkpoint in {cfg.output_dir!r}")
        while found and damage(found[-1]):
            if distributed.is_main():
                print(f"rloo: WARNING: {found[-1]} is damaged ({damage(found[-1])}); trying the "
                      "one before", file=sys.stderr)
            found.pop()
        if not found:
            fail(f"every checkpoint in {cfg.output_dir!r} is damaged; start afresh with "
                 "--overwrite_output_dir")
        path = found[-1]
    written = [os.path.exists(os.path.join(path, f)) for f in ("trainer_state.json", MANIFEST)]
    if not os.path.isdir(path) or not any(written):
        fail(f"--resume_from_checkpoint {path!r} is not a finished checkpoint directory (no "
             "trainer_state.json)")
    if damage(path):
        fail(f"checkpoint {path!r} is damaged ({damage(path)}); {suggestion(path)}")
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    if state["model"] != cfg.model:
        fail(f"checkpoint {path!r} was trained from model {state['model']!r}, not {cfg.model!r}")
    return path, state


def check_steps_left(cfg, state, total_steps):
    """A resume at or past the run's last step would train nothing and save the final model
    again, without a word: one line instead."""
    if cfg.resume_from_checkpoint and state.step >= total_steps:
        length = f"--max_steps {cfg.max_steps}" if cfg.max_steps > 0 else \
            f"--num_train_epochs {cfg.num_train_epochs:g}"
        fail(f"--resume_from_checkpoint {cfg.resume_from_checkpoint}: the checkpoint is at step "
             f"{state.step} and this run ends at step {total_steps} ({length}): nothing is left to "
             "train. To go on, raise it; for its model, python train.py export CHECKPOINT")


# On resume the optimizer and scheduler state come back from the checkpoint (as the Hugging Face
# Trainer does): these flags keep the checkpoint's values; every other flag takes its new value.
FROM_CHECKPOINT = ("learning_rate", "weight_decay")
NOT_COMPARED = ("resume_from_checkpoint", "overwrite_output_dir", "accept_data_change")


def warn_changed_flags(cfg, state, path):
    """One warning listing the flags whose values differ from the checkpoint's run, and which of
    them apply."""
    saved, now = state.get("config") or {}, dataclasses.asdict(cfg)
    changed = [name for name in now if name in saved and name not in NOT_COMPARED
               and saved[name] != now[name]]
    if changed and distributed.is_main():
        effect = {True: "the checkpoint value stays", False: "the new value applies"}
        listed = "; ".join(f"{name} {saved[name]!r} -> {now[name]!r} "
                           f"({effect[name in FROM_CHECKPOINT]})" for name in changed)
        print(f"rloo: WARNING: resuming {path} with flags that differ from its run: {listed}",
              file=sys.stderr)


def load_checkpoint(cfg, model, optimizer, scheduler, ref_model=None):
    """Restore model, optimizer, scheduler, a moved reference and this rank's RNG; returns the saved
    state (step, num_tokens, window)."""
    rank, world_size = distributed.rank(), distributed.world_size()
    path, state = find_checkpoint(cfg)
    if bool(state.get("lora")) != cfg.use_peft:
        fail(f"checkpoint {path!r} was trained {'with' if state.get('lora') else 'without'} "
             "--use_peft; resume it the same way")
    warn_changed_flags(cfg, state, path)
    full = sharded_state(cfg, model, optimizer, ref_model)
    try:
        dcp.load(full, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # whole files (checked): another architecture
        fail(f"checkpoint {path!r} does not fit this model or cannot be read ({reason(e)}); if it "
             f"is damaged, {suggestion(path)}")
    # strict=False: the frozen base is not in the checkpoint (dcp.load above already failed on a
    # missing trained key)
    trained_only = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(model, optimizer, model_state_dict=full["model"],
                   optim_state_dict=full["optimizer"], options=trained_only)
    if cfg.sync_ref_model:
        set_model_state_dict(ref_model, full["ref_model"])
    scheduler.load_state_dict(state["scheduler"])
    resumed = TrainerState(**{f.name: state[f.name] for f in dataclasses.fields(TrainerState)
                              if f.name in state})
    in_flight_file = os.path.join(path, f"in_flight_rank{rank}.pt")
    if os.path.exists(in_flight_file):
        if state["world_size"] != world_size:
            fail(f"checkpoint {path!r} holds batches in flight for {state['world_size']} "
                 "processes: resume it with as many")
        resumed.in_flight = torch.load(in_flight_file, weights_only=False)
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if state["world_size"] == world_size and os.path.exists(rng_file):
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif rank == 0:
        print(f"rloo: checkpoint written by {state['world_size']} processes, resuming on "
              f"{world_size}: weights and optimizer are resharded, sampling RNG starts afresh")
    if rank == 0:
        print(f"rloo: resumed from {path} at step {resumed.step}")
    return resumed


def save_hf(model, tokenizer, path):
    """Final model in Hugging Face format (from_pretrained / vLLM load it); with LoRA the merged
    weights, and the adapter alone in path/adapter. FSDP2 shards are gathered to rank 0 only."""
    gathered = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state_dict = get_model_state_dict(model, options=gathered)
    if not distributed.is_main():
        return
    try:
        if lora.is_adapted(model):
            lora.save_adapted(model, state_dict, path)
        else:
            model.save_pretrained(path, state_dict=state_dict)
        tokenizer.save_pretrained(path)
    except Exception as e:  # noqa: BLE001 (OSError, or safetensors' SafetensorError of one)
        if not isinstance(e, OSError) and "SafetensorError" not in type(e).__name__:
            raise
        last = checkpoint_dirs(path)
        then = f"python train.py export {last[-1]}" if last else "run again"
        fail(f"cannot write the final model to {path!r} ({reason(e)}): {write_fix(e, path)}, "
             f"then {then}")


def export_checkpoint(path, out_dir=None):
    """`python train.py export CHECKPOINT [OUT_DIR]`: a sharded checkpoint -> a Hugging Face model
    directory (with LoRA: the base from its model name or seed, the adapter from the checkpoint,
    merged; the adapter in OUT/adapter). A damaged one is one line naming what is wrong."""
    problem = damage(path) if os.path.isdir(path) else "no such directory"
    if problem:
        previous = previous_whole(path) if os.path.isdir(path) else None
        fail(f"cannot export checkpoint {path!r}: {problem}" + (
            f"; export the previous complete one, {previous}" if previous else ""))
    with open(os.path.join(path, "trainer_state.json")) as f:
        info = json.load(f)
    if info["model"] is None:
        model, tokenizer = embedded_task(info.get("seed", 0))[:2]
    else:
        model, tokenizer = load_model(info["model"], info.get("vision", False),
                                      info.get("model_init_kwargs"),
                                      info.get("trust_remote_code", False))
    if info.get("lora"):
        model = lora.add_adapter(model, info["lora"])
    state = {"model": get_model_state_dict(model, options=TRAINED)}
    dcp.load(state, checkpoint_id=path)  # reads every rank's shards in one process
    model.load_state_dict(state["model"], strict=not info.get("lora"))
    out_dir = out_dir or path.rstrip("/") + "-hf"
    save_hf(model, tokenizer, out_dir)
    print(f"rloo: exported {path} -> {out_dir}")
