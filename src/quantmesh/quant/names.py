"""The quantization formats and backends by name: the one list of each (torch-free, so the CLI can
offer them cheaply)."""

FORMATS = ("nf4", "fp4", "int8")
BACKENDS = ("bitsandbytes", "torchao")  # the first is the default
QUANTS = ("none", *FORMATS)  # a base's quantization by name: none, or a format
