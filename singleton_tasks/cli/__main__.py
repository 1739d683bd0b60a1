"""``python -m singleton_tasks.cli``: the ``singleton-tasks`` command."""

from . import main

main()
