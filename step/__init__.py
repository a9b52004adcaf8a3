"""What one training step uses, in the order a batch meets it (README 'Files'): the batch and where
it comes from (batches), the prompts (data, prompting), the sampler (sampler, sampler_rules),
calling the reward functions (reward_calls), the training forward (forward) and the metrics
(metrics)."""
