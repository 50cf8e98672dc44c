"""int4 per-block QAT: the grid it trains is the export's, bit for bit; straight-through gradients."""

from __future__ import annotations

import pytest
import torch

from distillgates.export.convert import attach_weight_grids
from distillgates.export.errors import ExportError
from distillgates.export.grid import int4_block_grid, quantized_weights
from distillgates.export.layout import build_layout
from distillgates.model import Transformer
from distillgates.train.qat import QAT, Int4Graph

from ..conftest import tiny_model_config

BLOCK = 16


def _qat_trained(steps: int = 3, ema: float = 0.0) -> tuple[QAT, Transformer]:
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=64))
    qat = QAT(model, ema=ema, int4_block=BLOCK)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 64, (2, 12))
    for _ in range(steps):
        logits = qat(idx[:, :-1])  # (B, T, V)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        qat.step()
    final, _meta = qat.finalize()
    return qat, final


def test_int4_qat_weights_are_the_export_grid_bit_for_bit() -> None:
    """The finalized weights are ``code * scale`` of the export's grid; the export, re-quantizing them, writes the
    same scales (so the same codes) and reports every weight as exported as it is."""
    qat, final = _qat_trained()
    core = build_layout(final, "standard")
    names = sorted(quantized_weights(core))
    assert len(names) == 2 * 7  # q k v o gate up down per layer (the tied LM head is the embedding: compress())
    tied = final.lm_head.weight
    assert tied is final.embed.weight and "model.lm_head.weight" in qat.graph.names  # trained on the grid too
    codes, scale = int4_block_grid(tied, BLOCK)
    assert torch.equal((codes * scale[..., None]).reshape(tied.shape), tied.detach())
    for name, (_owner, weight) in quantized_weights(core).items():
        codes, scale = int4_block_grid(weight, BLOCK)
        assert torch.equal((codes * scale[..., None]).reshape(weight.shape), weight.detach()), name
        assert codes.abs().max() <= 7 and torch.equal(scale, scale.half().float()), name
    grids = attach_weight_grids(core, "int4", BLOCK)
    assert sorted(name for name, grid in grids.items() if grid.exact) == names  # no weight re-quantized
    for owner, weight in quantized_weights(core).values():
        stored = getattr(owner, "_COREML_/weight/quantization_scale")
        codes = torch.round(weight.detach().reshape(stored.shape[0], -1, BLOCK) / stored[..., None])  # the converter
        assert torch.equal(codes * stored[..., None], weight.detach().reshape(codes.shape))
    assert not torch.equal(final.layers[0].attn.q_proj.weight, qat.model.layers[0].attn.q_proj.weight)  # snapped


def test_int4_qat_forward_is_the_finalized_model_and_gradients_pass_straight_through() -> None:
    qat, final = _qat_trained(steps=1)
    idx = torch.randint(0, 64, (1, 9))
    torch.testing.assert_close(qat(idx), final(idx), atol=1e-5, rtol=1e-5)
    model = qat.model
    model.zero_grad()
    qat(idx).sum().backward()
    grad = model.layers[0].mlp.down_proj.weight.grad
    assert grad is not None and bool(grad.abs().sum() > 0)  # round() alone has zero gradient
    assert model.embed.weight.grad is not None  # the embedding stays float (not on the grid) and trains
    assert qat.state_dict().keys() == {"ema"}  # the grid is a function of the weights: nothing else to resume


def test_int4_qat_refuses_a_block_that_does_not_divide_the_inputs() -> None:
    model = Transformer(tiny_model_config(vocab_size=64))  # d_model 32
    with pytest.raises(ExportError, match=r"32 input channels are not a multiple of export\.int4_block_size 24"):
        Int4Graph(model, 24)


def test_the_traced_training_forward_computes_gemma3_features() -> None:
    """Gemma 3's scaled embeddings, GeGLU, four norms, attention scale and sliding layers (their own RoPE table and
    window mask) reach the fx-traced QAT graph: the training forward is the model's, and int8 QAT traces it."""
    from distillgates.train.qat import TrainForward

    cfg = tiny_model_config(vocab_size=64, n_layers=3, qk_norm=True, embed_scale=True, activation="gelu_tanh",
                            sandwich_norm=True, query_pre_attn_scalar=12, sliding_window=3,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            rope_local_theta=100.0)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    idx = torch.randint(0, 64, (2, 12))
    assert torch.equal(TrainForward(model)(idx), model(idx))
    out, want = QAT(model)(idx), model(idx)  # int8 fake-quantized weights: close, not equal
    assert torch.nn.functional.cosine_similarity(out.flatten(), want.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("int4_block", [None, BLOCK], ids=["int8", "int4"])
def test_the_split_head_training_forward_is_the_graph_before_its_head(int4_block: int | None) -> None:
    """``train.loss_chunk``'s training forward: the final hidden states and the head's grid weight, whose product is
    the QAT graph's logits; the gradients of every weight (the tied head's through its grid) are the graph's."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(vocab_size=64))
    qat = QAT(model, int4_block=int4_block)
    split = qat.training_forward(split_head=True)
    idx = torch.randint(0, 64, (2, 9))
    grads = []
    for logits_of in (lambda: qat.training_forward()(idx), lambda: torch.nn.functional.linear(*split(idx))):
        model.zero_grad()
        logits = logits_of()
        (logits.square().mean() + logits.logsumexp(-1).mean()).backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (whole, whole_grads), (parts, part_grads) = grads
    torch.testing.assert_close(parts, whole, atol=1e-6, rtol=1e-6)
    assert part_grads.keys() == whole_grads.keys() and "embed.weight" in part_grads  # tied head: embed.weight
    for name, grad in part_grads.items():
        torch.testing.assert_close(grad, whole_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    hidden, head = split(idx)
    assert hidden.shape == (2, 9, model.config.d_model) and head.shape == model.lm_head.weight.shape
    assert not torch.equal(head, model.lm_head.weight)  # the grid's values, not the float weight
    final, _ = qat.finalize()
    torch.testing.assert_close(final.lm_head.weight, head.detach())  # the graph keeps its head: finalize snaps it
