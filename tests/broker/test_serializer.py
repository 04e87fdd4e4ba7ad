"""The RQ serializer never unpickles: a malicious pickle is just undecodable bytes."""

import os
import pickle

import pytest

from mlxq.broker.serializer import serializer


class Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/mlxq-pwned",))


def test_roundtrips_plain_data():
    data = ("mlxq.jobs.generate", None, ({"prompt": "x", "max_tokens": 3},), {})
    assert serializer.loads(serializer.dumps(data)) == [data[0], None, [data[2][0]], {}]


def test_refuses_a_real_malicious_pickle(tmp_path):
    if os.path.exists("/tmp/mlxq-pwned"):
        os.remove("/tmp/mlxq-pwned")
    with pytest.raises(Exception, match="malformed"):
        serializer.loads(pickle.dumps(Boom()))
    assert not os.path.exists("/tmp/mlxq-pwned")


def test_rq_takes_it_as_is_and_finds_it_by_its_import_path():
    """RQ checks the serializer against its protocol on every job and records a worker's
    serializer by import path: both must give back this very object."""
    from rq.serializers import resolve_serializer
    from rq.utils import import_attribute

    assert resolve_serializer(serializer) is serializer
    assert import_attribute(f"{serializer.__module__}.{serializer.__qualname__}") is serializer
