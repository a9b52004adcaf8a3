"""How long a run is and how fast it learns: its optimizer steps (max_steps, or num_train_epochs
passes over the prompts), AdamW and the learning-rate schedule over them, as TRL's Trainer counts
and builds them."""

import math

from transformers import get_scheduler

from plumbing import distributed, models
from step import data
from plumbing.config import generation_steps
from step.metrics import announce


def steps_per_batch(cfg):
    """Optimizer steps on one generated batch: mu passes, each in steps_per_generation /
    gradient_accumulation_steps mini-batches."""
    minibatches = generation_steps(cfg, distributed.world_size()) // cfg.gradient_accumulation_steps
    return cfg.num_iterations * minibatches


def count_steps(cfg, dataset):
    """Optimizer steps of the run: max_steps, or num_train_epochs passes over the prompts."""
    if cfg.max_steps > 0:
        return cfg.max_steps
    batches = math.ceil(cfg.num_train_epochs * data.steps_per_epoch(dataset, cfg))
    return batches * steps_per_batch(cfg)


def warmup_steps(cfg, total_steps):
    """--warmup_steps (below 1: a fraction of the run) or --warmup_ratio."""
    fraction = cfg.warmup_ratio or (cfg.warmup_steps if cfg.warmup_steps < 1 else 0)
    return int(fraction * total_steps) if fraction else int(cfg.warmup_steps)


def make_optimization(cfg, model, dataset, device):
    """AdamW over the trainable parameters, the learning-rate schedule, the run's optimizer steps
    (announced with the model's size). -> (optimizer, scheduler, total_steps)"""
    total_steps, optimizer = count_steps(cfg, dataset), models.make_optimizer(model, cfg)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, num_training_steps=total_steps,
                              num_warmup_steps=warmup_steps(cfg, total_steps),
                              scheduler_specific_kwargs=cfg.lr_scheduler_kwargs)
    announce(cfg, model, device, total_steps, steps_per_batch(cfg))
    return optimizer, scheduler, total_steps
