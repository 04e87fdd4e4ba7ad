"""``mlxq api``'s keys are tenants: through the official ``openai`` client, one key neither
sees nor touches another key's files and batches (nor their output files); an admin key
sees and manages them all. The keys file's ``KEY admin`` marker, through the command."""

from __future__ import annotations

import openai
import pytest
from api_servers import (
    ADMIN_KEY,
    OTHER_KEY,
    api_client,
    completion_line,
    create,
    run_tiny_worker,
    upload,
    wait_final,
)
from click.testing import CliRunner

from mlxq.api.auth import load_key_roles
from mlxq.cli.api import api_command


def test_a_key_sees_only_its_own_files_and_batches(client, ports, conn, tiny_model):
    other, admin = api_client(ports[0], OTHER_KEY), api_client(ports[1], ADMIN_KEY)
    file_id = upload(client, [completion_line("a", "Hello")])
    batch = create(client, file_id)
    theirs = create(other, upload(other, [completion_line("b", "Hi")]))

    for call in (
        lambda: other.files.retrieve(file_id),
        lambda: other.files.content(file_id),
        lambda: other.files.delete(file_id),
        lambda: create(other, file_id),  # a batch from someone else's file
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError, match="No such"):
            call()
    assert [b.id for b in other.batches.list()] == [theirs.id]
    assert [b.id for b in client.batches.list()] == [batch.id]
    with pytest.raises(openai.BadRequestError, match="No such Batch"):
        other.batches.list(after=batch.id)

    run_tiny_worker(tiny_model, conn)
    done = wait_final(client, batch.id)
    assert done.status == "completed" and done.output_file_id
    assert client.files.content(done.output_file_id).text.count("\n") == 1
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)

    # An admin key sees every tenant's, and may clean up after them.
    assert {b.id for b in admin.batches.list()} == {batch.id, theirs.id}
    assert admin.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert admin.files.delete(file_id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    later = create(other, upload(other, [completion_line("c", "Hey")]))
    assert admin.batches.cancel(later.id).status == "cancelling"
    assert wait_final(other, later.id).status == "cancelled"


def test_keys_file_marks_admin_keys(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nsk-team-1\n\nsk-ops admin\n")
    roles = load_key_roles(keys, env={"MLXQ_API_KEYS": "sk-team-2", "MLXQ_API_ADMIN_KEYS": "sk-x"})
    assert roles == {"sk-team-2": False, "sk-x": True, "sk-team-1": False, "sk-ops": True}
    keys.write_text("sk-team-1 superuser\n")
    out = CliRunner().invoke(api_command, ["--keys-file", str(keys)], env={"MLXQ_API_KEYS": ""})
    assert out.exit_code == 2
    assert "line 1: expected `KEY` or `KEY admin`" in out.output
