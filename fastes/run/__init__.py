"""One training run, above models, tasks and analysis: `config` (the TOML / CLI settings), `auto_settings`
(settings left on "auto", chosen at start), `size_checks` (refusing a run that cannot fit), `rundir` (the
run directory's identity), `shared` (what the phases of a run share), `es_loop` and `grpo_loop` (one
step of each method), `train` (the resumable loop over phases), `evaluation` (every measurement of a
model on a task), `callbacks` and `pretrain` (the tiny model's supervised pretraining). The faces (the
command line, the trainers, the study) drive runs through these modules; import them directly.
"""
