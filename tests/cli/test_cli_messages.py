"""The lines a newcomer read that misled them, each run as
the user ran it: ``python -m mlxq ...`` against a real Valkey."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import redis

from mlxq.broker import batches
from tests.helpers import Worker, run_mlxq, start_submit


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxq: error: "), res.stderr
    return lines[0]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_redis_url_without_a_scheme_is_a_url_error(tmp_path):
    for args in (("status",), ("worker", "--model", "no/such-model")):
        res = run_mlxq(*args, "--redis-url", "localhost:6379")
        line = _one_error_line(res)
        assert "is not a URL" in line and "redis://localhost:6379" in line, line
        assert "cannot reach" not in line
    hidden = run_mlxq("status", "--redis-url", "user:pw123@localhost:6379")
    assert "pw123" not in hidden.stderr and "redis://***@localhost:6379" in hidden.stderr


def test_the_worker_checks_redis_credentials_before_the_model(tmp_path):
    from mlxq.server import make_server

    server = make_server(data_dir=tmp_path / "valkey")
    server._config.update(requirepass="right")
    server.start()
    try:
        url = server.connection_url.replace("redis://", "redis://:wrong@") + "/0"
        res = run_mlxq("worker", "--model", "no/such-model", "--burst", url=url)
    finally:
        server.stop()
    line = _one_error_line(res)
    assert "refused the credentials" in line and "wrong" not in line


def test_skip_invalid_is_suggested_only_where_it_helps(valkey_url, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_prompt = tmp_path / "q.csv"
    no_prompt.write_text("question\nWhy?\n")
    all_bad = _jsonl(tmp_path / "bad.jsonl", [{"max_tokens": 3}])
    for path in (str(empty), str(no_prompt), all_bad):
        res = run_mlxq("submit", path, url=valkey_url)
        assert res.returncode == 1 and "--skip-invalid" not in res.stderr, res.stderr
        assert "nothing was enqueued" in res.stderr
    _one_error_line(run_mlxq("submit", str(empty), url=valkey_url))
    mixed = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "hi"}, {"max_tokens": 3}])
    res = run_mlxq("submit", mixed, url=valkey_url)
    assert res.returncode == 1 and "or pass --skip-invalid" in res.stderr


def test_a_missing_parquet_file_is_said_not_to_exist(valkey_url, tmp_path):
    res = run_mlxq("submit", str(tmp_path / "nope.parquet"), url=valkey_url)
    line = _one_error_line(res)
    assert "nope.parquet does not exist" in line and "extra" not in line


def test_a_tsv_file_is_read_as_a_tab_separated_table(valkey_url, conn, tmp_path):
    from mlxq.formats.tables import InputOptions, read_input

    tsv = tmp_path / "q.tsv"
    tsv.write_text('id\tprompt\na\tHello, world\nb\tSay "hi"\n')
    parsed = read_input(str(tsv), InputOptions(id_column="id"))
    assert [(r.custom_id, r.prompt) for r in parsed.requests] == [
        ("a", "Hello, world"),
        ("b", 'Say "hi"'),
    ]
    res = run_mlxq("submit", str(tsv), "--id-column", "id", "--queue", "tsv", url=valkey_url)
    assert res.returncode == 0, res.stderr
    assert batches.batch_status(conn, res.stdout.split()[-1]).total == 2


def test_temp_is_temperature(valkey_url, conn, tmp_path):
    from rq.job import Job

    from mlxq.serializer import JSONSerializer

    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    res = run_mlxq("submit", src, "--temp", "0.25", "--queue", "t", url=valkey_url)
    assert res.returncode == 0, res.stderr
    (job_id,) = batches.batch_job_ids(conn, res.stdout.split()[-1])
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert "0.25" in json.dumps(job.args)


def test_log_level_is_one_option_everywhere():
    for command in ("worker", "run", "dashboard"):
        res = run_mlxq(command, "--help")
        assert "--log-level [debug|info|warning|error]" in res.stdout, (command, res.stdout)
    res = run_mlxq("worker", "--log-level", "Verbose")
    assert res.returncode == 2 and "'debug', 'info', 'warning', 'error'" in res.stderr


def _publish_worker(conn: redis.Redis, queue: str) -> None:
    """A live worker on ``queue`` as Redis sees one (busy elsewhere: it takes nothing)."""
    import socket

    from mlxq.broker import fleet
    from mlxq.wire import WorkerInfo

    info = WorkerInfo(
        "busy-1", socket.gethostname(), os.getpid(), "m", [queue], "cpu", "cpu", 2**30, 4,
        0, 0, 4, 0, 0, 0, 0.0, time.time(), time.time(),
    )  # fmt: skip
    fleet.publish(conn, info, ttl=60)


def test_wait_timeout_says_whether_a_worker_serves_the_queue(valkey_url, conn, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    alone = run_mlxq(
        "submit", src, "--queue", "lonely", "--wait", "--timeout", "0.5", url=valkey_url
    )
    line = alone.stderr.strip().splitlines()[-1]
    assert alone.returncode == 1
    assert "0 of 1 done after 0.5s; no live worker serves queue 'lonely'" in line, line
    assert "mlxq worker -q lonely" in line
    _publish_worker(conn, "served")
    served = run_mlxq(
        "submit", src, "--queue", "served", "--wait", "--timeout", "0.5", url=valkey_url
    )
    line = served.stderr.strip().splitlines()[-1]
    assert served.returncode == 1 and "is a worker running" not in served.stderr
    assert "keeps running on 1 live worker(s) of queue 'served' (busy-1)" in line, line
    assert "mlxq results" in line and "--wait" in line


def test_ctrl_c_of_wait_says_the_batch_keeps_running(valkey_url, tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    proc, batch = start_submit(valkey_url, Path(src), "cc", "--wait")
    assert proc.stderr is not None
    for line in proc.stderr:  # the progress bar's label: it is waiting
        if line.strip() == f"batch {batch}":
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Aborted!" not in err, err
    assert "0 of 1 done when interrupted" in last and "mlxq results" in last, last


def test_wait_exits_non_zero_with_the_failure_reasons(tiny_model, valkey_url, conn, tmp_path):
    rows = [{"prompt": "hi", "max_tokens": 2}] + [{"prompt": "hi", "max_tokens": 4000}] * 2
    src = _jsonl(tmp_path / "in.jsonl", rows)
    worker = Worker(valkey_url, tiny_model, "-q", "fails", log=tmp_path / "w.log")
    try:
        worker.wait_listening(conn)
        out = tmp_path / "out.jsonl"
        res = run_mlxq("submit", src, "--queue", "fails", "--wait", "-o", str(out), url=valkey_url)
    finally:
        worker.stop()
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("mlxq: error: 2 of 3 requests failed: 2x "), last
    assert "max_tokens is 4000" in last and f"error lines in {out}" in last
    assert len(out.read_text().splitlines()) == 3


def test_the_time_left_is_labelled_and_follows_recent_progress():
    from mlxq.cli.support import RecentEta

    now = [0.0]
    eta = RecentEta(100, window=60, clock=lambda: now[0])
    assert eta.at(0) is None
    now[0] = 100.0  # a slow start: the model compiles, the first prefill runs
    assert eta.at(10) is None  # one point is no rate
    now[0] = 110.0
    assert eta.at(20) == "about 1m20s left"  # 1/s since the first progress (click: 7m20s)
    for t in range(120, 400, 10):  # then 0.2/s: the first rate leaves the window
        now[0] = float(t)
        text = eta.at(20 + (t - 110) // 5)
    assert text == "about 2m00s left", text  # 24 left at 0.2/s (at 1/s: 24s)


# -- what `mlxq submit` says about where its lines go ----------------------------------------


def _live(conn: redis.Redis, name: str, model: str, queues: list[str]) -> None:
    """A live worker of ``model`` on ``queues`` as it publishes itself (its model is then
    also seen lately)."""
    from mlxq.broker import fleet
    from tests.helpers import worker_record

    now = time.time()
    record = worker_record(name=name, model=model, queues=queues, started_at=now, heartbeat_at=now)
    fleet.publish(conn, record, ttl=60)


def test_a_mistyped_model_flag_warns_and_names_the_models_served(valkey_url, conn, tmp_path):
    _live(conn, "w1", "org/SmolLM2", ["SmolLM2", "default"])
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    res = run_mlxq("submit", src, "--model", "org/Llama-nope", url=valkey_url)
    assert res.returncode == 0, res.stderr
    assert (
        "warning: no live worker serves 1 line naming no model, for --model 'org/Llama-nope' "
        "(queue 'Llama-nope') (live workers serve 'org/SmolLM2' on 'SmolLM2', 'default'); they "
        "wait until one starts"
    ) in res.stderr, res.stderr
    assert "submitted 1 requests to queue 'Llama-nope'" in res.stdout
    good = run_mlxq("submit", src, "--model", "SmolLM2", url=valkey_url)
    assert good.returncode == 0 and "warning" not in good.stderr, good.stderr


def test_lines_naming_no_model_on_a_queue_of_two_models_are_said_to_mix(valkey_url, conn, tmp_path):
    _live(conn, "w1", "org/SmolLM2", ["SmolLM2", "default"])
    _live(conn, "w2", "/models/tiny", ["tiny", "default"])
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": f"p{i}"} for i in range(10)])
    res = run_mlxq("submit", src, url=valkey_url)
    assert res.returncode == 0, res.stderr
    warning = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert warning == [
        "warning: 10 lines naming no model (queue 'default'): its workers run 'org/SmolLM2', "
        "'/models/tiny', so their answers will mix models; --model MODEL pins them to one "
        "model's workers"
    ], res.stderr
    pinned = run_mlxq("submit", src, "--model", "tiny", url=valkey_url)
    assert pinned.returncode == 0 and "warning" not in pinned.stderr, pinned.stderr
    assert "submitted 10 requests to queue 'tiny'" in pinned.stdout


def test_submit_names_the_queues_it_used_in_every_line(valkey_url, conn, tmp_path):
    """The `enqueueing` line and the `submitted` line name the same queues: those the lines
    went to, with how many each when there are several."""
    _live(conn, "w1", "org/SmolLM2", ["SmolLM2", "default"])
    _live(conn, "w2", "/models/tiny", ["tiny", "default"])
    rows = [{"prompt": "a", "model": "SmolLM2"}, {"prompt": "b", "model": "tiny"}, {"prompt": "c"}]
    src = _jsonl(tmp_path / "mixed.jsonl", rows * 10)
    res = run_mlxq("submit", src, url=valkey_url)
    where = "queues 'SmolLM2' (10), 'tiny' (10), 'default' (10)"
    assert f"enqueueing 30 requests to {where} (if this stops" in res.stderr, res.stderr
    assert f"submitted 30 requests to {where} as batch" in res.stdout, res.stdout
    only = _jsonl(tmp_path / "smol.jsonl", rows[:1] * 3)
    typo = run_mlxq("submit", only, "--queue", "typoqueue", url=valkey_url)
    assert "enqueueing 3 requests to queue 'SmolLM2' (if" in typo.stderr, typo.stderr
    assert "submitted 3 requests to queue 'SmolLM2' as batch" in typo.stdout, typo.stdout
    assert "warning" not in typo.stderr and "typoqueue" not in typo.stderr + typo.stdout


def test_a_queue_no_worker_ever_served_warns_and_one_served_lately_is_a_note(
    valkey_url, conn, tmp_path
):
    from mlxq.broker import fleet

    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    typo = run_mlxq("submit", src, "--queue", "typoqueue", url=valkey_url)
    assert (
        "warning: no live worker serves 1 line naming no model (queue 'typoqueue'); they "
        "wait until one starts"
    ) in typo.stderr, typo.stderr
    assert "--ignore-line-models" not in typo.stderr  # (no line names a model)
    _live(conn, "laptop", "org/A", ["nightly"])
    fleet.remove(conn, "laptop")  # asleep: not live, seen a moment ago
    later = run_mlxq("submit", src, "--queue", "nightly", url=valkey_url)
    assert "warning" not in later.stderr, later.stderr
    assert (
        "note: no live worker serves 1 line naming no model (queue 'nightly') now; they wait "
        "for the workers that did, last seen "
    ) in later.stderr, later.stderr
    refused = run_mlxq("submit", src, "--queue", "nightly", "--require-workers", url=valkey_url)
    assert refused.returncode == 1 and "nothing was enqueued" in refused.stderr


def test_a_bad_mlx_evaluation_width_is_refused_before_mlx_hangs_on_it():
    """MLX hangs at its first evaluation on a width that is not a positive whole number:
    a model command refuses it in one line, exit 2."""
    res = run_mlxq("worker", "--help", env={**os.environ, "MLX_BFS_MAX_WIDTH": "0"}, timeout=60)
    assert res.returncode == 2
    assert "MLX_BFS_MAX_WIDTH='0'" in _one_error_line(res)
