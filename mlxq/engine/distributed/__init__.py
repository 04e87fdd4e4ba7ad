"""One worker over several machines through ``mx.distributed``: the MLX side.

- :mod:`~mlxq.engine.distributed.channel`: rank 0's bytes to every rank over the group's
  ``all_sum`` (MLX moves arrays only), with byte counts;
- :mod:`~mlxq.engine.distributed.start`: joining the group (with a deadline) and the
  start-up check that every rank runs the same mlxq and the same model;
- :mod:`~mlxq.engine.distributed.tensor`: loading a model split by heads over the ranks
  (mlx-lm's ``shard()``, tensor parallel);
- :mod:`~mlxq.engine.distributed.lockstep`: rank 0's engine replicates every call that
  changes engine state to the other ranks, which apply it to identical engines.

Pipeline parallel (layers split by rank, micro-batches in flight) is not here yet.
"""
