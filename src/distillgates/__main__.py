"""``python -m distillgates``: the ``distillgates`` command."""

from distillgates.cli import main

raise SystemExit(main())
