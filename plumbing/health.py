"""What makes a run meaningless, each stopped with one line where it shows: optimizer steps in a row
with a NaN/inf gradient, batches in a row that no reward function scored, and a run that ended
without one step that updated the weights.
"""

import math
import sys

import torch
from tqdm import tqdm

from plumbing import distributed
from plumbing.config import fail


class RunHealth:
    """What makes a run meaningless, each stopped with one line: optimizer steps in a row with a
    NaN/inf gradient (each was skipped), generated batches in a row that no reward function scored
    (all None: no signal, a warning the first time), and at the end a run in which no step updated
    the weights (nothing is saved as trained)."""

    def __init__(self, cfg):
        self.cfg, self.nonfinite, self.unscored, self.updated = cfg, 0, 0, 0

    def scored(self, reward, step):
        """reward: the global batch's mean reward, NaN when nothing was scored."""
        self.unscored = self.unscored + 1 if math.isnan(reward) else 0
        if self.unscored == 1 and distributed.is_main():
            tqdm.write(f"rloo: WARNING: step {step}: every reward function returned None for "
                       "every completion: this batch has no learning signal", file=sys.stderr)
        if self.unscored >= self.cfg.max_nonfinite_steps:
            fail(f"{self.unscored} batches in a row were scored by no reward function (all None): "
                 "check that the reward functions apply to this dataset (their columns, their "
                 "answer format)")

    def stepped(self, grad_norm):
        finite = bool(torch.isfinite(grad_norm))
        self.updated += finite
        self.nonfinite = 0 if finite else self.nonfinite + 1
        if self.nonfinite >= self.cfg.max_nonfinite_steps:
            fail(f"{self.nonfinite} optimizer steps in a row had a NaN/inf gradient (all skipped); "
                 f"stopping. The last checkpoint in {self.cfg.output_dir!r} is intact. Check "
                 "rewards and learning rate.")

    def check_trained(self, steps):
        if steps and not self.updated:
            fail(f"none of the {steps} optimizer steps updated the weights (every gradient was "
                 "NaN/inf, so each was skipped): nothing is saved as a trained model. Check the "
                 "rewards' scale, --beta and --learning_rate")
