"""Benchmarks: a load generator, a forward-ceiling loop, and an mlxserve vs mlx_lm.server runner.

See ``docs/benchmarks.md`` for the results and the command that produced them.
"""
