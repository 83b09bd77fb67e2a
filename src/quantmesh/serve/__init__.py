"""`quantmesh serve`: an OpenAI-compatible server over tp ranks, many LoRA adapters on one base.

bank (adapter slots chosen per batch row), engine (the batch every rank decodes), ranks (rank 0's
plan broadcast), scheduler (rank 0's loop), text (released text, stop strings), app (the routes).
The command is quantmesh.cli.serve. Needs the `serve` extra (fastapi, uvicorn, sse-starlette).
"""
