"""Tensor parallelism: autograd collectives, parallel layers, apply_tp."""
