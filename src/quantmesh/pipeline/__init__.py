"""Pipeline parallelism over the mesh's pp axis, on torch.distributed.pipelining.

- cut.py: `plan_stages` (whole repeated blocks per stage), `drop_others` (other stages' modules
  become shape-only stand-ins), `PipelineConfig`.
- stage.py: `StageModule`, what one stage runs (the model's own forward, cut at its blocks).
- schedule.py: `PipelineRuntime`, this rank's stage and its schedules (GPipe, 1F1B).
- step.py: `train_step`, one training step for every layout (pipelined at pp > 1).

Nothing is imported here: `qm.train_step` and `qm.PipelineConfig` load their modules on use.
"""
