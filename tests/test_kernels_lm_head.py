"""Every path of ``lm_head_logprobs`` against the naive reference: values, gradients, memory.

The Triton path runs on CUDA when there is a GPU and otherwise on CPU under the Triton
interpreter (the ``triton_device`` fixture sets ``TRITON_INTERPRET=1`` before
``kernels.triton_logprobs`` is imported); its tests are skipped only when the ``triton``
package is missing. Each comparison prints its max and mean absolute difference
(``pytest -s`` shows them).
"""

import importlib
import importlib.util
import math
import os

import pytest
import torch

from kernels.lm_head_logprobs import IMPL_ENV, lm_head_logprobs, resolve_impl

N, H, V = 37, 80, 150  # several 64-wide vocabulary tiles and hidden tiles, ragged edges
CHUNK = 16  # does not divide N
FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(scope="module")
def triton_device() -> str:
    """Device for the Triton path; imports its kernels for the interpreter when there is no GPU."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    if torch.cuda.is_available():
        importlib.import_module("kernels.triton_logprobs")
        return "cuda"
    # Set for the rest of this process: Triton reads it when @triton.jit runs and again when
    # the first launch imports its remaining modules. Only Triton reads it.
    os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module("kernels.triton_logprobs")
    if not module.INTERPRETED:  # imported earlier in this process without the interpreter
        module = importlib.reload(module)
    assert module.INTERPRETED
    return "cpu"


def _report(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs()
    worst, mean = diff.max().item(), diff.mean().item()
    print(f"{name}: max abs diff {worst:.3e}, mean abs diff {mean:.3e}")
    return worst, mean


def _inputs(dtype, device="cpu"):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen)  # (N, H)
    weight = torch.randn(V, H, generator=gen) * (3 / math.sqrt(H))  # (V, H): logits of std ~3
    targets = torch.randint(0, V, (N,), generator=gen)  # (N,)
    up_lp = torch.randn(N, generator=gen)  # arbitrary dL/d logprobs
    up_ent = torch.randn(N, generator=gen)  # arbitrary dL/d entropy
    return [t.to(device) for t in (hidden.to(dtype), weight.to(dtype), targets, up_lp, up_ent)]


def _run(impl, dtype, *, temperature, with_entropy, chunk_size=CHUNK, device="cpu"):
    """Outputs and gradients as a dict of CPU tensors."""
    hidden, weight, targets, up_lp, up_ent = _inputs(dtype, device)
    hidden.requires_grad_()
    weight.requires_grad_()
    out = lm_head_logprobs(
        hidden,
        weight,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        impl=impl,
    )
    logprobs, entropy = out if with_entropy else (out, None)
    assert logprobs.dtype == torch.float32 and logprobs.shape == (N,)
    loss = (logprobs * up_lp).sum()
    if with_entropy:
        assert entropy.dtype == torch.float32 and entropy.shape == (N,)
        loss = loss + (entropy * up_ent).sum()
    loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == dtype
    result = {"logprobs": logprobs, "grad_hidden": hidden.grad, "grad_weight": weight.grad}
    if with_entropy:
        result["entropy"] = entropy
    return {k: v.detach().cpu() for k, v in result.items()}


def _float64_reference(dtype, *, temperature):
    """The exact answer for the (rounded) inputs of ``dtype``: the naive path in float64."""
    hidden, weight, targets, up_lp, up_ent = _inputs(dtype)
    hidden = hidden.double().requires_grad_()
    weight = weight.double().requires_grad_()
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)  # (N, V)
    logprobs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    ((logprobs * up_lp.double()).sum() + (entropy * up_ent.double()).sum()).backward()
    return {
        "logprobs": logprobs.detach(),
        "entropy": entropy.detach(),
        "grad_hidden": hidden.grad,
        "grad_weight": weight.grad,
    }


# (max, mean) abs-difference bounds against the naive path. Under bfloat16 the naive and
# chunked paths round the logits to bfloat16 (up to 0.05 off in log-prob here, see
# test_bf16_against_float64) while Triton keeps them in float32, and gradients come back in
# bfloat16 (|grad_weight| up to ~8 here, where one bf16 step is 0.03).
TOLERANCE = {
    (FP32, "values"): (2e-5, 2e-6),
    (FP32, "grads"): (1e-4, 2e-6),
    (BF16, "values"): (0.1, 0.02),
    (BF16, "grads"): (0.15, 0.01),
}

CASES = [
    # (impl, dtype, temperature, with_entropy, chunk_size)
    ("chunked", FP32, 0.7, True, CHUNK),
    ("chunked", FP32, 1.0, False, CHUNK),
    ("chunked", FP32, 1.3, True, 1),
    ("chunked", FP32, 0.7, True, 1000),  # one chunk bigger than N
    ("chunked", BF16, 0.7, True, CHUNK),
    ("chunked", BF16, 1.0, False, CHUNK),
    ("triton", FP32, 0.7, True, CHUNK),
    ("triton", FP32, 1.0, False, CHUNK),
    ("triton", BF16, 0.7, True, CHUNK),
]


@pytest.mark.parametrize(
    ("impl", "dtype", "temperature", "with_entropy", "chunk_size"),
    CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-T{c[2]}-{'ent' if c[3] else 'noent'}-k{c[4]}" for c in CASES],
)
def test_matches_naive(request, impl, dtype, temperature, with_entropy, chunk_size):
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    kw = {"temperature": temperature, "with_entropy": with_entropy, "chunk_size": chunk_size}
    ref = _run("naive", dtype, **kw)
    out = _run(impl, dtype, device=device, **kw)
    assert out.keys() == ref.keys()
    for name in out:
        kind = "grads" if name.startswith("grad") else "values"
        worst, mean = _report(f"{impl} {dtype} T={temperature} {name}", out[name], ref[name])
        max_tol, mean_tol = TOLERANCE[(dtype, kind)]
        if impl == "chunked" and kind == "values":
            max_tol, mean_tol = 2e-5, 2e-6  # same bf16 logits as naive, same float32 math
        assert worst <= max_tol and mean <= mean_tol, (
            f"{name}: max {worst:.3e} (bound {max_tol}), mean {mean:.3e} (bound {mean_tol})"
        )


@pytest.mark.parametrize("impl", ["naive", "chunked", "triton"])
def test_bf16_against_float64(request, impl):
    """Against the exact answer for the same bf16 inputs, Triton's float32 logits are far closer."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    out = _run(impl, BF16, temperature=0.7, with_entropy=True, device=device)
    exact = _float64_reference(BF16, temperature=0.7)
    value_tol = 1e-4 if impl == "triton" else 0.1
    for name in out:
        worst, _ = _report(f"{impl} bf16 vs float64 {name}", out[name], exact[name])
        tol = value_tol if name in ("logprobs", "entropy") else 0.15
        assert worst <= tol, f"{name}: max {worst:.3e} > {tol}"


@pytest.mark.parametrize("impl", ["naive", "chunked", "triton"])
def test_hand_case(request, impl):
    # logits [0, ln 3] (temperature 2 on [0, 2 ln 3]) give softmax [1/4, 3/4]
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    hidden = torch.ones(2, 1, device=device)  # (N=2, H=1)
    weight = torch.tensor([[0.0], [2 * math.log(3.0)]], device=device)  # (V=2, H=1)
    targets = torch.tensor([1, 0], device=device)
    lp, ent = lm_head_logprobs(
        hidden, weight, targets, temperature=2.0, with_entropy=True, impl=impl
    )
    torch.testing.assert_close(lp.cpu(), torch.tensor([math.log(0.75), math.log(0.25)]))
    # -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    torch.testing.assert_close(ent.cpu(), torch.full((2,), 0.5623351))


@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_frozen_weight_and_unused_entropy(request, impl):
    """Only hidden needs a gradient and the entropy feeds no loss: both backward shortcuts."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    grads = {}
    for path in ("naive", impl):
        hidden, weight, targets, up_lp, _ = _inputs(FP32, device)
        hidden.requires_grad_()
        lp, _ = lm_head_logprobs(hidden, weight, targets, with_entropy=True, impl=path)
        (lp * up_lp).sum().backward()
        assert weight.grad is None
        grads[path] = hidden.grad.cpu()
    worst, _ = _report(f"{impl} frozen-weight grad_hidden", grads[impl], grads["naive"])
    assert worst <= 1e-4


@pytest.mark.parametrize("impl", ["chunked", "triton"])
def test_saves_no_vocab_sized_tensor(request, impl, monkeypatch):
    """Autograd keeps the inputs and per-row scalars only; the naive path keeps (N, V) tensors.
    (The chunked path keeps a small head's probabilities, up to ``KEEP_BYTES``: off here.)"""
    import kernels.lm_head_logprobs as module

    monkeypatch.setattr(module, "KEEP_BYTES", 0)
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    n, h, v = 64, 8, 512  # N * V = 32768 is 8x the weight, so an (N, V) tensor stands out
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=gen).to(device).requires_grad_()
    weight = torch.randn(v, h, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    saved: dict[str, list[int]] = {"naive": [], impl: []}
    for path, sizes in saved.items():

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = lm_head_logprobs(
                hidden, weight, targets, with_entropy=True, chunk_size=16, impl=path
            )
        (lp.sum() + ent.sum()).backward()
    print(f"largest saved tensor: naive {max(saved['naive'])}, {impl} {max(saved[impl])}")
    assert max(saved["naive"]) >= n * v  # the control: the reference does keep (N, V)
    assert max(saved[impl]) <= max(v * h, n * h, n)


@pytest.mark.parametrize("impl", ["naive", "chunked", "triton"])
def test_no_tokens(request, impl):
    """A batch without response tokens gives empty outputs and a zero weight gradient."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    hidden = torch.zeros(0, H, device=device, requires_grad=True)
    weight = torch.randn(V, H, device=device, requires_grad=True)
    lp, ent = lm_head_logprobs(
        hidden, weight, torch.zeros(0, dtype=torch.long, device=device), with_entropy=True,
        impl=impl,
    )
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == (0, H)
    assert weight.grad is None or not weight.grad.any()


SUM_PI_SQUARED_CASES = [
    # (impl, dtype, temperature, with_entropy, chunk_size)
    ("chunked", FP32, 0.7, True, CHUNK),
    ("chunked", FP32, 1.3, False, 1),
    ("chunked", BF16, 1.0, True, CHUNK),
    ("triton", FP32, 0.7, True, CHUNK),
    ("triton", FP32, 1.3, False, CHUNK),
    ("triton", BF16, 1.0, True, CHUNK),
]


@pytest.mark.parametrize(
    ("impl", "dtype", "temperature", "with_entropy", "chunk_size"),
    SUM_PI_SQUARED_CASES,
    ids=[f"{c[0]}-{str(c[1])[6:]}-T{c[2]}-{'ent' if c[3] else 'noent'}-k{c[4]}"
         for c in SUM_PI_SQUARED_CASES],
)
def test_sum_pi_squared_matches_float64(request, impl, dtype, temperature, with_entropy,
                                        chunk_size):
    """verl's sum_pi_squared, sum_v p(v)**2 per row, on every path: against the float64 answer
    for the same inputs, with the other outputs unchanged and no gradient on it."""
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    hidden, weight, targets, up_lp, _ = _inputs(dtype, device)
    hidden.requires_grad_()
    kw = dict(temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
    out = lm_head_logprobs(hidden, weight, targets, with_sum_pi_squared=True, impl=impl, **kw)
    plain = lm_head_logprobs(hidden, weight, targets, impl=impl, **kw)
    assert len(out) == (3 if with_entropy else 2)
    plain = plain if with_entropy else (plain,)
    for a, b in zip(out[:-1], plain, strict=True):
        assert torch.equal(a, b)  # asking for it changes nothing else
    sq = out[-1]
    assert sq.dtype == torch.float32 and sq.shape == (N,) and not sq.requires_grad
    (out[0] * up_lp).sum().backward()  # the log-probs still carry their gradient
    assert hidden.grad is not None
    exact = torch.softmax(hidden.detach().double() @ weight.double().T / temperature, -1)
    exact = exact.square().sum(-1)
    tol = 1e-5 if dtype == FP32 or impl == "triton" else 0.02  # bf16 logits on naive/chunked
    worst, _ = _report(f"{impl} {dtype} sum_pi_squared", sq, exact)
    assert worst <= tol, worst
    naive = lm_head_logprobs(hidden, weight, targets, with_sum_pi_squared=True, impl="naive",
                             temperature=temperature)[-1]
    assert not naive.requires_grad
    worst, _ = _report(f"{impl} {dtype} sum_pi_squared vs naive", sq, naive)
    assert worst <= (1e-5 if dtype == FP32 else 0.02), worst


@pytest.mark.parametrize("impl", ["naive", "chunked", "triton"])
def test_sum_pi_squared_hand_case(request, impl):
    # softmax [1/4, 3/4] (see test_hand_case): 1/16 + 9/16 = 0.625
    device = request.getfixturevalue("triton_device") if impl == "triton" else "cpu"
    hidden = torch.ones(2, 1, device=device)  # (N=2, H=1)
    weight = torch.tensor([[0.0], [2 * math.log(3.0)]], device=device)  # (V=2, H=1)
    lp, sq = lm_head_logprobs(hidden, weight, torch.tensor([1, 0], device=device),
                              temperature=2.0, with_sum_pi_squared=True, impl=impl)
    torch.testing.assert_close(sq.cpu(), torch.full((2,), 0.625))
    empty = lm_head_logprobs(torch.zeros(0, 1, device=device), weight,
                             torch.zeros(0, dtype=torch.long, device=device),
                             with_entropy=True, with_sum_pi_squared=True, impl=impl)
    assert [t.shape for t in empty] == [(0,), (0,), (0,)]


def test_no_grad_matches_naive():
    hidden, weight, targets, _, _ = _inputs(FP32)
    with torch.no_grad():
        lp, ent = lm_head_logprobs(hidden, weight, targets, with_entropy=True, impl="chunked")
        ref_lp, ref_ent = lm_head_logprobs(hidden, weight, targets, with_entropy=True, impl="naive")
    assert not lp.requires_grad and not ent.requires_grad
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)


def test_impl_precedence(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert resolve_impl("auto", cpu) == "chunked"
    has_triton = importlib.util.find_spec("triton") is not None
    assert resolve_impl("auto", cuda) == ("triton" if has_triton else "chunked")
    monkeypatch.setenv(IMPL_ENV, "naive")
    assert resolve_impl("auto", cuda) == "naive"  # the variable beats automatic choice
    assert resolve_impl("chunked", cpu) == "chunked"  # an explicit argument beats the variable
    monkeypatch.setenv(IMPL_ENV, "fast")
    with pytest.raises(ValueError, match=IMPL_ENV):
        resolve_impl("auto", cpu)
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("fused", cpu)


def test_bad_arguments():
    hidden, weight, targets, _, _ = _inputs(FP32)
    cases = [
        ((hidden[None], weight, targets), {}, "hidden must be"),
        ((hidden, weight[:, :5], targets), {}, "hidden size mismatch"),
        ((hidden, weight.double(), targets), {}, "one float dtype"),
        ((hidden.long(), weight.long(), targets), {}, "one float dtype"),
        ((hidden, weight, targets[:5]), {}, "targets must be a long tensor"),
        ((hidden, weight, targets.int()), {}, "targets must be a long tensor"),
        ((hidden, weight, targets + V), {}, r"targets must lie in \[0, 150\)"),
        ((hidden, weight, targets), {"temperature": 0.0}, "temperature"),
        ((hidden, weight, targets), {"chunk_size": 0}, "chunk_size"),
        ((hidden, weight, targets), {"impl": "fused"}, "impl"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            lm_head_logprobs(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_on_gpu_at_model_size():
    """Default-model sizes on CUDA: Triton matches naive and keeps its peak far below it."""
    importlib.import_module("kernels.triton_logprobs")
    n, h, v = 4096, 576, 49152
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(v, h, generator=gen, device="cuda") * (3 / math.sqrt(h))).bfloat16()
    targets = torch.randint(0, v, (n,), generator=gen, device="cuda")
    results, peaks = {}, {}
    for impl in ("naive", "triton"):
        hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp, ent = lm_head_logprobs(hid, w, targets, temperature=0.7, with_entropy=True, impl=impl)
        (lp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peaks[impl] = torch.cuda.max_memory_allocated() - base
        results[impl] = [lp.detach(), ent.detach(), hid.grad, w.grad]
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), *results.values(), strict=True):
        worst, mean = _report(f"gpu triton bf16 {name}", a, b)
        scale = b.float().abs().max().item()  # bf16 results: a few steps of 2**-8 relative
        assert worst <= 0.1 + 0.02 * scale and mean <= 0.02 + 0.002 * scale, name
    print(f"peak bytes: naive {peaks['naive']:,}, triton {peaks['triton']:,}")
    assert peaks["triton"] <= peaks["naive"] / 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kept_probabilities_give_the_recomputed_gradients(temperature, monkeypatch):
    """A small head's probabilities kept from the forward pass (``KEEP_BYTES``) give the
    gradients that recomputing the logits gives; with an entropy gradient it recomputes."""
    import kernels.lm_head_logprobs as module

    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    targets = torch.randint(0, V, (N,), generator=gen)
    weights = torch.randn(N, generator=gen)
    grads = {}
    for keep in (0, module.KEEP_BYTES):
        monkeypatch.setattr(module, "KEEP_BYTES", keep)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = lm_head_logprobs(h, w, targets, temperature=temperature, with_entropy=True,
                                   chunk_size=CHUNK, impl="chunked")
        (lp * weights).sum().backward()
        grads[keep] = (h.grad, w.grad, lp.detach(), ent.detach())
    (kept, recomputed) = grads[module.KEEP_BYTES], grads[0]
    for a, b in zip(kept, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
