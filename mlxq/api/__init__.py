"""OpenAI-compatible Batch HTTP API for mlxq (``mlxq api``).

Modules: ``app`` (routes, error responses, background sweep), ``auth`` (bearer keys),
``uploads`` (multipart with limits), ``store`` (files and batch records in Redis),
``batches`` (lifecycle: validate, submit, progress, cancel, expire), ``cancel``
(cancelling queued RQ jobs), ``validation`` (input files), ``finalize`` (output and error
files), ``mlxq.formats.openai_output`` (Result → OpenAI output line), ``models``
(``/v1/models`` from live workers), ``objects`` (wire objects), ``redis_keys`` and
``command`` (the click command).
"""

from mlxq.api.command import api_command

__all__ = ["api_command"]
