"""The quantization formats by name: the one list (torch-free, so the CLI can offer it cheaply)."""

FORMATS = ("nf4", "fp4", "int8")
