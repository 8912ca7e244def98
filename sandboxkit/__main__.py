"""``python -m sandboxkit``: the command line."""

from sandboxkit.cli import main

raise SystemExit(main())
