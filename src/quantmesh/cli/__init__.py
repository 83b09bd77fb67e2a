"""The `quantmesh` command line: one entry point that launches its own workers."""
