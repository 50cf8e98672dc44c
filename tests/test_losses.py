"""Losses: KD agreement/scaling, length gradient direction, early-tool gating and ramp, coverage."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from distillgates import losses

from .conftest import largest_tensor

V = 11
ASSISTANT, END, TOOL_CALL = 5, 8, 6


def _logits(B: int = 2, T: int = 5, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g) * scale


@pytest.mark.parametrize("kind", losses.KD_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_topk_equals_dense_when_k_is_vocab(kind: str, temperature: float) -> None:
    s, t = _logits(seed=1), _logits(seed=2)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    dense = losses.kd_loss_dense(s, t, mask, kind, temperature)
    t_logp = F.log_softmax(t, -1)
    order = torch.randperm(V)  # top-k order does not matter
    ids = order.expand(2, 5, V).contiguous()
    sparse = losses.kd_loss_topk(s, ids, t_logp.gather(-1, ids), mask, kind, temperature)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-4)


@given(k=st.integers(1, V - 1), seed=st.integers(0, 10_000))
@settings(max_examples=25, deadline=None)
def test_topk_kd_is_nonnegative_and_zero_at_match(k: int, seed: int) -> None:
    t = _logits(seed=seed)
    t_logp = F.log_softmax(t, -1)
    vals, ids = t_logp.topk(k, -1)
    mask = torch.ones(2, 5)
    for kind in losses.KD_KINDS:
        same = losses.kd_loss_topk(t, ids, vals, mask, kind)
        other = losses.kd_loss_topk(_logits(seed=seed + 1), ids, vals, mask, kind)
        assert abs(float(same)) < 1e-5, (kind, float(same))
        assert float(other) > 0


def test_topk_rest_bucket_penalises_mass_outside_topk() -> None:
    """A student that matches the teacher's top-k *ratios* but moves the rest mass still pays."""
    t_logp = torch.log(torch.tensor([0.5, 0.3, 0.2, 0.0 + 1e-12]))[None, None].expand(1, 1, 4)
    ids = torch.tensor([[[0, 1]]])
    vals = t_logp[..., :2]  # mass 0.8, rest 0.2
    student_same_rest = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))[None, None]
    student_no_rest = torch.log(torch.tensor([0.625, 0.375, 1e-9, 1e-9]))[None, None]  # same ratio, no rest
    mask = torch.ones(1, 1)
    good = losses.kd_loss_topk(student_same_rest, ids, vals, mask)
    bad = losses.kd_loss_topk(student_no_rest, ids, vals, mask)
    assert float(good) < 1e-6 and float(bad) > 0.1


def test_kd_temperature_squared_scaling() -> None:
    s, t = _logits(seed=3), _logits(seed=4)
    mask = torch.ones(2, 5)
    T = 3.0
    raw = (F.softmax(t / T, -1) * (F.log_softmax(t / T, -1) - F.log_softmax(s / T, -1))).sum(-1).mean()
    torch.testing.assert_close(losses.kd_loss_dense(s, t, mask, "forward", T), raw * T * T)


def test_kd_gradient_moves_student_toward_teacher() -> None:
    s = _logits(seed=5).requires_grad_(True)
    t = _logits(seed=6)
    mask = torch.ones(2, 5)
    for kind in losses.KD_KINDS:
        loss = losses.kd_loss_dense(s, t, mask, kind, 2.0)
        (grad,) = torch.autograd.grad(loss, s)
        assert grad.abs().sum() > 0
        after = losses.kd_loss_dense(s - 0.5 * grad, t, mask, kind, 2.0)
        assert float(after.detach()) < float(loss.detach()), kind


def test_masked_positions_get_no_gradient() -> None:
    s = _logits().requires_grad_(True)
    mask = torch.zeros(2, 5)
    mask[0, 1] = 1
    losses.kd_loss_dense(s, _logits(seed=9), mask).backward()
    assert s.grad is not None and s.grad[1].abs().sum() == 0 and s.grad[0, 1].abs().sum() > 0
    # nothing masked in: exactly zero, still differentiable
    empty = losses.ce_loss(s, torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5))
    assert float(empty) == 0.0 and empty.requires_grad


def test_process_loss_only_at_span_positions() -> None:
    s = _logits().requires_grad_(True)
    targets = torch.randint(0, V, (2, 5))
    span = torch.zeros(2, 5)
    span[0, 2:4] = 1
    loss = losses.process_loss(s, targets, span)
    expected = F.cross_entropy(s[0, 2:4], targets[0, 2:4])
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert s.grad is not None and s.grad[:, [0, 1, 4]].abs().sum() == 0


# --------------------------------------------------------------------------------------
# length


def test_turn_masks_find_assistant_turns() -> None:
    # bos sys x end asst a b tool_call c end tool_result r end asst d end eos   (asst=5 end=8)
    ids = torch.tensor([[0, 3, 20, 8, 5, 21, 22, 6, 23, 8, 7, 24, 8, 5, 25, 8, 1, 5, 26]])
    mask, start = losses.turn_masks(ids, ASSISTANT, END)
    assert mask[0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 13, 14]  # last turn is unclosed
    assert start[0].nonzero().flatten().tolist() == [4, 13]


def test_expected_length_closed_form() -> None:
    h, n, tail = 0.2, 6, 10.0
    stop = torch.full((1, n), h)
    mask = torch.ones(1, n, dtype=torch.bool)
    start = torch.zeros(1, n, dtype=torch.bool)
    start[0, 0] = True
    got = losses.expected_length(stop, mask, start, torch.tensor([tail]))
    want = sum((1 - h) ** t for t in range(n)) + (1 - h) ** n * tail
    assert math.isclose(float(got), want, rel_tol=1e-5)
    # two turns restart survival independently
    start2 = start.clone()
    start2[0, 3] = True
    got2 = losses.expected_length(stop, mask, start2, torch.tensor([tail]))
    want2 = 2 * (sum((1 - h) ** t for t in range(3)) + (1 - h) ** 3 * tail)
    assert math.isclose(float(got2), want2, rel_tol=1e-5)


def _length_case(needs: bool, teacher_len: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[3, 20, 8, 5, 21, 22, 23, 24, 25, 8]])  # one assistant turn of 6 positions
    logits = torch.zeros(1, ids.shape[1], V, requires_grad=True)
    mask, start = losses.turn_masks(ids, ASSISTANT, END)
    stop = losses.stop_probability(logits.log_softmax(-1), [END])
    loss, _ = losses.length_loss(
        stop, mask, start, torch.tensor([teacher_len]), torch.tensor([needs]), hinge=0.15, max_new_tokens=32
    )
    return loss, logits


def test_length_loss_gradient_raises_stop_probability() -> None:
    loss, logits = _length_case(needs=True)
    assert float(loss) > 0
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().sum() > 0
    stepped = (logits - 1.0 * grad).detach()
    before = logits.detach().softmax(-1)[0, 3:9, END]
    after = stepped.softmax(-1)[0, 3:9, END]
    assert bool((after > before).all()), (before, after)  # every turn position now stops more often
    loss_after, _ = losses.length_loss(
        losses.stop_probability(stepped.log_softmax(-1), [END]),
        *losses.turn_masks(torch.tensor([[3, 20, 8, 5, 21, 22, 23, 24, 25, 8]]), ASSISTANT, END),
        torch.tensor([3.0]), torch.tensor([True]), hinge=0.15, max_new_tokens=32,
    )
    assert float(loss_after) < float(loss)


def test_length_loss_exempt_when_coverage_met_or_within_hinge() -> None:
    loss, logits = _length_case(needs=False)
    assert float(loss) == 0.0
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad.abs().sum() == 0
    long_teacher, _ = _length_case(needs=True, teacher_len=200.0)  # student shorter than teacher
    assert float(long_teacher) == 0.0


def test_length_loss_slope_and_cap() -> None:
    """The penalty is ``slope`` times the hinged excess; a row over ``cap`` adds the cap and no gradient."""
    ids = torch.tensor([[3, 20, 8, 5, 21, 22, 23, 24, 25, 8]] * 2)
    logits = torch.zeros(2, ids.shape[1], V, requires_grad=True)
    mask, start = losses.turn_masks(ids, ASSISTANT, END)
    stop = losses.stop_probability(logits.log_softmax(-1), [END])
    needs = torch.tensor([True, True])

    def loss(teacher_len: list[float], **kw: float) -> torch.Tensor:
        return losses.length_loss(stop, mask, start, torch.tensor(teacher_len), needs, hinge=0.15, max_new_tokens=32,
                                  **kw)[0]

    plain = loss([3.0, 14.0])
    assert float(loss([3.0, 14.0], slope=2.5)) == pytest.approx(2.5 * float(plain))
    # row 0 (target 3) is far over a cap of 0.5, row 1 (target 14) under it: row 0 adds 0.5 and no gradient
    capped, row1 = loss([3.0, 14.0], cap=0.5), loss([1e9, 14.0])
    assert 0 < float(row1) * 2 < 0.5 and float(capped) == pytest.approx(0.25 + float(row1))
    (g_capped,) = torch.autograd.grad(capped, logits, retain_graph=True)
    (g_row1,) = torch.autograd.grad(row1, logits, retain_graph=True)
    assert g_capped[0].abs().sum() == 0 and g_capped[1].abs().sum() > 0
    torch.testing.assert_close(g_capped, g_row1)


def test_length_loss_grad_mask_keeps_stops_before_evidence_untouched() -> None:
    ids = torch.tensor([[3, 20, 8, 5, 21, 22, 23, 24, 25, 8]])
    logits = torch.zeros(1, ids.shape[1], V, requires_grad=True)
    mask, start = losses.turn_masks(ids, ASSISTANT, END)
    grad_mask = torch.arange(ids.shape[1])[None] > 5  # evidence ends at position 5
    loss, _ = losses.length_loss(losses.stop_probability(logits.log_softmax(-1), [END]), mask, start,
                                 torch.tensor([3.0]), torch.tensor([True]), hinge=0.0, grad_mask=grad_mask)
    (grad,) = torch.autograd.grad(loss, logits)
    assert grad[0, :6].abs().sum() == 0 and grad[0, 6:9].abs().sum() > 0


# --------------------------------------------------------------------------------------
# early tool call and coverage


ITEM = {
    "id": "t-1",
    "kind": "single",
    "locale": "en",
    "tool_should_be_used": True,
    "expected_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    "fixtures": [{"name": "get_weather", "arguments": {"city": "Paris"}, "result": {"temperature": 21}}],
    "integration_fields": ["temperature"],
}


def _encode(text: str) -> list[int]:
    return [ord(c) % V for c in text]


def test_early_tool_target_prefers_the_teachers_right_call_and_falls_back_to_the_json_prior() -> None:
    reference = _encode('<|tool_call|>{"name":"get_weather","arguments":{"city":"Paris"}}')
    teacher_ok = '<|tool_call|>{"name":"get_weather","arguments":{"city":"paris"}}<|end|>'  # lax: case-folded
    target = losses.early_tool_target(ITEM, teacher_ok, _encode, first_n=200)
    assert target is not None and target.source == "teacher" and target.ids != reference
    assert len(losses.early_tool_target(ITEM, teacher_ok, _encode, first_n=8).ids) == 8
    bad_schema = '<|tool_call|>{"name":"get_weather","arguments":{"town":"Paris"}}<|end|>'
    fallback = losses.early_tool_target(ITEM, bad_schema, _encode, first_n=200)
    assert fallback is not None and fallback.source == "json_prior" and fallback.ids == reference
    # a valid call with a wrong value would teach the first tokens away from the reference the CE teaches
    wrong = '<|tool_call|>{"name":"get_weather","arguments":{"city":"Berlin"}}<|end|>'
    fallback = losses.early_tool_target(ITEM, wrong, _encode, first_n=200)
    assert fallback is not None and fallback.source == "json_prior" and fallback.ids == reference
    # with no reference call, the teacher's valid call is the only target there is
    no_reference = {**ITEM, "expected_calls": []}
    assert losses.early_tool_target(no_reference, wrong, _encode, 200).source == "teacher"  # type: ignore[union-attr]
    assert losses.early_tool_target(no_reference, bad_schema, _encode, 200) is None
    assert losses.early_tool_target({**ITEM, "tool_should_be_used": False}, teacher_ok, _encode, 8) is None


def test_early_tool_loss_zero_when_not_needed_and_flows_when_needed() -> None:
    logits = _logits().requires_grad_(True)
    targets = torch.full((2, 5), TOOL_CALL)
    mask = torch.zeros(2, 5)
    mask[:, 1:4] = 1
    off = losses.early_tool_loss(logits, targets, mask, torch.tensor([False, False]))
    assert float(off) == 0.0
    on = losses.early_tool_loss(logits, targets, mask, torch.tensor([True, False]))
    (grad,) = torch.autograd.grad(on, logits)
    assert float(on) > 0 and grad[1].abs().sum() == 0 and grad[0, 1:4].abs().sum() > 0
    stepped = logits.detach() - grad
    assert bool((stepped.softmax(-1)[0, 1:4, TOOL_CALL] > logits.detach().softmax(-1)[0, 1:4, TOOL_CALL]).all())


def test_early_tool_positions_follow_the_rows_prefix() -> None:
    prompt = [0, 3, 9, 5]  # ... <|assistant|>
    target = [TOOL_CALL, 40, 41, 42]
    direct = [*prompt, TOOL_CALL, 40, 41, 42, 8]  # the reference opens with the call
    assert losses.early_tool_positions(direct, 4, target) == [(3, TOOL_CALL), (4, 40), (5, 41), (6, 42)]
    preamble = [*prompt, 30, 31, TOOL_CALL, 40, 41, 42, 8]  # "Let me check." then the call
    assert losses.early_tool_positions(preamble, 4, target) == [(3, TOOL_CALL)]  # only the decision to call now
    other_city = [*prompt, TOOL_CALL, 40, 50, 42, 8]
    assert losses.early_tool_positions(other_city, 4, target) == [(3, TOOL_CALL), (4, 40), (5, 41)]


@pytest.mark.parametrize(("epoch", "expected"), [(0.0, 0.0), (0.5, 0.1), (1.0, 0.2), (3.0, 0.2)])
def test_ramp(epoch: float, expected: float) -> None:
    assert math.isclose(losses.ramp(0.2, epoch, 1.0), expected)
    assert losses.ramp(0.2, 0.0, 0.0) == 0.2


def test_coverage_met_uses_scorer_and_validator() -> None:
    good = {"name": "get_weather", "arguments": {"city": "paris"}}
    assert losses.coverage_met(ITEM, [good], "It is 21 degrees.")
    assert not losses.coverage_met(ITEM, [good], "It is warm.")  # evidence missing
    assert not losses.coverage_met(ITEM, [{"name": "get_weather", "arguments": {}}], "21")  # required arg missing
    assert not losses.coverage_met(ITEM, [None], "21")
    assert not losses.coverage_met(ITEM, [], "21")
    assert losses.coverage_met({"expected_calls": [], "integration_fields": []}, [], "hello")


def test_combine_weights_and_components() -> None:
    a = torch.tensor(2.0, requires_grad=True)
    b = torch.tensor(3.0, requires_grad=True)
    total, logged = losses.combine({"kd": a, "ce": b}, {"kd": 1.0, "ce": 0.5})
    assert float(total) == 3.5 and logged == {"kd": 2.0, "ce": 3.0, "total": 3.5}
    total.backward()
    assert float(a.grad) == 1.0 and float(b.grad) == 0.5
    with pytest.raises(ValueError, match="unknown"):
        losses.combine({"kd": a}, {"nope": 1.0})


# --------------------------------------------------------------------------------------
# position_stats: the chunked losses equal the unchunked ones


def _unchunked(logits: torch.Tensor, targets: torch.Tensor, early: torch.Tensor, ids: torch.Tensor,
               lps: torch.Tensor, mask: torch.Tensor, kind: str, temperature: float) -> list[torch.Tensor]:
    log_probs = logits.float().log_softmax(-1)
    return [losses.masked_mean(losses.token_nll(log_probs, targets), mask),
            losses.masked_mean(losses.token_nll(log_probs, early), mask),
            losses.masked_mean(losses.stop_probability(log_probs, [END]), mask),
            losses.kd_loss_topk(logits, ids, lps, mask, kind, temperature)]  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 4, 10, 64])
@pytest.mark.parametrize("kind", losses.KD_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_chunked_position_stats_equal_the_losses_and_their_gradients(chunk: int, kind: str, temperature: float) -> None:
    g = torch.Generator().manual_seed(3)
    targets, early = torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)
    t_logp = _logits(seed=4).log_softmax(-1)
    lps, ids = t_logp.topk(4, dim=-1)
    mask = torch.ones(2, 5)
    mask[0, :2] = 0
    grads = []
    for chunked in (False, True):
        logits = _logits(seed=5).requires_grad_(True)
        if chunked:
            stats = losses.position_stats(logits, targets, chunk, early_targets=early, stop_ids=[END], topk_ids=ids,
                                          topk_logprobs=lps, kind=kind, temperature=temperature)  # fmt: skip
            values = [losses.masked_mean(stats[name], mask) for name in ("nll", "early_nll", "stop_prob", "kd")]
        else:
            values = _unchunked(logits, targets, early, ids, lps, mask, kind, temperature)
        sum(values).backward()
        grads.append((torch.stack([v.detach() for v in values]), logits.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("kind", losses.KD_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_chunked_head_gives_the_losses_and_gradients_of_its_logits(chunk: int, kind: str,
                                                                       temperature: float) -> None:  # fmt: skip
    """Hidden states and the head's weight in (``head=``): the values of the losses of ``hidden @ head.T``, and the
    gradients of both the hidden states and the weight; ``pred`` is the logits' argmax."""
    g = torch.Generator().manual_seed(3)
    targets, early = torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (2, 5), generator=g)
    lps, ids = _logits(seed=4).log_softmax(-1).topk(4, dim=-1)
    mask = torch.ones(2, 5)
    mask[1, 3:] = 0
    out = []
    for split in (False, True):
        hidden = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
        weight = torch.randn(V, 7, generator=torch.Generator().manual_seed(6)).requires_grad_(True)
        if split:
            stats = losses.position_stats(hidden, targets, chunk, head=weight, early_targets=early, stop_ids=[END],
                                          topk_ids=ids, topk_logprobs=lps, kind=kind, temperature=temperature,
                                          argmax=True)  # fmt: skip
            values = [losses.masked_mean(stats[name], mask) for name in ("nll", "early_nll", "stop_prob", "kd")]
            assert torch.equal(stats["pred"].long(), (hidden @ weight.T).argmax(-1))
        else:
            values = _unchunked(hidden @ weight.T, targets, early, ids, lps, mask, kind, temperature)
        sum(values).backward()
        out.append((torch.stack([v.detach() for v in values]), hidden.grad, weight.grad))
    for split, whole in zip(out[1], out[0]):
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("head", [True, False], ids=["head-in-the-loss", "logits"])
def test_positions_limit_the_stats_to_the_positions_read(head: bool) -> None:
    """``positions=``: the values there are the whole computation's (the KD too) and the others 0; the gradients of
    the hidden states and the weight are those of the losses over those positions; only their logits exist (one
    chunk as large as the batch makes a logits tensor of the selected rows, not of every position)."""
    B, T, d, chunk = 2, 6, 2, 12  # d small: the weights (V, d) are smaller than the selected logits
    g = torch.Generator().manual_seed(11)
    targets = torch.randint(0, V, (B, T), generator=g)
    t_hidden, t_weight = torch.randn(B, T, d + 1, generator=g), torch.randn(V, d + 1, generator=g)
    positions = torch.zeros(B, T, dtype=torch.bool)
    positions[0, 2:5] = positions[1, 4] = True
    names = ("nll", "stop_prob", "kd")
    out = []
    for select in (None, positions):
        hidden = torch.randn(B, T, d, generator=torch.Generator().manual_seed(12)).requires_grad_(True)
        weight = torch.randn(V, d, generator=torch.Generator().manual_seed(13)).requires_grad_(True)
        stats: dict[str, torch.Tensor] = {}
        step = functools.partial(_stats_backward, stats, hidden if head else hidden @ weight.T, targets, chunk,
                                 head=weight if head else None, stop_ids=[END], teacher_logits=t_hidden,
                                 teacher_head=t_weight, positions=select, read=positions, names=names)  # fmt: skip
        largest = largest_tensor(step, last_dim=V)
        if head:
            assert largest == (B * T if select is None else int(positions.sum())) * V, largest
        if select is not None:
            for name in names:
                assert torch.equal(stats[name][~positions], torch.zeros(int((~positions).sum())))
        out.append((torch.stack([stats[n][positions] for n in names]), hidden.grad, weight.grad))
    for part, whole in zip(out[1], out[0]):
        torch.testing.assert_close(part, whole, atol=1e-6, rtol=1e-5)


def _stats_backward(stats: dict[str, torch.Tensor], *args: Any, read: torch.Tensor, names: tuple[str, ...],
                    **kwargs: Any) -> None:  # fmt: skip
    """``position_stats(*args, **kwargs)`` into ``stats``, and backward of their sum over the positions ``read``."""
    stats.update(losses.position_stats(*args, **kwargs))
    sum(stats[name][read].sum() for name in names).backward()


def test_the_chunked_head_under_bf16_autocast_keeps_each_gradient_in_its_tensors_dtype() -> None:
    """Hidden states in bf16 (what CUDA autocast gives) and the fp32 weight: the chunk's logits are computed in bf16,
    as autocast computes a linear, the losses in fp32; the gradients come back in bf16 and fp32, close to fp32's."""
    g = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(V, 8, generator=g)
    targets = torch.randint(0, V, (2, 5), generator=g)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        h, w = hidden.to(dtype).detach().requires_grad_(True), weight.clone().requires_grad_(True)
        nll = losses.position_stats(h, targets, 3, head=w)["nll"]
        nll.sum().backward()
        assert nll.dtype == torch.float32 and h.grad is not None and w.grad is not None
        assert h.grad.dtype == dtype and w.grad.dtype == torch.float32
        out.append((nll.detach(), h.grad.float(), w.grad))
    for low, full in zip(out[1], out[0]):
        torch.testing.assert_close(low, full, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("split", [True, False], ids=["head-in-the-loss", "logits-first"])
def test_the_chunked_head_never_makes_a_tensor_of_every_positions_logits(split: bool) -> None:
    """With ``head=`` and ``teacher_head=``, no op in forward or backward makes a ``(B, T, V)``-sized tensor: the
    largest is one chunk's logits or a weight. Computing the logits first (the violation) does."""
    B, T, d, vocab, chunk = 2, 8, 4, 1000, 4
    hidden, weight = torch.randn(B, T, d, requires_grad=True), torch.randn(vocab, d, requires_grad=True)
    t_hidden, t_weight = torch.randn(B, T, d + 1), torch.randn(vocab, d + 1)
    targets = torch.randint(0, vocab, (B, T))

    def step() -> None:
        if split:
            stats = losses.position_stats(hidden, targets, chunk, head=weight, stop_ids=[1], argmax=True,
                                          teacher_logits=t_hidden, teacher_head=t_weight)  # fmt: skip
        else:
            stats = losses.position_stats(hidden @ weight.T, targets, chunk, stop_ids=[1],
                                          teacher_logits=t_hidden @ t_weight.T)  # fmt: skip
        (stats["nll"].sum() + stats["stop_prob"].sum() + stats["kd"].sum()).backward()

    largest = largest_tensor(step)
    assert hidden.grad is not None and weight.grad is not None
    if split:
        assert largest == max(chunk, d + 1) * vocab, largest  # one chunk's logits, or a weight (a view, a gradient)
    else:
        assert largest == B * T * vocab


def test_chunked_dense_kd_equals_kd_loss_dense() -> None:
    s, t = _logits(seed=6).requires_grad_(True), _logits(seed=7)
    mask = torch.ones(2, 5)
    stats = losses.position_stats(s, torch.zeros(2, 5, dtype=torch.long), 3, teacher_logits=t, kind="jsd",
                                  temperature=2.0)  # fmt: skip
    assert set(stats) == {"nll", "kd"}
    torch.testing.assert_close(losses.masked_mean(stats["kd"], mask), losses.kd_loss_dense(s, t, mask, "jsd", 2.0))


@pytest.mark.parametrize("kind", losses.KD_KINDS)
def test_the_chunked_teacher_head_gives_the_dense_teachers_kd(kind: str) -> None:
    """The teacher's final hidden states and head weight in (``teacher_head=``): the KD values and the student's
    gradients of the teacher's logits ``hidden @ head.T`` given whole."""
    s_hidden = torch.randn(2, 5, 7, generator=torch.Generator().manual_seed(5))
    s_weight = torch.randn(V, 7, generator=torch.Generator().manual_seed(6))
    t_hidden = torch.randn(2, 5, 9, generator=torch.Generator().manual_seed(7))
    t_weight = torch.randn(V, 9, generator=torch.Generator().manual_seed(8)) * 2
    out = []
    for split in (False, True):
        hidden, weight = s_hidden.clone().requires_grad_(True), s_weight.clone().requires_grad_(True)
        teacher = {"teacher_logits": t_hidden, "teacher_head": t_weight} if split else {
            "teacher_logits": t_hidden @ t_weight.T}
        kd = losses.position_stats(hidden, torch.zeros(2, 5, dtype=torch.long), 3, head=weight, kind=kind,
                                   temperature=2.0, beta=0.3, **teacher)["kd"]  # fmt: skip
        kd.sum().backward()
        out.append((kd.detach(), hidden.grad, weight.grad))
    assert float(out[0][0].sum()) > 0
    for split_value, whole in zip(out[1], out[0]):
        torch.testing.assert_close(split_value, whole, atol=1e-6, rtol=1e-5)


def test_chunked_stats_keep_no_full_vocabulary_tensor_for_backward() -> None:
    """Saved for backward: the logits themselves (no copy) and small tensors, never a (B, T, V) log-softmax."""
    logits = torch.randn(2, 6, 1000, requires_grad=True)
    saved: list[tuple[int, bool]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.numel(), t.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = losses.position_stats(logits, torch.zeros(2, 6, dtype=torch.long), 4, stop_ids=[1])
    assert saved and all(is_logits or numel < 1000 for numel, is_logits in saved), saved
    stats["nll"].sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape
    with pytest.raises(ValueError, match="chunk must be > 0"):
        losses.position_stats(logits, torch.zeros(2, 6, dtype=torch.long), 0)


@pytest.mark.parametrize("kind", losses.KD_KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_padded_topk_slots_are_left_out(kind: str, temperature: float) -> None:
    """A top-k row padded with -inf log-probs (collate, for rows shorter than k) gives the loss and the
    gradient of the unpadded row, unchunked and chunked; the padded ids (here 0) take no student mass."""
    lps, ids = _logits(seed=8).log_softmax(-1).topk(3, dim=-1)
    padded_ids = torch.cat([ids, torch.zeros(2, 5, 2, dtype=torch.long)], -1)
    padded_lps = torch.cat([lps, torch.full((2, 5, 2), -math.inf)], -1)
    mask, targets = torch.ones(2, 5), torch.zeros(2, 5, dtype=torch.long)
    out = []
    for top_ids, top_lps in ((ids, lps), (padded_ids, padded_lps)):
        logits = _logits(seed=9).requires_grad_(True)
        loss = losses.kd_loss_topk(logits, top_ids, top_lps, mask, kind, temperature)
        stats = losses.position_stats(logits, targets, 4, topk_ids=top_ids, topk_logprobs=top_lps, kind=kind,
                                      temperature=temperature)  # fmt: skip
        chunked = losses.masked_mean(stats["kd"], mask)
        (loss + chunked).backward()
        assert logits.grad is not None and torch.isfinite(logits.grad).all()
        out.append((loss.detach(), chunked.detach(), logits.grad))
    for a, b in zip(out[0], out[1]):
        torch.testing.assert_close(b, a)
