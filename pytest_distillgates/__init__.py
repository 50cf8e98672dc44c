"""pytest plugin of distillgates: gate options, markers, fixtures and reports (see plugin.py)."""
