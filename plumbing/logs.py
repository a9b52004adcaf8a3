"""The Logger: rank 0 writes each logged step's metrics (step/metrics.py computes them) to
metrics.jsonl, the progress bar and its sinks, wandb and tensorboard; a sink that fails mid-run is
dropped with one warning line while the run goes on (docs/troubleshooting.md 'Logs'). Non-zero ranks
get a Logger whose calls do nothing, so the loop has no `if rank == 0`.
"""

import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict

from tqdm import tqdm

from plumbing import distributed
from plumbing.config import fail
from step.data import first_line


class Logger:
    """Rank 0 writes metrics.jsonl, a progress bar and wandb or tensorboard (its sinks); other ranks
    get the same calls as no-ops. A sink that fails mid-run (its directory deleted, a full disk, a
    file-size limit, wandb's service gone) is dropped with one warning line and the run goes on:
    training, checkpoints and the other sinks (docs/troubleshooting.md 'Logs')."""

    def __init__(self, cfg, total_steps, state):
        """state: where the run starts (checkpoint.TrainerState); resuming restores its metric
        window and keeps the lines of metrics.jsonl up to its step, dropping those an interrupted
        run wrote after it."""
        self.is_main, self.window = distributed.is_main(), state.window
        self.sinks, self.dropped, self.reward, self.last = {}, {}, math.nan, {}
        self.closed = False
        self.printed, self.unique_prompts = cfg.num_completions_to_print, cfg.log_unique_prompts
        self.logging_steps, self.total_steps = cfg.logging_steps, total_steps
        self.step_end = time.perf_counter()  # step_time: wall time between optimizer-step ends
        if not self.is_main:
            return
        resumed_step = state.step if cfg.resume_from_checkpoint else None
        os.makedirs(cfg.output_dir, exist_ok=True)
        self.path = os.path.join(cfg.output_dir, "metrics.jsonl")
        kept = kept_lines(self.path, resumed_step)
        self.sinks["metrics.jsonl"] = open(self.path, "w")
        self.sinks["metrics.jsonl"].writelines(kept)
        if "wandb" in cfg.report_to:
            self.sinks["wandb"] = start_wandb(cfg)
        if "tensorboard" in cfg.report_to:  # where the Hugging Face Trainer writes them
            from torch.utils.tensorboard import SummaryWriter
            self.sinks["tensorboard"] = SummaryWriter(os.path.join(cfg.output_dir, "runs"))
            # plumbing/process.py restores it
            threading.excepthook = quiet_writer_thread(threading.excepthook)
        self.bar = tqdm(total=total_steps, initial=resumed_step or 0, desc="rloo",
                        dynamic_ncols=True)

    def add_step(self, metrics):
        """One optimizer step's metrics into the window, with step_time, and the progress bar one
        step on."""
        now = time.perf_counter()
        metrics = {**metrics, "step_time": now - self.step_end}
        # later passes of a batch show its reward
        self.step_end, self.reward = now, metrics.get("reward", self.reward)
        if self.is_main:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{self.reward:.3f}")
        for key, value in metrics.items():
            self.window.setdefault(key, []).append(value)

    def log_if_due(self, step, last=False, **totals):
        """Every logging_steps steps and at the last (last: the run ends here, before
        total_steps): log the window (see log). Returns whether it did."""
        if step % self.logging_steps and step != self.total_steps and not last:
            return False
        self.log(step, **totals)
        return True

    def log(self, step, **totals):
        """Average the window (skipping NaN), add running totals such as num_tokens as they are,
        write everywhere."""
        means = {k: (sum(v) / len(v) if v else None) for k, v in
                 ((k, [x for x in vs if not math.isnan(x)]) for k, vs in self.window.items())}
        means.update({k: v for k, v in totals.items() if v is not None})  # epoch: a stream's
        self.window, self.last = {}, {"step": step, **means}
        self.write(step, means)
        return means

    def write(self, step, metrics):
        if not self.is_main:
            return
        line = json.dumps({"step": step, **metrics}) + "\n"
        self.send("metrics.jsonl", step, lambda f: write_line(f, line))
        shown = ["reward", "reward_std", "kl", "entropy", "completions/mean_length", "loss",
                 "grad_norm", "step_time"]
        prefix = "eval_" if any(k.startswith("eval_") for k in metrics) else ""
        values = [(k.split("/")[-1], metrics.get(prefix + k)) for k in shown]
        self.bar.write(f"step {step}: " + " ".join(f"{prefix}{name}={value:.4g}"
                                                   for name, value in values if value is not None))
        logged = {k: v for k, v in metrics.items() if v is not None}
        self.send("wandb", step, lambda run: run.log(logged, step=step))
        self.send("tensorboard", step, lambda writer: add_scalars(writer, metrics, step))

    def send(self, name, step, write):
        """write(sink) to one sink still in use; a sink that fails (or whose files were deleted
        under it) is dropped: one warning naming it, the step and the error."""
        sink = self.sinks.get(name)
        if sink is None:
            return
        try:
            deleted = files_deleted(name, sink)
            if deleted:
                raise FileNotFoundError(f"{deleted} was deleted under the run")
            write(sink)
        except Exception as error:  # noqa: BLE001 (whatever the sink's library raises)
            deleted = files_deleted(name, sink)  # deleted during the write: say that, not its error
            error = FileNotFoundError(f"{deleted} was deleted under the run") if deleted else error
            self.sinks.pop(name)
            self.dropped[name] = step
            where = self.path if name == "metrics.jsonl" else name
            tqdm.write(f"rloo: WARNING: {where} failed at step {step} ({first_line(error)}): "
                       "dropped; training, checkpoints and the other logs go on", file=sys.stderr)
            close_sink(name, sink, quietly=True)

    def completions(self, step, columns, rows):
        """--log_completions: num_completions_to_print rows to stdout (all by default), and the
        table to wandb (one row per prompt with log_unique_prompts; images as wandb images)."""
        if not self.is_main:
            return
        self.bar.write(f"step {step} completions:")
        for row in rows[:self.printed]:
            cells = [f"{c}={v:.3g}" if isinstance(v, float) else f"{c}={v!r}"
                     for c, v in zip(columns, row) if c != "image"]
            self.bar.write("  " + " | ".join(cells))
        if "wandb" in self.sinks:
            import wandb
            if self.unique_prompts:  # the first completion of each prompt
                firsts = {str(row[1]): row for row in reversed(rows)}
                rows = [row for row in rows if firsts[str(row[1])] is row]
            if "image" in columns:
                rows = [row[:-1] + [None if row[-1] is None else wandb.Image(row[-1])]
                        for row in rows]
            table = wandb.Table(columns=columns, data=rows)
            self.send("wandb", step, lambda run: run.log({"completions": table}, step=step))

    def where(self):
        """Where the metrics went, for the run's last line."""
        stopped = self.dropped.get("metrics.jsonl")
        return self.path + (f" (up to step {stopped}, when it failed)" if stopped else "")

    def close(self):
        """Once, at the end of the run or on its way out (finish, and process.borrowed)."""
        if self.is_main and not self.closed:
            self.closed = True
            self.bar.close()
            for name in list(self.sinks):
                self.send(name, self.last.get("step", 0), lambda sink: close_sink(name, sink))
            self.sinks.clear()


def kept_lines(path, resumed_step):
    """A resumed run's metrics.jsonl lines up to its step; a line cut short (a kill, or a full disk
    mid-write) is left out."""
    if resumed_step is None or not os.path.exists(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    return kept


def start_wandb(cfg):
    """The wandb run; one that cannot start (not logged in, no network) is one line."""
    import wandb
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "rloo"), name=cfg.run_name,
                          config=asdict(cfg), dir=cfg.output_dir)
    except Exception as e:  # noqa: BLE001 (wandb's errors, its settings' validation)
        fail(f"--report_to wandb: wandb cannot start ({first_line(e)}); log in (wandb login) or "
             "set WANDB_MODE=offline")


def write_line(f, line):
    f.write(line)
    f.flush()


def add_scalars(writer, metrics, step):
    for k, v in metrics.items():
        if isinstance(v, (int, float)):
            writer.add_scalar(k, v, step)
    writer.flush()


def files_deleted(name, sink):
    """The file or directory a sink writes that was deleted under the run (a clean-up of
    output_dir: writes would go on into nothing), or None."""
    if name == "metrics.jsonl" and os.fstat(sink.fileno()).st_nlink == 0:
        return sink.name
    if name == "tensorboard" and not os.path.isdir(sink.log_dir):
        return sink.log_dir
    if name == "wandb" and sink.offline and not os.path.isdir(sink.dir):  # online: sent as well
        return sink.dir
    return None


def quiet_writer_thread(previous):
    """threading.excepthook for the run: an error in tensorboard's writer thread is not printed as a
    traceback there, as tensorboard raises it again at the next write, where send says it in one
    line; other threads' go to the previous hook."""
    def hook(args):
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)
    return hook


def close_sink(name, sink, quietly=False):
    """Close one sink; quietly: one that failed already (what it still held is lost)."""
    try:
        sink.close() if name != "wandb" else sink.finish()
    except Exception:  # noqa: BLE001
        if not quietly:
            raise
    if name == "wandb" and quietly:  # its service, or its exit hook fails again at exit
        import wandb
        try:
            wandb.teardown()
        except Exception:  # noqa: BLE001
            pass
