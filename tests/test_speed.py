from __future__ import annotations

import copy

import jsonschema
import pytest
import torch

from distillgates.config import SpeedConfig
from distillgates.data.chat import system_prompt, tool_call_text
from distillgates.model import Transformer
from distillgates.runtime.base import EngineBase
from distillgates.runtime.prompt_cache import prefix_until
from distillgates.runtime.torch_engine import TorchEngine
from distillgates.speed import (
    first_valid_call,
    kv_bytes,
    measure_paired,
    measure_prompt_cache,
    measure_shapes,
    measure_speculative,
    measure_speed,
    percentiles,
    speed_report,
    validate_report,
)
from distillgates.tokenizer import END, train_tokenizer

from .conftest import tiny_model_config

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
HARDWARE = {
    "soc": "x86_64", "os": "Linux", "ram_gb": 8.0, "torch_version": torch.__version__, "coremltools_version": "9.0",
    "export_path": None, "hardware_profile_key": "linux-test",
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    texts = [system_prompt("en") + tool_call_text(CALL), "What is the weather in Paris?"] * 3
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    return Transformer(tiny_model_config(vocab_size=len(tokenizer), max_seq_len=512)).eval()


class ScriptedEngine(EngineBase):
    """Test double for the harness's TTFA path: emits a fixed token script (one-hot logits)."""

    def __init__(self, script: list[int], vocab_size: int) -> None:
        self.script, self.vocab_size, self.step = script, vocab_size, 0

    def _next(self) -> torch.Tensor:
        logits = torch.zeros(self.vocab_size)
        logits[self.script[min(self.step, len(self.script) - 1)]] = 1.0
        self.step += 1
        return logits

    def prefill(self, prompt_ids):
        self.step = 0
        return self._next()

    def decode_step(self, token):
        return self._next()

    def extend(self, token_ids):
        self.step += len(token_ids) - 1
        return self._next()


def test_percentiles_keep_raw_samples():
    out = percentiles([4.0, 1.0, 3.0, 2.0])
    assert out["samples"] == [4.0, 1.0, 3.0, 2.0] and out["p50"] == 2.5
    assert percentiles([]) == {"p50": None, "p90": None, "p95": None, "samples": []}


def test_kv_bytes_formula():
    cfg = tiny_model_config(n_layers=3)  # 2 kv heads of 8 dims
    assert kv_bytes(cfg, 100, 2) == {
        "layers": 3, "kv_heads": 2, "head_dim": 8, "seq_len": 100, "bytes_per_elem": 2, "bytes": 2 * 3 * 2 * 8 * 100 * 2
    }  # fmt: skip


def test_first_valid_call_needs_complete_schema_valid_json():
    body = tool_call_text(CALL)  # <|tool_call|>{...}<|end|>
    cut = body.index("}}") + 2
    texts = ["Sure. ", "Sure. " + body[: cut - 1], "Sure. " + body[:cut], "Sure. " + body]
    assert first_valid_call(texts) == 2
    assert first_valid_call(['<|tool_call|>{"name":"get_weather","arguments":{"town":"Paris"}}']) is None
    assert first_valid_call(["no call here"]) is None


def test_first_valid_call_is_valid_against_the_prompts_own_tools():
    tools = [{"name": "search_files", "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}]  # fmt: skip
    own = [tool_call_text({"name": "search_files", "arguments": {"query": "vpn"}})]
    assert first_valid_call(own) is None  # not a toy registry tool
    assert first_valid_call(own, tools) == 0
    assert first_valid_call([tool_call_text(CALL)], tools) is None  # a toy call is not among these tools


def test_ttfa_from_a_scripted_tool_call(tokenizer):
    script = tokenizer.encode(tool_call_text(CALL), add_special_tokens=False)
    engine = ScriptedEngine(script, len(tokenizer))
    cfg = SpeedConfig(n_prompts=2, warmup=1, repeats=2, max_new_tokens=len(script) + 3)
    mcfg = tiny_model_config(vocab_size=len(tokenizer))
    end_id = tokenizer.convert_tokens_to_ids(END)
    speed = measure_speed(engine, tokenizer, ["hi", "there"], cfg, model_config=mcfg, stop_ids=[end_id])
    # the JSON is complete on the token holding the closing braces, one before <|end|>
    assert speed["ttfa_tokens"]["samples"] == [len(script) - 1] * 4
    assert all(ms > 0 for ms in speed["ttfa_ms"]["samples"])


def test_measure_speed_report_validates(tokenizer, model):
    torch.set_num_threads(1)
    cfg = SpeedConfig(n_prompts=3, warmup=1, repeats=2, max_new_tokens=6)
    prompts = [system_prompt("en") + f"question {i}" for i in range(5)]
    speed = measure_speed(TorchEngine(model), tokenizer, prompts, cfg, model_config=model.config,
                          hardware_profile_key="linux-test")  # fmt: skip
    assert len(speed["ttft_ms"]["samples"]) == 6 and len(speed["tps"]["samples"]) == 6
    for a, b, total in zip(
        speed["tokenizer_ms"]["samples"], speed["first_step_ms"]["samples"], speed["ttft_ms"]["samples"], strict=True
    ):
        assert a + b == pytest.approx(total)
    assert speed["kv_bytes"]["bytes"] == model.config.kv_cache_bytes(512, 4)
    assert speed["ttfa_tokens"]["samples"] == []  # a random model emits no valid call
    assert speed["peak_memory_bytes"] > 10 * 2**20
    report = speed_report(HARDWARE, speed)
    broken = copy.deepcopy(report)
    del broken["speed"]["tps"]
    with pytest.raises(jsonschema.ValidationError, match="tps"):
        validate_report(broken)
    broken = copy.deepcopy(report)
    broken["speed"]["backend"] = "mlx"
    with pytest.raises(jsonschema.ValidationError):
        validate_report(broken)


class RecordingEngine(TorchEngine):
    """The real engine, recording each generation's prompt length and tokens emitted."""

    def __init__(self, model: Transformer) -> None:
        super().__init__(model)
        self.generations: list[list[int]] = []

    def generate(self, prompt_ids, **kwargs):
        self.generations.append([len(prompt_ids), 0])
        for token in super().generate(prompt_ids, **kwargs):
            self.generations[-1][1] += 1
            yield token


def test_per_shape_speed_takes_each_enumerated_shape(tokenizer, model):
    """Each shape's prompt falls in that shape's bucket (above the shape below), decodes its tokens without
    stopping, and is timed ``repeats`` times after one untimed run; the report validates with it."""
    torch.set_num_threads(1)
    engine = RecordingEngine(model)
    end_id = tokenizer.convert_tokens_to_ids(END)
    cfg = SpeedConfig(n_prompts=1, warmup=1, repeats=2, max_new_tokens=6)
    speed = measure_speed(engine, tokenizer, [system_prompt("en") + "question"], cfg, model_config=model.config,
                          stop_ids=[end_id], shapes=[64, 66, 512])  # fmt: skip
    per_shape = speed["per_shape"]
    assert list(per_shape) == ["64", "66", "512"]
    assert [per_shape[k]["prompt_tokens"] for k in per_shape] == [58, 65, 506]  # 65: above the 64 shape
    for key, figures in per_shape.items():
        assert figures["new_tokens"] == 6 and len(figures["ttft_ms"]["samples"]) == len(figures["tps"]["samples"]) == 2
        assert engine.generations.count([figures["prompt_tokens"], 6]) == 3, key  # warm-up + 2, never stopped early
    validate_report(speed_report(HARDWARE, speed))
    # the largest shape in a cache that holds it but not one token more: refused, naming the shape
    with pytest.raises(ValueError, match="shape 512: a 511-token prompt leaves no room in the 511-token cache"):
        measure_shapes(engine, [1, 2, 3], [512], max_seq_len=511, max_new_tokens=1, repeats=1)


def test_prompt_cache_and_speculative_gate_inputs(tokenizer, model):
    end_id = tokenizer.convert_tokens_to_ids(END)
    ids = [tokenizer.encode(system_prompt("en") + f"<|end|><|user|>q{i}", add_special_tokens=False) for i in range(3)]
    engine = TorchEngine(model)
    torch.set_num_threads(2)
    cache = measure_prompt_cache(engine, ids, prefix_until(end_id), repeats=2)
    assert torch.get_num_threads() == 2  # measured on one thread, the caller's setting restored
    assert len(cache["ttft_cold_ms"]) == len(cache["ttft_hit_ms"]) == 6 and cache["hit_rate"] == 1.0
    drafter = TorchEngine(Transformer(model.config).eval())
    spec = measure_speculative(engine, drafter, ids, max_new_tokens=8)
    assert spec["identical"] is True and 0 <= spec["acceptance_rate"] <= 1
    # one rate per prompt drafted for; none rolled back where no verification did
    per_item = spec["rollback_rate_per_item"]
    assert len(per_item) == 3 and all(0 <= r <= 1 for r in per_item)
    assert (max(per_item) > 0) == (spec["rollback_rate"] > 0)
    assert "speedup" not in spec  # timed in speed worker processes (gates.speed_ab.speculative_speedup), never here
    speed = measure_speed(engine, tokenizer, ["x"], SpeedConfig(n_prompts=1, warmup=1, repeats=1, max_new_tokens=3),
                          model_config=model.config)  # fmt: skip
    with pytest.raises(jsonschema.ValidationError, match="tps_plain"):  # a speedup without its samples
        speed_report(HARDWARE, speed, cache, {**spec, "speedup": 1.2})
    timed = {**spec, "speedup": 1.2, "tps_plain": [[100.0] * 8] * 3, "tps_speculative": [[120.0] * 8] * 3}
    validate_report(speed_report(HARDWARE, speed, cache, timed))


def test_paired_speed_decodes_every_prompt_with_both_engines_back_to_back(tokenizer, model):
    """The speculative speedup's samples: one untimed generation of each, then every prompt by both in turn, each
    first on every other prompt (AB BA AB BA), so each follows each as often."""
    order: list[tuple[str, int]] = []

    class Recorded:
        def __init__(self, name: str, engine) -> None:
            self.name, self.engine = name, engine

        def generate(self, ids, **kwargs):
            order.append((self.name, len(ids)))
            yield from self.engine.generate(ids, **kwargs)

    engine = TorchEngine(model)
    prompts = ["a", "a b", "a b c", "a b c d"]
    lengths = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    assert len(set(lengths)) == 4
    got = measure_paired({"plain": Recorded("plain", engine), "speculative": Recorded("speculative", engine)},
                         tokenizer, prompts, max_new_tokens=4)
    assert order == [("plain", lengths[0]), ("speculative", lengths[0]),  # untimed
                     ("plain", lengths[0]), ("speculative", lengths[0]), ("speculative", lengths[1]),
                     ("plain", lengths[1]), ("plain", lengths[2]), ("speculative", lengths[2]),
                     ("speculative", lengths[3]), ("plain", lengths[3])]
    assert [len(got[name]["ttft_ms"]) for name in ("plain", "speculative")] == [4, 4]
    assert all(t > 0 for name in got for t in got[name]["ttft_ms"])
    with pytest.raises(ValueError, match="two engines"):
        measure_paired({"plain": engine}, tokenizer, prompts, max_new_tokens=4)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("warmup", 0, "warmup: 0 would time the first generation, whose first decode compiles"),
    ("max_new_tokens", 1, "max_new_tokens: 1 gives no TPS sample"),
    ("speculative_workers", 2, "speculative_workers: 2 processes cannot decide a speedup"),
    ("speculative_samples", 4, "speculative_samples: 4 samples per process"),
])
def test_speed_settings_too_small_to_decide_anything_are_refused(tmp_path, field, value, message):
    import yaml

    from distillgates.config import ConfigError, load_config
    from distillgates.project import EMBEDDED_CONFIG

    config = yaml.safe_load(EMBEDDED_CONFIG.read_text())
    config["speed"][field] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=rf"{path}:\d+: speed: {message}"):
        load_config(path)
