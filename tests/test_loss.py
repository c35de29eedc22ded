"""The fused chunked LM loss equals the plain one (value and every gradient) and keeps less."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

from conftest import tiny_input_ids, tiny_model_config
from preinfer.model.adapters import forward_blocks, get_adapter
from preinfer.model.loss import IGNORE, blocks_loss, head_loss, linear_cross_entropy, lm_loss
from preinfer.model.modeling import build_model
from preinfer.model.partition import partition_model


def _grads(*ts):
    return [t.grad.clone() if t is not None and t.grad is not None else None for t in ts]


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_equals_plain(chunk, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g, requires_grad=True)
    w = torch.randn(33, 16, generator=g, requires_grad=True)
    b = torch.randn(33, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 33, (50,), generator=g)
    y[[3, 17]] = IGNORE
    (3 * linear_cross_entropy(x, w, b, y, chunk)).backward()
    fused = [linear_cross_entropy(x, w, b, y, chunk).detach(), *_grads(x, w, b)]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    logits = x @ w.T + (b if bias else 0)
    plain = F.cross_entropy(logits, y, ignore_index=IGNORE)
    (3 * plain).backward()
    assert_close(fused[0], plain.detach(), rtol=1e-6, atol=1e-6)
    for got, want in zip(fused[1:], _grads(x, w, b), strict=True):
        if want is not None:
            assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_frozen_weight_gets_no_gradient_and_no_grad_mode_computes_none():
    x = torch.randn(20, 8, requires_grad=True)
    w = torch.randn(40, 8)
    y = torch.randint(0, 40, (20,))
    linear_cross_entropy(x, w, None, y, 6).backward()
    assert w.grad is None and x.grad is not None
    with torch.no_grad():
        v = linear_cross_entropy(x, w, None, y, 6)
    assert not v.requires_grad
    assert_close(v, F.cross_entropy(x.detach() @ w.T, y))


def test_bad_shapes_and_chunk_are_clear_errors():
    x, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(x, w, None, y, 0)
    with pytest.raises(ValueError, match=r"need x \(N, H\)"):
        linear_cross_entropy(x, torch.randn(10, 9), None, y, 2)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_head_loss_equals_plain_loss_through_the_model(arch):
    """Blocks [1, M) + fused head loss == the same with the plain logits: loss and the gradient
    of every trainable parameter (the tied embedding included, when it trains)."""
    model = build_model(tiny_model_config(arch)).train()
    adapter = get_adapter(model, arch)
    part = partition_model(adapter, 3)
    ids = tiny_input_ids(4, 24, adapter.vocab_size, seed=1)
    x, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        h = forward_blocks(adapter, part, x, 0, 1)
    params = [p for p in model.parameters() if p.requires_grad]

    def run(chunk):
        model.zero_grad(set_to_none=True)
        loss = blocks_loss(adapter, part, h, labels, 1, chunk)
        loss.backward()
        return loss.detach(), [p.grad.clone() if p.grad is not None else None for p in params]

    fused, plain = run(5), run(0)
    assert_close(fused[0], plain[0], rtol=1e-6, atol=1e-6)
    assert_close(
        fused[0],
        lm_loss(forward_blocks(adapter, part, h, 1, 3), labels).detach(),
        rtol=1e-6,
        atol=0,
    )
    assert sum(g is not None for g in plain[1]) > 0
    for a, b in zip(fused[1], plain[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("chunk", [0, 8])
def test_head_loss_runs_the_head_over_the_counted_positions_only(chunk):
    """A response-only batch (most labels IGNORE): the head's matmuls run over the counted
    positions alone (FLOPs in proportion, fused or plain), with the loss and the gradient of
    the hidden states the plain loss over every position gives (zero where nothing counts)."""
    adapter = get_adapter(build_model(tiny_model_config("llama")), "llama")
    h = torch.randn(4, 16, adapter.hidden_size, requires_grad=True)
    labels = tiny_input_ids(4, 16, adapter.vocab_size, seed=3)
    few = labels.clone()
    few[:, torch.arange(16) % 4 != 0] = IGNORE  # 16 of 64 positions count

    def run(y):
        h.grad = None
        with FlopCounterMode(display=False) as fc:
            loss = head_loss(adapter, h, y, chunk)
            loss.backward()
        return loss.detach(), h.grad.clone(), fc.get_total_flops()

    _, _, every = run(labels)
    loss, grad, flops = run(few)
    assert flops == every // 4
    h.grad = None
    want = lm_loss(adapter.head(h), few)
    want.backward()
    assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
    assert_close(grad, h.grad, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(grad[few == IGNORE]) == 0


def test_head_loss_under_bf16_autocast_is_close_to_plain():
    model = build_model(tiny_model_config("gpt2"))
    adapter = get_adapter(model, "gpt2")
    h = torch.randn(2, 16, adapter.hidden_size)
    labels = tiny_input_ids(2, 16, adapter.vocab_size, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_loss(adapter, h, labels, 8)
        plain = lm_loss(adapter.head(h), labels)
    assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_fused_loss_keeps_a_fraction_of_the_plain_loss_bytes():
    """What autograd keeps through backward: the plain loss keeps (N, V) logit-sized tensors,
    the fused one only (N, H) input-sized ones."""
    N, H, V = 512, 32, 2048
    x = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    y = torch.randint(0, V, (N,))

    def kept_bytes(fn):
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn()
        return sum(seen.values()), loss

    plain_b, _ = kept_bytes(lambda: F.cross_entropy(x @ w.T, y))
    fused_b, _ = kept_bytes(lambda: linear_cross_entropy(x, w, None, y, 64))
    assert fused_b >= (N * H + V * H) * 4  # d loss / dx and d loss / dw, kept for backward
    assert plain_b >= N * V * 4  # at least the fp32 logits
    assert fused_b <= (N * H + V * H + V) * 4 * 1.01 < plain_b / 4
