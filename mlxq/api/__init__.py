"""OpenAI-compatible Batch HTTP API for mlxq (``mlxq api``) and the live dashboard.

Modules: ``app`` (routes, error responses, background sweep), ``serving`` (uvicorn, with
idle and slow connections closed), ``auth`` (bearer keys), ``uploads`` (multipart with
limits), ``store`` and ``redis_keys`` (files and batch records in Redis), ``batches``
(lifecycle: validate, submit, progress, cancel, expire), ``validation`` (input files),
``finalize`` (output and error files), ``models`` (``/v1/models``), ``objects`` and
``errors`` (wire objects), ``dashboard`` and its ``dashboard_*`` parts. The ``mlxq api``
command itself is :mod:`mlxq.cli.api`.
"""
