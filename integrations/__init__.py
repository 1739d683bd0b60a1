"""Real applications, a fault-injecting scenario runner and an invariant checker (issue 5).

- :mod:`integrations.dramatiq_app`, :mod:`integrations.celery_app`: small apps with singleton tasks
  of different limits and a plain task, configured from ``INTEGRATION_*`` environment variables.
- :mod:`integrations.runlog`: the append-only PostgreSQL log every body writes (start, then end).
- :mod:`integrations.runner`: starts real worker processes, drives load, injects faults.
- :mod:`integrations.checker`: the six invariants over one logged run
  (``python -m integrations.checker --run ID``).
- ``integrations/tests``: the scenarios as pytest tests (marker ``workers``).
"""
