"""What runs around the step (README 'Files'): the flags and their checks (config, domains,
checks), models and their files (models, model_files), the schedule, logs, health, checkpoints and
directories, torch.distributed, the process a run borrows, the stack it runs on, the user's files
(user_code)."""
