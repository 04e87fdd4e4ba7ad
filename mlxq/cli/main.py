"""The ``mlxq`` command line: the click group, the commands it assembles (each in its own
module of ``mlxq.cli``) and the console entry point."""

from __future__ import annotations

import os
import sys
import traceback

import click

from mlxq.cli.api import api_command
from mlxq.cli.control import cancel, retry
from mlxq.cli.dashboard import dashboard
from mlxq.cli.fleet import workers
from mlxq.cli.make_model import make_model_cmd
from mlxq.cli.results import results
from mlxq.cli.run import run
from mlxq.cli.server import server
from mlxq.cli.status import status
from mlxq.cli.submit import submit
from mlxq.cli.support import fail
from mlxq.cli.tail import tail
from mlxq.cli.worker import worker
from mlxq.errors import StartupError

MODEL_COMMANDS = {"worker", "run", "make-model"}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="mlxq")
def cli() -> None:
    """Batch LLM inference on Macs: JSONL prompts in, results out, through Redis queues.

    \b
    Quick start, all local (embedded Valkey, nothing else to run):
      mlxq make-model models/tiny --preset tiny
      mlxq run prompts.jsonl --model models/tiny -o results.jsonl
    Across machines: `mlxq server` (or any Redis), `mlxq worker --model M` on each Mac,
    `mlxq submit prompts.jsonl --wait -o results.jsonl` from anywhere.
    """


for command in (
    worker,
    run,
    server,
    make_model_cmd,
    submit,
    results,
    status,
    cancel,
    retry,
    tail,
    workers,
    dashboard,
):
    cli.add_command(command)
cli.add_command(api_command, name="api")


def _debug_requested(argv: list[str]) -> bool:
    """Whether the command line asks for ``--log-level debug`` (tracebacks included)."""
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--log-level=") else None
        if arg == "--log-level" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.upper() == "DEBUG":
            return True
    return False


def _run_cli() -> None:
    """Run the command; a start-up failure becomes one line on stderr and exit 1."""
    try:
        cli(standalone_mode=True)
    except StartupError as e:
        if _debug_requested(sys.argv):
            traceback.print_exc()
        fail(str(e), e.exit_code)


def main() -> None:
    """Console entry point: for model commands, Linux CPU MLX with OpenBLAS and in MLX's
    wide evaluation order (:mod:`mlxq.engine.eval_order`), set before anything evaluates."""
    runs_mlx = len(sys.argv) > 1 and sys.argv[1] in MODEL_COMMANDS
    if runs_mlx:
        from mlxq.engine.blas import reexec_with_openblas
        from mlxq.engine.eval_order import widen
        from mlxq.engine.hardware import backend_name

        reexec_with_openblas()
        try:
            widen(backend_name())
        except ValueError as e:
            fail(str(e), 2)
    try:
        _run_cli()
    except SystemExit as e:
        if not runs_mlx:
            raise
        # Everything is written and closed by now. Skip interpreter teardown: MLX's C++
        # threads can abort the process ("terminate called without an active exception")
        # when static destructors race them, turning a clean exit into SIGABRT.
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
