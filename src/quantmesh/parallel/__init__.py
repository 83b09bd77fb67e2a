"""The mesh and everything that makes one model parallel over it.

- mesh.py: `init_mesh` -> `Mesh` (process groups, the ("dp", "pp", "tp") DeviceMesh).
- empty.py: `empty_model`, a model built with its parameters on meta.
- layersplit.py: `split_layers`, one rank's replica spread over its own devices.
- parallelize.py: `parallelize`, the one ordered pipeline (plan, verify, TP + quant + LoRA, DP).
- verify.py: `verify_plan`, the plan proven exact on a one-block probe.
- state.py: `ParallelState`, what `parallelize` decided, read through `parallel_state(model)`.
- dp.py: `apply_dp`, `no_sync`; fsdp.py: `apply_fsdp` (`parallelize(fsdp=True)`).

Nothing is imported here: the folder spans layers 0 to 4 of docs/design.md, and `import
quantmesh.parallel.mesh` must not load the whole stack. The public names are `qm.init_mesh`,
`qm.parallelize`, ... (quantmesh/__init__.py), each loaded on use.
"""
