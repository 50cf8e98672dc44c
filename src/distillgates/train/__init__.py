"""Distillation training: the YAML-driven recipe, late QAT, DDP/FSDP under ``torchrun``.

Import from the submodules (nothing is re-exported here): importing one part of the package
never runs the others, so each pipeline step's code fingerprint covers only what it uses.
"""
