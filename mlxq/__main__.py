"""``python -m mlxq``: the same as the ``mlxq`` command."""

from mlxq.cli.main import main

main()
