"""distillgates: distill LLMs into fast Apple-silicon students, gated in CI."""

__version__ = "0.1.0"
