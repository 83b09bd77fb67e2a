"""Pipeline parallelism over the mesh's pp axis, on torch.distributed.pipelining.

- cut.py: `plan_stages` (whole repeated blocks per stage), `drop_others` (other stages' modules
  become shape-only stand-ins), `PipelineConfig`.
- stage.py: `StageModule`, what one stage runs (the model's own forward, cut at its blocks).
- schedule.py: `PipelineRuntime`, this rank's stages and their schedules (GPipe, 1F1B,
  Interleaved 1F1B).
- parts.py: names other stages hold, the gather of every stage's part of a save.
- memory.py: `estimate_stages`, memory per pp rank under a schedule.
- the training step that runs a pipeline (`qm.train_step`, `eval_loss_sum`) lives in
  train/step.py, beside the training loop that calls it.

Nothing is imported here: `qm.train_step` and `qm.PipelineConfig` load their modules on use.
"""
