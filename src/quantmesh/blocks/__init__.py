"""What is done to each repeated block of a model in place.

- compile.py: `compile_blocks`, torch.compile of each block.
- recompute.py: `checkpoint_blocks` (activation checkpointing of all or k blocks) and
  `tile_tokens` (position-wise children run in token tiles).

Nothing is imported here (as in every folder): `qm.compile_blocks` and `qm.checkpoint_blocks`
load their modules on use.
"""
