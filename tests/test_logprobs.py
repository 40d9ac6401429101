"""The memory-lean log-prob path (``linear_logprobs``) against the plain one (full logits + log-softmax)."""

from __future__ import annotations

import pytest
import torch

from dualkv.core import PackedLayout
from dualkv.core.logprobs import (
    gather_logprobs,
    linear_logprobs,
    logprobs_from_logits,
    response_logprobs_from_logits,
)
from helpers import compile_for_hopper, count_calls, record_triton_launches


def inputs(n=13, D=24, V=97, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, D, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, V, (n,), generator=g)
    return h, w, t


def assert_close_scaled(got, want, rtol=1e-5):
    """Elementwise error relative to the tensor's largest entry (fp32 gradients of large logits)."""
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-12)
    assert err <= rtol, f"error {err:.3g} relative to max {want.abs().max():.3g}"


def plain(h, w, t, temperature, softcap):
    logits = h @ w.t()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logprobs_from_logits(logits, t, temperature)


def loss(lp, ent, seed=1):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    return (a.to(lp.dtype) * lp).sum() + (0.0 if ent is None else (b.to(ent.dtype) * ent).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_size", [1, 5, None])
@pytest.mark.parametrize("entropy", [False, True])
def test_lean_equals_plain(temperature, softcap, chunk_size, entropy):
    h, w, t = inputs()
    lp, ent = linear_logprobs(h, w, t, temperature=temperature, softcap=softcap, return_entropy=entropy,
                              chunk_size=chunk_size)
    ref_lp, ref_ent = plain(h, w, t, temperature, softcap)
    assert lp.dtype == torch.float32 and lp.shape == (13,)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    if entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    else:
        assert ent is None
    grads = torch.autograd.grad(loss(lp, ent), (h, w))
    ref = torch.autograd.grad(loss(ref_lp, ref_ent if entropy else None), (h, w))
    for got, want in zip(grads, ref):
        assert_close_scaled(got, want)


def test_gradcheck_float64():
    h, w, t = inputs(n=5, D=6, V=11, dtype=torch.float64)

    def fn(h, w):
        return linear_logprobs(h, w, t, temperature=0.8, softcap=2.0, return_entropy=True, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (h, w))


def test_entropy_requested_but_only_logprobs_in_the_loss():
    h, w, t = inputs()
    lp, _ = linear_logprobs(h, w, t, return_entropy=True, chunk_size=4)
    ref_lp, _ = plain(h, w, t, 1.0, None)
    got = torch.autograd.grad(lp.sum(), (h, w))
    want = torch.autograd.grad(ref_lp.sum(), (h, w))
    for a, b in zip(got, want):
        assert_close_scaled(a, b)


def test_frozen_head_gives_only_hidden_gradients():
    h, w, t = inputs()
    w = w.detach()
    lp, _ = linear_logprobs(h, w, t)
    lp.sum().backward()
    assert w.grad is None and h.grad is not None


def test_never_more_than_chunk_size_rows_of_logits(monkeypatch):
    """The (n, V) logits are never formed at once, in forward or backward."""
    h, w, t = inputs(n=23)
    rows = []
    real_linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    lp, ent = linear_logprobs(h, w, t, return_entropy=True, chunk_size=4)
    (lp.sum() + ent.sum()).backward()
    assert max(rows) == 4 and sum(rows) == 2 * 23


def _chunk_rows(monkeypatch, *args, **kwargs) -> list[int]:
    """Rows of each LM-head matmul (one per chunk, forward then backward) of one linear_logprobs call."""
    rows = []
    real_linear = torch.nn.functional.linear

    def spy(x, weight, bias=None):
        rows.append(x.shape[0])
        return real_linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    lp, _ = linear_logprobs(*args, **kwargs)
    lp.sum().backward()
    monkeypatch.setattr(torch.nn.functional, "linear", real_linear)
    return rows


def test_default_chunk_targets_a_bounded_block(monkeypatch):
    """The default chunk holds one (chunk, V) block of logits of about _CHUNK_BYTES: fp32 logits with
    the PyTorch reduction."""
    import dualkv.core.logprobs as mod

    monkeypatch.setattr(mod, "_CHUNK_BYTES", 97 * 3 * 4)  # V = 97: three fp32 rows
    h, w, t = inputs(n=23)
    lp, _ = linear_logprobs(h, w, t)
    torch.testing.assert_close(lp, plain(h, w, t, 1.0, None)[0], rtol=1e-5, atol=1e-5)
    assert max(_chunk_rows(monkeypatch, h, w, t, impl="torch")) == 3
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    assert max(_chunk_rows(monkeypatch, hb, wb, t, impl="torch")) == 3  # still reduced in fp32


def test_bfloat16_close_to_plain():
    h, w, t = inputs(dtype=torch.bfloat16)
    lp, ent = linear_logprobs(h, w, t, softcap=5.0, return_entropy=True, chunk_size=3)
    ref_lp, ref_ent = plain(h.float(), w.float(), t, 1.0, 5.0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0.05)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0.05)
    gh, gw = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16


def test_empty_selection():
    h, w, t = inputs(n=0)
    lp, ent = linear_logprobs(h, w, t, return_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert h.grad.shape == (0, 24)
    # the weight stays in the graph too (zero gradient, not None): a sequence-parallel rank with no
    # response token in its slice must reach the same parameters in backward as the others
    assert w.grad is not None and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden=torch.zeros(3)), "hidden"),
        (dict(weight=torch.zeros(7, 5)), "weight"),
        (dict(weight=torch.zeros(7, 24, dtype=torch.float64)), "weight"),
        (dict(targets=torch.zeros(4, dtype=torch.long)), "targets"),
        (dict(targets=torch.zeros(13)), "targets"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(softcap=-1.0), "softcap"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    h, w, t = inputs()
    args = dict(hidden=h, weight=w, targets=t)
    args.update({k: kwargs.pop(k) for k in list(kwargs) if k in args})
    with pytest.raises(ValueError, match=match):
        linear_logprobs(args["hidden"], args["weight"], args["targets"], **kwargs)


def test_plain_helpers_agree():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g)
    t = torch.randint(0, 11, (6,), generator=g)
    lp, ent = logprobs_from_logits(logits, t, 0.5)
    torch.testing.assert_close(lp, gather_logprobs(logits, t, 0.5))
    p = torch.softmax(logits / 0.5, -1)
    torch.testing.assert_close(ent, -(p * p.log()).sum(-1))
    layout = PackedLayout.from_groups([(torch.tensor([1, 2]), [torch.tensor([3, 4]), torch.tensor([5])])])
    rows = response_logprobs_from_logits(torch.randn(layout.total_tokens, 11, generator=g), layout)
    assert rows.shape == (2, 2) and rows[1, 1] == 0
    with pytest.raises(ValueError, match="input_ids"):
        response_logprobs_from_logits(torch.randn(5, 11), PackedLayout.from_lengths([2], [[2, 1]]))


# ------------------------------------------------------------ impl="triton" (interpreter on CPU)
@pytest.fixture
def small_blocks(monkeypatch):
    """Several blocks of logits per row and a ragged last one (V = 97, 300 with 32-wide blocks)."""
    pytest.importorskip("triton")
    from dualkv.core.backends.triton import logprob_kernel

    monkeypatch.setattr(logprob_kernel, "BLOCK_V", 32)
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.6, 3.0)])
@pytest.mark.parametrize("terms", ["both", "logprobs", "entropy"])
def test_triton_kernels_equal_torch_path(small_blocks, dtype, temperature, softcap, terms):
    h, w, t = inputs(n=11, V=300, dtype=dtype)
    results = {}
    for impl, args in (("torch", (h, w)), ("triton", (h, w)), ("fp64", (h.double(), w.double()))):
        lp, ent = linear_logprobs(*args, t, temperature=temperature, softcap=softcap, return_entropy=True,
                                  chunk_size=4, impl="torch" if impl == "fp64" else impl)
        objective = {"both": loss(lp, ent), "logprobs": loss(lp, None), "entropy": loss(ent, None, seed=2)}[terms]
        results[impl] = (lp, ent, *torch.autograd.grad(objective, args))
    names = ("logprobs", "entropy", "dhidden", "dweight")
    for name, got, torch_path, exact in zip(names, results["triton"], results["torch"], results["fp64"]):
        assert got.dtype == torch_path.dtype, name
        # same logits in the same dtype, reduced in another order (and, in fp16, dlogits rounded
        # before the LM-head products): no further from fp64 than the PyTorch path, up to 2x + a floor
        scale = exact.abs().max()
        err, ref_err = ((x.double() - exact).abs().max() / scale for x in (got, torch_path))
        assert err <= 2 * ref_err + (1e-6 if dtype == torch.float32 else 1e-3), (name, err.item(), ref_err.item())


def test_auto_impl_takes_torch_off_cuda(monkeypatch):
    """The default (auto) reduces CPU and fp32 chunks with PyTorch ops; the variable can ask for it too."""
    from dualkv.core.logprobs import resolve_logprobs_impl

    h, w, t = inputs()
    monkeypatch.delenv("DUALKV_LOGPROBS_IMPL", raising=False)
    assert resolve_logprobs_impl(None, h) == resolve_logprobs_impl("auto", h.half()) == "torch"
    monkeypatch.setenv("DUALKV_LOGPROBS_IMPL", "auto")
    assert resolve_logprobs_impl(None, h) == "torch"
    torch.testing.assert_close(linear_logprobs(h, w, t)[0], linear_logprobs(h, w, t, impl="torch")[0], rtol=0, atol=0)


def test_triton_impl_from_environment_and_errors(small_blocks, monkeypatch):
    h, w, t = inputs()
    monkeypatch.setenv("DUALKV_LOGPROBS_IMPL", "triton")
    from dualkv.core.backends.triton import logprob_kernel

    calls = count_calls(monkeypatch, logprob_kernel, "forward")
    lp, _ = linear_logprobs(h, w, t, chunk_size=5)
    assert len(calls) == 3  # 13 rows in chunks of 5
    torch.testing.assert_close(lp, linear_logprobs(h, w, t, impl="torch")[0], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("DUALKV_LOGPROBS_IMPL", "cuda")
    with pytest.raises(ValueError, match="DUALKV_LOGPROBS_IMPL: expected one of"):
        linear_logprobs(h, w, t)
    with pytest.raises(ValueError, match="impl: expected one of"):
        linear_logprobs(h, w, t, impl="fused")
    h64, w64, t64 = inputs(dtype=torch.float64)
    with pytest.raises(ValueError, match="hidden: expected float16, bfloat16 or float32"):
        linear_logprobs(h64, w64, t64, impl="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="bfloat16 is not supported by the Triton CPU interpreter"):
            linear_logprobs(*inputs(dtype=torch.bfloat16), impl="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="'triton' cannot run here"):
            linear_logprobs(h, w, t, impl="triton")


def test_triton_kernels_compile_for_hopper(small_blocks, tmp_path, monkeypatch):
    """The kernels, as linear_logprobs launches them (the default block width, with and without a
    softcap, both gradients flowing), lower to sm_90 machine code in bf16 and fp16 on this CPU-only
    machine: the interpreter never runs Triton's compiler (and cannot run bf16 at all)."""
    from dualkv.core.backends.triton import logprob_kernel

    monkeypatch.setattr(logprob_kernel, "BLOCK_V", 4096)
    specs = record_triton_launches(monkeypatch, logprob_kernel, ("_logprob_fwd_kernel", "_logprob_bwd_kernel"))
    h, w, t = inputs(n=3, D=8, V=5000, dtype=torch.float16)
    for softcap in (None, 3.0):
        lp, ent = linear_logprobs(h, w, t, softcap=softcap, return_entropy=True, impl="triton")
        torch.autograd.grad(loss(lp, ent), (h, w))
    assert {s["name"] for s in specs.values()} == {"_logprob_fwd_kernel", "_logprob_bwd_kernel"}
    assert len(specs) == 4  # each kernel with and without the cap
    compile_for_hopper(specs, tmp_path, dtypes=("bf16", "fp16"))


def test_triton_kernels_keep_one_compiled_variant_across_steps(small_blocks, monkeypatch):
    """Token counts and chunk offsets that change from step to step leave the kernels' specialisation
    (each pointer's 16-byte alignment, each integer's divisibility) unchanged, so a training run
    compiles each kernel once: chunks at odd offsets and statistics rows of odd length used to hand
    the kernels off-boundary vectors, a fresh compile for every new pattern."""
    from dualkv.core.backends.triton import logprob_kernel

    specs = record_triton_launches(monkeypatch, logprob_kernel, ("_logprob_fwd_kernel", "_logprob_bwd_kernel"))
    for n in (21, 22, 23, 24):
        h, w, t = inputs(n=n, V=300, seed=n)
        lp, ent = linear_logprobs(h, w, t, return_entropy=True, chunk_size=5, impl="triton")
        torch.autograd.grad(loss(lp, ent), (h, w))
    assert sorted(s["name"] for s in specs.values()) == ["_logprob_bwd_kernel", "_logprob_fwd_kernel"], \
        [s["specialization"] for s in specs.values()]
    for spec in specs.values():  # every vector on a 16-byte boundary
        assert all(v for k, v in spec["specialization"].items() if spec["signature"][k].startswith("*")), spec


def test_triton_kernel_entry_points_name_bad_arguments(small_blocks):
    """The kernels' Python entry points refuse logits / targets they cannot address, naming them."""
    from dualkv.core.backends.triton import logprob_kernel

    logits, targets = torch.randn(4, 50), torch.randint(0, 50, (4,))
    with pytest.raises(ValueError, match=r"logits: expected a \(n, V\) tensor with a contiguous last dim"):
        logprob_kernel.forward(logits.t(), targets, 1.0, None)
    with pytest.raises(ValueError, match=r"targets: expected \(4,\) int64"):
        logprob_kernel.forward(logits, targets.int(), 1.0, None)
    with pytest.raises(ValueError, match=r"targets: expected \(4,\) int64"):
        logprob_kernel.backward_(logits, targets[:3], None, None, targets.float(), targets.float(), 1.0, None)


def test_triton_default_chunk_holds_logits_in_the_weights_dtype(small_blocks, monkeypatch):
    """With the Triton kernels the chunk's logits stay in the weights' dtype: twice the rows in fp16."""
    import dualkv.core.logprobs as mod

    monkeypatch.setattr(mod, "_CHUNK_BYTES", 97 * 3 * 4)
    h, w, t = inputs(n=23, dtype=torch.float16)
    assert max(_chunk_rows(monkeypatch, h, w, t, impl="triton")) == 6
    h, w, t = inputs(n=23)
    assert max(_chunk_rows(monkeypatch, h, w, t, impl="triton")) == 3
