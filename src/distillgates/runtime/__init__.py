"""Generation runtime: one engine protocol, a PyTorch (fused decoder) and a Core ML engine, prompt cache,
speculative decoding, constrained JSON decoding and the batch policy."""

from distillgates.runtime.base import Engine, EngineBase, LogitsProcessor, sample_token
from distillgates.runtime.batch_policy import BatchMeasurement, decide_batch_size, measure_batches
from distillgates.runtime.decoder import FusedDecoder
from distillgates.runtime.prompt_cache import PromptCache, PromptCachedEngine, prefix_until
from distillgates.runtime.speculative import SpeculativeDecoder, SpeculativeStats
from distillgates.runtime.torch_engine import TorchEngine

__all__ = [
    "BatchMeasurement",
    "Engine",
    "EngineBase",
    "FusedDecoder",
    "LogitsProcessor",
    "PromptCache",
    "PromptCachedEngine",
    "SpeculativeDecoder",
    "SpeculativeStats",
    "TorchEngine",
    "decide_batch_size",
    "measure_batches",
    "prefix_until",
    "sample_token",
]
