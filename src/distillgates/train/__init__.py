"""Distillation training: the YAML-driven recipe, late QAT, DDP/FSDP under ``torchrun``."""

from distillgates.train.recipe import Recipe, add_parser, main, run, train_student

__all__ = ["Recipe", "add_parser", "main", "run", "train_student"]
