import math

import pytest
import torch

from kernels.logprobs import entropy_from_logits, token_logprobs


def _report(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    diff = (a.float() - b.float()).abs()
    print(f"{name}: max abs diff {diff.max().item():.3e}, mean abs diff {diff.mean().item():.3e}")
    return diff.max().item()


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_hand_case(chunk_size):
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # (1, 2, 2)
    targets = torch.tensor([[1, 0]])
    lp = token_logprobs(logits, targets, chunk_size=chunk_size)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), math.log(0.25)]]))
    ent = entropy_from_logits(logits, chunk_size=chunk_size)
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    torch.testing.assert_close(ent, torch.full((1, 2), 0.5623351))


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_temperature_divides_logits(chunk_size):
    # logits [0, 2 ln 3] at temperature 2 is softmax([0, ln 3]) again
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)]]])
    lp = token_logprobs(logits, torch.tensor([[1]]), temperature=2.0, chunk_size=chunk_size)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75)]]))
    ent = entropy_from_logits(logits, temperature=2.0, chunk_size=chunk_size)
    torch.testing.assert_close(ent, torch.tensor([[0.5623351]]))


def _inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 5, 37, generator=gen)).to(dtype)  # (B, T, V)
    targets = torch.randint(0, 37, (3, 5), generator=gen)  # (B, T)
    upstream = torch.randn(3, 5, generator=gen)  # (B, T) arbitrary dL/d(output)
    return logits, targets, upstream


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])  # 4 does not divide B*T = 15
def test_chunked_logprobs_match_reference(dtype, atol, chunk_size):
    logits, targets, upstream = _inputs(dtype)
    ref_in = logits.clone().requires_grad_()
    chunk_in = logits.clone().requires_grad_()
    ref = token_logprobs(ref_in, targets, temperature=0.7)
    out = token_logprobs(chunk_in, targets, temperature=0.7, chunk_size=chunk_size)
    assert out.dtype == ref.dtype == torch.float32
    assert out.shape == (3, 5)
    (ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    assert chunk_in.grad.dtype == dtype
    assert _report(f"logprobs {dtype} k={chunk_size}", out, ref) <= 1e-5
    assert _report(f"logprobs grad {dtype} k={chunk_size}", chunk_in.grad, ref_in.grad) <= atol


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_chunked_entropy_matches_reference(dtype, atol, chunk_size):
    logits, _, upstream = _inputs(dtype)
    ref_in = logits.clone().requires_grad_()
    chunk_in = logits.clone().requires_grad_()
    ref = entropy_from_logits(ref_in, temperature=0.7)
    out = entropy_from_logits(chunk_in, temperature=0.7, chunk_size=chunk_size)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    (ref * upstream).sum().backward()
    (out * upstream).sum().backward()
    assert chunk_in.grad.dtype == dtype
    assert _report(f"entropy {dtype} k={chunk_size}", out, ref) <= 1e-5
    assert _report(f"entropy grad {dtype} k={chunk_size}", chunk_in.grad, ref_in.grad) <= atol


def test_reference_agrees_with_torch_log_softmax():
    logits, targets, _ = _inputs(torch.float64)
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets), expected.float())
    probs = torch.softmax(logits, -1)
    expected_h = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected_h.float())


def test_chunked_without_grad():
    logits, targets, _ = _inputs(torch.float32)
    with torch.no_grad():
        out = token_logprobs(logits, targets, chunk_size=3)
        ent = entropy_from_logits(logits, chunk_size=3)
    assert not out.requires_grad and not ent.requires_grad
    torch.testing.assert_close(out, token_logprobs(logits, targets))


def test_bad_arguments():
    logits, targets, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits, targets, chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(logits, temperature=0.0)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(logits, targets[:, :2])


@pytest.mark.parametrize("fn", ["logprobs", "entropy"])
def test_chunked_path_saves_no_float32_vocab_tensor(fn):
    """The chunked path's autograd keeps the bf16 logits and per-row scalars, no fp32 (N, V)."""
    logits, targets, _ = _inputs(torch.bfloat16)
    logits.requires_grad_()
    saved: dict[str | None, list[tuple[torch.dtype, int]]] = {None: [], 4: []}
    for chunk_size, record in saved.items():

        def pack(t, record=record):
            record.append((t.dtype, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fn == "logprobs":
                token_logprobs(logits, targets, chunk_size=chunk_size)
            else:
                entropy_from_logits(logits, chunk_size=chunk_size)
    full = logits.numel()
    assert (torch.float32, full) in saved[None]  # the reference keeps a float32 copy
    assert all(not (dtype == torch.float32 and n >= full) for dtype, n in saved[4])
