"""``python -m distillgates.train CONFIG --run-dir DIR`` (the ``torchrun`` entry point)."""

from distillgates.train.recipe import main

raise SystemExit(main())
