"""`python -m batchpilot` is the same as the `batchpilot` command."""

from batchpilot.cli import main

raise SystemExit(main())
