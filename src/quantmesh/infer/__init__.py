"""Generation on a parallelized model.

- decode.py: `fast_decode` / `greedy_decode` (static cache, eager prefill, a compiled step per
  token) and the stacked adapters the prefill finds (`AdapterStack`, `StackedLora`).
- sampling.py: temperature + top-p as a Gumbel-max draw from noise handed in (decode, serve).

Nothing is imported here (as in every folder): `qm.fast_decode` loads its module on use.
"""
