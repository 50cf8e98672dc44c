"""Teachers for distillation: a local Hugging Face model, an OpenAI-compatible HTTP API, the
loopback server that fronts a local model, and the KD-set builder that queries either.

Modules: :mod:`.local` (LocalTeacher), :mod:`.http` (HTTPTeacher), :mod:`.server`
(TeacherServer), :mod:`.kd` (build_kd_set / read_kd_set), :mod:`.toy` (toy teacher recipe),
:mod:`.cli` (``distillgates teacher ...``). Imports stay lazy: ``import distillgates.teacher``
does not load torch or transformers.
"""
