"""Quantized formats of a linear layer (bitsandbytes by default, torchao as an alternative)."""
