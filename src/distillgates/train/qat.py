"""Late quantization-aware training: int8 per-channel or int4 per-block weights, float activations.

The grid is the one the export writes (``export.quantize``, :attr:`Config.student_qat_int4_block`).

int4 per block: ``LinearQuantizer`` has ``qint4`` but no per-block granularity, so :class:`Int4Graph`
fake-quantizes the weights the export quantizes (:func:`~distillgates.export.convert.quantized_weights`)
with the export's own grid (:func:`~distillgates.export.convert.fake_quantize_int4`: symmetric, one
fp16 scale per ``export.int4_block_size`` input channels, codes in [-7, 7]) and a straight-through
gradient, through ``torch.func.functional_call`` on :class:`TrainForward`: the model's parameters
and state dict stay as they are, so checkpoints and resume are unchanged. The finalized weights
are ``code * scale`` in fp32, from which the export recomputes the same codes and scales: the
package holds exactly the QAT grid. A tied LM head is fake-quantized too and its grid values are
written back to the shared matrix (the embedding then holds them, as with int8); the export
quantizes that head with coremltools' per-block pass (the same ``max|block| / 7``, computed in
fp16), which gives back the same codes with the scale within an fp16 ulp.

int8 per channel uses ``coremltools.optimize.torch.quantization.LinearQuantizer`` (prepare / step / finalize),
the quantizer whose finalized modules the Core ML converter understands. Two details make it
serve our :class:`~distillgates.model.Transformer`:

- ``LinearQuantizer.prepare`` symbolically traces the module with ``torch.fx``. Tracing
  ``Transformer.forward`` directly turns the optional ``input_pos``/``attention_mask``
  arguments into graph inputs (so the KV-cache branch gets traced) and slices the RoPE tables
  with a traced length (``rope_cos[:T]`` fails with a Proxy). :class:`TrainForward` is the
  training forward written against the model's own submodules, with the two table slices as
  ``torch.fx.wrap`` leaf functions, so the traced graph is exactly the no-cache training path
  and shares every parameter with the model.
- Embeddings are excluded (``module_type_configs: Embedding: None``): Core ML int8 export
  quantizes linear weights, and a QAT embedding would also break the weight tying of
  ``lm_head`` (it copies its weight). With tied embeddings the ``lm_head`` fake-quantizes the
  shared matrix, and the snapped weights are written back to it, so the exported int8
  ``lm_head`` and the embedding table hold the same grid values.

Weights use a ``min_max`` observer (symmetric per output channel): the range only grows, so
the final weights (EMA or not) are never clipped by a lagging moving average.
After training, :func:`QAT.finalize` runs ``finalize`` and writes the dequantized int8 grid
weights (``get_weight()`` of the reference modules) into a plain ``Transformer``; re-quantizing
those with symmetric per-channel int8 at export is lossless.
"""

from __future__ import annotations

import copy
import math
from typing import Any, cast

import torch
from torch import Tensor, nn

from distillgates.model import Transformer


@torch.fx.wrap
def _rope_rows(table: Tensor, n: int) -> Tensor:
    return table[:n]  # (T, hd)


@torch.fx.wrap
def _causal(table: Tensor, n: int) -> Tensor:
    return table[:n, :n][None, None]  # (1, 1, T, T)


class TrainForward(nn.Module):
    """The no-cache training forward of a Transformer, fx-traceable (module docstring); ``split_head``: the final
    hidden states and the head's weight instead of the logits (``Transformer.forward``'s ``split_head``)."""

    def __init__(self, model: Transformer, split_head: bool = False) -> None:
        super().__init__()
        self.model, self.split_head = model, split_head

    def forward(self, idx: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        m = self.model
        T = idx.shape[1]
        inputs = {False: (_rope_rows(m.rope_cos, T), _rope_rows(m.rope_sin, T), _causal(m.causal_mask, T))}
        if m.has_sliding_layers:  # Gemma 3: their own RoPE table and window mask
            inputs[True] = (_rope_rows(m.local_rope_cos, T), _rope_rows(m.local_rope_sin, T),
                            _causal(m.local_causal_mask, T))  # fmt: skip
        x = m.embed_tokens(idx)  # (B, T, d)
        for i, layer in enumerate(m.layers):
            x = layer(x, *inputs[m.config.sliding(i)], None)
        if self.split_head:
            return m.norm(x), m.lm_head.weight
        return m.lm_head(m.norm(x))  # (B, T, V)


def quantizer_config() -> Any:
    from coremltools.optimize.torch.quantization import LinearQuantizerConfig

    return LinearQuantizerConfig.from_dict(
        {
            "global_config": {
                "quantization_scheme": "symmetric",
                "weight_dtype": "qint8",
                "weight_per_channel": True,
                "weight_observer": "min_max",
                "activation_dtype": "float32",  # weights-only: activations stay float (fp16 on device)
                "milestones": [0, 0, -1, -1],  # observers and fake quant on from the first QAT step
            },
            "module_type_configs": {"Embedding": None},
        }
    )


class Int4Graph(nn.Module):
    """:class:`TrainForward` with every exported linear weight fake-quantized to the export's int4 per-block grid."""

    def __init__(self, model: Transformer, block_size: int, split_head: bool = False) -> None:
        from distillgates.export.grid import quantized_weights

        super().__init__()
        self.model, self.block_size = TrainForward(model, split_head), block_size
        self.names = list(quantized_weights(self.model))  # model.layers.0.attn.q_proj.weight, ...
        if "model.lm_head.weight" not in self.names:  # a tied head: the embedding's matrix, trained on the grid too
            self.names.append("model.lm_head.weight")
        self.snapped()  # a block size that does not divide a layer's inputs fails here, not at the first step

    def snapped(self) -> dict[str, Tensor]:
        from distillgates.export.grid import fake_quantize_int4

        return {name: fake_quantize_int4(self.model.get_parameter(name), self.block_size) for name in self.names}

    def forward(self, idx: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return cast("Tensor | tuple[Tensor, Tensor]", torch.func.functional_call(self.model, self.snapped(), (idx,)))


def split_head_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The prepared int8 graph stopped before its LM head: ``idx -> (final hidden states, the head's fake-quantized
    weight)``, what the head computes from (``F.linear(x, weight_fake_quant(weight))``). It shares every module
    (parameters, observers) with ``graph``, which keeps the head for ``finalize``."""
    g = copy.deepcopy(graph.graph)
    out = next(n for n in g.nodes if n.op == "output")
    head = out.args[0]
    if not (isinstance(head, torch.fx.Node) and head.op == "call_module" and head.target == "model.lm_head"):
        raise RuntimeError(f"the QAT graph does not end in its LM head (its output is {head})")
    with g.inserting_before(out):
        grid = g.call_module("model.lm_head.weight_fake_quant", (g.get_attr("model.lm_head.weight"),))
    out.args = ((head.args[0], grid),)
    g.erase_node(head)
    return torch.fx.GraphModule(graph, g)


class QAT:
    """Prepared QAT graph sharing parameters with ``model``; optional EMA of the weights.

    ``int4_block`` None: int8 per channel (coremltools' ``LinearQuantizer``); else int4 per block of
    that many input channels (:class:`Int4Graph`).
    """

    def __init__(self, model: Transformer, ema: float = 0.0, int4_block: int | None = None) -> None:
        from coremltools.optimize.torch.quantization import LinearQuantizer

        self.model = model
        self.quantizer: Any = None
        self.graph: nn.Module
        if int4_block is not None:
            self.graph = Int4Graph(model, int4_block)
        else:
            self.quantizer = LinearQuantizer(TrainForward(model), quantizer_config())
            example = torch.zeros(1, 8, dtype=torch.long, device=model.embed.weight.device)
            self.graph = self.quantizer.prepare(example_inputs=(example,), inplace=True)
            self.quantizer.step()  # milestone 0: enable observers and fake quantization
            assert self.graph.get_submodule("model.layers.0.attn.q_proj").weight is model.layers[0].attn.q_proj.weight
        self.ema_decay = ema
        self.ema = {k: v.detach().clone() for k, v in model.named_parameters()} if ema > 0 else None

    def __call__(self, idx: Tensor) -> Tensor:
        return cast(Tensor, self.graph(idx))

    def training_forward(self, split_head: bool = False) -> nn.Module:
        """The module a training step calls: ``idx -> logits``, or with ``split_head`` ``idx -> (final hidden states,
        the head's weight on the grid)`` (``train.loss_chunk``: the loss applies the head a chunk at a time)."""
        if not split_head:
            return self.graph
        if isinstance(self.graph, Int4Graph):
            return Int4Graph(self.model, self.graph.block_size, split_head=True)
        return split_head_graph(cast(torch.fx.GraphModule, self.graph))

    @torch.no_grad()
    def step(self) -> None:
        """After each optimizer step: advance the quantizer milestones and the EMA."""
        if self.quantizer is not None:
            self.quantizer.step()
        if self.ema is not None:
            for name, p in self.model.named_parameters():
                self.ema[name].lerp_(p.detach(), 1.0 - self.ema_decay)

    def state_dict(self) -> dict[str, Any]:
        if self.quantizer is None:  # int4: no observers, the grid is a function of the weights
            return {"ema": self.ema}
        return {"graph": self.graph.state_dict(), "ema": self.ema, "step_count": self.quantizer._step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]
        if self.quantizer is not None:
            self.graph.load_state_dict(state["graph"])
            self.quantizer._step_count = state["step_count"]  # milestones are step-counted

    @torch.no_grad()
    def finalize(self) -> tuple[Transformer, dict[str, Any]]:
        """A plain Transformer holding the grid weights, and per-module quantization metadata."""
        if self.ema is not None:
            for name, p in self.model.named_parameters():
                p.copy_(self.ema[name])
        if isinstance(self.graph, Int4Graph):
            out = copy.deepcopy(self.model)
            snapped = self.graph.snapped()
            for name in self.graph.names:
                out.get_parameter(name.removeprefix("model.")).copy_(snapped[name])  # code * fp16 scale
            modules = [name.removeprefix("model.").removesuffix(".weight") for name in self.graph.names]
            return out, {"scheme": "int4_per_block_symmetric", "block_size": self.graph.block_size,
                         "activations": "float", "modules": {name: {} for name in modules}}  # fmt: skip
        final = self.quantizer.finalize(self.graph, inplace=False)
        out = copy.deepcopy(self.model)
        meta: dict[str, Any] = {"scheme": "int8_per_channel_symmetric", "activations": "float", "modules": {}}
        for name, module in final.named_modules():
            if hasattr(module, "get_weight") and name.startswith("model."):
                target = out.get_submodule(name.removeprefix("model."))
                cast(Tensor, target.weight).copy_(module.get_weight())  # dequantized int8 grid values
                meta["modules"][name.removeprefix("model.")] = {"scale": module.weight_scale.detach().cpu().tolist()}
        return out, meta


class _CosineSums:
    """Running float64 sums of a*b, a*a and b*b over flattened outputs: a cosine over any number of
    tokens without keeping the outputs (float32 sums over ~1e8 products drift past 1 at 135M)."""

    def __init__(self) -> None:
        self.dot = self.aa = self.bb = 0.0
        self.finite = True

    def add(self, a: Tensor, b: Tensor) -> None:
        a, b = a.detach().double().flatten(), b.detach().double().flatten()
        self.finite = self.finite and bool(torch.isfinite(b).all())
        self.dot += float(a @ b)
        self.aa += float(a @ a)
        self.bb += float(b @ b)

    @property
    def cosine(self) -> float:
        if self.aa == 0.0 or self.bb == 0.0:
            return 1.0 if self.aa == self.bb else 0.0
        return min(1.0, max(-1.0, self.dot / math.sqrt(self.aa * self.bb)))  # |rounding| only: Cauchy-Schwarz


def _probed_modules(model: Transformer) -> dict[str, nn.Module]:
    return {f"layers.{i}.{part}": getattr(layer, part) for i, layer in enumerate(model.layers)
            for part in ("attn", "mlp")}  # fmt: skip


@torch.no_grad()
def probe(reference: Transformer, quantized: Transformer, batches: list[Tensor]) -> dict[str, Any]:
    """Cosine similarity of every attention/MLP output (and the logits), reference vs quantized.

    Each module's outputs over all probe tokens count as one vector per model. The models run one
    row at a time and each quantized output is compared as soon as it exists (float64 sums,
    :class:`_CosineSums`), so the probe holds one row's reference outputs, never all of them: its
    memory is a forward of one row, whatever the model and vocabulary. NaNs or infs anywhere in
    the quantized outputs set ``has_nan``.
    """
    names = list(_probed_modules(reference))
    sums = {name: _CosineSums() for name in [*names, "logits"]}
    stored: dict[str, Tensor] = {}

    def keep(name: str) -> Any:
        return lambda _m, _a, y: stored.__setitem__(name, y)

    def compare(name: str) -> Any:
        return lambda _m, _a, y: sums[name].add(stored.pop(name), y)

    hooks = [m.register_forward_hook(keep(n)) for n, m in _probed_modules(reference.eval()).items()]
    hooks += [m.register_forward_hook(compare(n)) for n, m in _probed_modules(quantized.eval()).items()]
    try:
        for batch in batches:
            for row in batch.split(1):  # (1, T): one row's activations at a time
                ref_logits = reference(row)
                sums["logits"].add(ref_logits, quantized(row))
                del ref_logits
    finally:
        for hook in hooks:
            hook.remove()
    modules = {name: sums[name].cosine for name in names}
    return {
        "probe_cosine_min": min(modules.values()) if modules else float("nan"),
        "probe_cosine": modules,
        "logits_cosine": sums["logits"].cosine,
        "has_nan": not all(s.finite for s in sums.values()),
    }
