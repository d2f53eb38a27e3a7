"""``python -m polygateway``: the ``pgw`` command line."""

from polygateway.cli import main

raise SystemExit(main())
