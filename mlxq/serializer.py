"""Public path of mlxq's RQ serializer, kept for ``rq info --serializer
mlxq.serializer.JSONSerializer`` and rq-dashboard; the code lives in
:mod:`mlxq.broker.serializer`."""

from mlxq.broker.serializer import JSONSerializer, serializer

__all__ = ["JSONSerializer", "serializer"]
