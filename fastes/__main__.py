"""`python -m fastes ...` runs the `fastes` command (benchmarks start runs this way, with their python)."""

from fastes.cli import main

raise SystemExit(main())
