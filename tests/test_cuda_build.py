"""CPU checks of the CUDA backend.

- Every kernel translation unit of csrc/ compiles with nvcc (compile-only, no GPU needed) for sm_80
  and sm_90a, so a syntax or template error fails CI. Skipped when nvcc is absent.
- Without a CUDA build of torch / a GPU, ``backend="cuda"`` raises the clear "not built" error.
- The arch-flag logic honours TORCH_CUDA_ARCH_LIST.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dualkv.core import PackedLayout, dualkv_attention

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _build_config():
    spec = importlib.util.spec_from_file_location("dualkv_build_config_test", CSRC / "build_config.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc() -> str | None:
    return _build_config().find_nvcc()


@pytest.mark.slow
def test_every_kernel_translation_unit_compiles_for_sm80_and_sm90a(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed: the compile-only check of csrc/ needs a CUDA toolkit")
    config = _build_config()
    sources = config.kernel_sources()
    assert sources, "csrc/ has no .cu translation units"
    flags = config.nvcc_flags(["8.0", "9.0a"])
    assert "-gencode=arch=compute_80,code=sm_80" in flags and "-gencode=arch=compute_90a,code=sm_90a" in flags

    def compile_one(src: Path):
        cmd = [nvcc, *flags, "-I", str(CSRC), "-c", str(src), "-o", str(tmp_path / (src.stem + ".o"))]
        start = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        return src.name, proc.returncode, proc.stderr, time.time() - start

    # Longest first (the backward units), spread over the cores.
    order = sorted(sources, key=lambda p: ("bwd" not in p.name, p.name))
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(compile_one, order))
    failures = [f"{name} (exit {rc}):\n{err[-4000:]}" for name, rc, err, _ in results if rc != 0]
    assert not failures, "nvcc failed on:\n" + "\n".join(failures)
    for name, _, _, secs in results:
        print(f"{name}: {secs:.1f}s", file=sys.stderr)


@pytest.mark.parametrize("name", ["wgmma_check", "cluster_check"])
def test_gpu_check_kernels_compile_for_sm90a(tmp_path, name):
    """csrc/dkv_wgmma.cuh and csrc/dkv_cluster.cuh with their GPU check kernels (tests/gpu/wgmma_check.cu,
    tests/gpu/cluster_check.cu) compile for sm_90a."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = ROOT / "tests" / "gpu" / f"{name}.cu"
    cmd = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a", "-I", str(CSRC),
           "-c", str(src), "-o", str(tmp_path / f"{name}.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--wgmma"], ["--cluster"], ["--sm90", "--forward-only", "--quick"], ["--sm90-bwd", "--quick"]],
                         ids=["wgmma", "cluster", "sm90-forward", "sm90-backward"])
def test_wgmma_building_blocks_and_kernels_on_the_cpu_emulation(mode):
    """The wgmma and cluster check kernels, the wgmma forward and the wgmma dK/dV kernel on the host
    emulation (csrc/emulation/emulate.py --wgmma / --cluster / --sm90 --quick / --sm90-bwd --quick): tile
    layout, descriptors, fragment packing, the exchange between the blocks of a cluster, the forward's
    masking and online softmax, and the dK/dV reader walk agree with torch and the reference (and the
    emulation refuses a planted transaction-count bug); the GPU tests check that the hardware reads the
    layouts the same way.
    One test per mode, so that test workers (pytest -n) run them side by side."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler for the emulation build")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(CSRC / "emulation" / "emulate.py"), *mode], capture_output=True,
                          text=True, env=env, timeout=1200)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_arch_list_parsing(monkeypatch):
    config = _build_config()
    assert config.parse_arch_list(None) == ["8.0", "9.0a"]
    assert config.parse_arch_list("8.6;9.0+PTX") == ["8.6", "9.0+PTX"]
    assert config.parse_arch_list("Hopper") == ["9.0a"]
    assert config.gencode_flags(["9.0+PTX"]) == [
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST: the DualKV kernels need compute capability 8.0"):
        config.parse_arch_list("7.5")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    kwargs = config.extension_kwargs()
    assert "-gencode=arch=compute_90a,code=sm_90a" in kwargs["extra_compile_args"]["nvcc"]
    assert not any("compute_80" in f for f in kwargs["extra_compile_args"]["nvcc"])
    assert kwargs["include_dirs"] == [str(CSRC)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-install error path")
def test_backend_cuda_on_cpu_says_not_built():
    from dualkv.core.backends import available_backends, get_backend

    backend = get_backend("cuda")
    assert not backend.is_available()
    assert backend.unavailable_reason().startswith("the CUDA extension is not built: ")
    assert "cuda" not in available_backends()
    layout = PackedLayout.from_lengths([5], [[3, 2]])
    q = torch.randn(layout.total_tokens, 2, 64, dtype=torch.bfloat16)
    k = torch.randn(layout.total_tokens, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="the CUDA extension is not built"):
        dualkv_attention(q, k, k.clone(), layout, backend="cuda")
    # "auto" never lands on an unavailable backend.
    out = dualkv_attention(q.float(), k.float(), k.float(), layout, backend="auto")
    assert out.shape == q.shape


def test_auto_follows_the_measured_table_per_head_dim(monkeypatch):
    """On CUDA tensors "auto" takes, in fp16 / bf16 where the CUDA extension runs the wgmma kernels,
    the CUDA backend at head dims 512, 192, 128 and 64, and at 256 (and at 128 from 16K-key prompts) its
    forward with Triton's Gluon backward (the CUDA backend alone where that cannot run); the usual order
    everywhere else; it never starts a build."""
    from dualkv.core import backends
    from dualkv.core.backends import resolve_backend

    cuda = backends.get_backend("cuda")
    assert cuda.runs_wgmma(256) is False  # CPU machine: no extension, no build started, no error
    usual = resolve_backend("auto", "cuda")
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.bfloat16) == usual
    asked = []
    monkeypatch.setattr(cuda, "runs_wgmma", lambda head_dim, device=None: asked.append(head_dim) or True)
    # d = 256: the CUDA forward with Triton's Gluon backward where that can run, else the CUDA backend
    at_256 = "cuda+triton" if backends._triton_gluon_backward() and usual == "triton" else "cuda"
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.bfloat16) == at_256
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.float16) == at_256
    monkeypatch.setenv("DUALKV_TRITON_GLUON_BWD", "0")
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.bfloat16) == "cuda"
    monkeypatch.delenv("DUALKV_TRITON_GLUON_BWD")
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.float32) == usual
    assert resolve_backend("auto", "cuda", head_dim=128, dtype=torch.bfloat16) == "cuda"
    # d = 128 by prompt length: the CUDA backend below 16K keys, its forward with Triton's backward from there
    long_pair = "cuda+triton" if backends._triton_gluon_backward() and usual == "triton" else "cuda"
    assert resolve_backend("auto", "cuda", head_dim=128, dtype=torch.bfloat16, longest_prompt=16383) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=128, dtype=torch.bfloat16, longest_prompt=16384) == long_pair
    # a window, softcap or separate context (not plain_packed): Triton's fast backward does not run, the CUDA backend
    assert resolve_backend("auto", "cuda", head_dim=128, dtype=torch.bfloat16, longest_prompt=16384,
                           plain_packed=False) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.bfloat16, plain_packed=False) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=64, dtype=torch.bfloat16, longest_prompt=1 << 17) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=64, dtype=torch.bfloat16) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=512, dtype=torch.bfloat16) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=192, dtype=torch.bfloat16) == "cuda"
    assert resolve_backend("auto", "cuda", head_dim=96, dtype=torch.bfloat16) == usual  # not measured
    assert resolve_backend("auto", "cpu", head_dim=256, dtype=torch.bfloat16) == "reference"
    assert resolve_backend("triton" if usual == "triton" else "reference", "cuda", head_dim=256,
                           dtype=torch.bfloat16) != "cuda"  # an explicit choice is kept
    assert asked == [256, 256, 256, 128, 128, 128, 128, 256, 64, 64, 512, 192]
    monkeypatch.setattr(cuda, "runs_wgmma", lambda head_dim, device=None: False)
    assert resolve_backend("auto", "cuda", head_dim=256, dtype=torch.bfloat16) == usual


def test_auto_is_told_the_longest_prompt(monkeypatch):
    """Both public functions tell ``resolve_backend`` the longest prompt's keys (the layout's, or
    ``context_seqlen``), so "auto" can follow the table by prompt length, and whether the call is the
    packed layout without a window or softcap (where Triton's Gluon backward runs)."""
    from dualkv.core import flash_attn_dualkv_varlen_func, interface

    seen = []
    real = interface.resolve_backend
    monkeypatch.setattr(interface, "resolve_backend",
                        lambda *a, **kw: seen.append((kw["longest_prompt"], kw["plain_packed"])) or real(*a, **kw))
    layout = PackedLayout.from_lengths([7, 12], [[3, 2], [4]])
    q = torch.randn(layout.total_tokens, 2, 16)
    k = torch.randn(layout.total_tokens, 1, 16)
    dualkv_attention(q, k, k.clone(), layout)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    kc = torch.randn(9, 1, 16)
    flash_attn_dualkv_varlen_func(q[:5], kc, kc.clone(), k[:5], k[:5].clone(), cu, cu, 3, 9, 3)
    dualkv_attention(q, k, k.clone(), layout, window=4)
    dualkv_attention(q, k, k.clone(), layout, softcap=30.0)
    assert [kw[0] for kw in seen] == [12, 9, 12, 12]
    assert [kw[1] for kw in seen] == [True, False, False, False]  # only the first: packed, no window / softcap


def test_auto_pairs_triton_forward_with_cuda_backward_at_512_on_sm90(monkeypatch):
    """At head dim 512, where the wgmma kernels do not run (DUALKV_CUDA_WGMMA_BWD=0: the mma.sync
    backward), "auto" takes Triton's forward and the CUDA backward when the extension is built and the
    GPU is an sm_90 one (the measured table); the usual order otherwise."""
    from dualkv.core import backends
    from dualkv.core.backends import resolve_backend

    cuda = backends.get_backend("cuda")
    assert cuda.built_for_sm90() is False  # CPU machine: no extension, no build started, no error
    usual = resolve_backend("auto", "cuda")
    assert resolve_backend("auto", "cuda", head_dim=512, dtype=torch.bfloat16) == usual
    monkeypatch.setattr(cuda, "built_for_sm90", lambda device=None: True)
    paired = "triton+cuda" if usual == "triton" else usual  # the pair needs Triton too
    assert resolve_backend("auto", "cuda", head_dim=512, dtype=torch.bfloat16) == paired
    assert resolve_backend("auto", "cuda", head_dim=512, dtype=torch.float16) == paired
    assert resolve_backend("auto", "cuda", head_dim=512, dtype=torch.float32) == usual
    assert resolve_backend("auto", "cuda", head_dim=96, dtype=torch.bfloat16) == usual  # not measured
    assert resolve_backend("auto", "cpu", head_dim=512, dtype=torch.bfloat16) == "reference"


def test_auto_never_builds_the_extension(monkeypatch):
    """A prebuilt module that is found but fails to load makes runs_wgmma False; no just-in-time build."""
    from dualkv.core.backends import cuda

    def broken():
        raise ImportError("undefined symbol")

    def no_build():
        raise AssertionError("auto started a just-in-time build")

    monkeypatch.setattr(cuda, "_static_reason", lambda: "")
    monkeypatch.setattr(cuda, "_prebuilt_available", lambda: True)
    monkeypatch.setattr(cuda, "_load_prebuilt", broken)
    monkeypatch.setattr(cuda, "_jit_build", no_build)
    monkeypatch.setitem(cuda._state, "ops", None)
    assert cuda.runs_wgmma(256, device=0) is False


def test_library_file_override_names_the_file(monkeypatch, tmp_path):
    """DUALKV_CUDA_LIBRARY: that file or a clear error naming the variable and the file; never the
    installed module or a just-in-time build instead."""
    from dualkv.core.backends import cuda

    def no_build():
        raise AssertionError("a just-in-time build started although DUALKV_CUDA_LIBRARY is set")

    monkeypatch.setattr(cuda, "_static_reason", lambda: "")
    monkeypatch.setattr(cuda, "_jit_build", no_build)
    monkeypatch.setitem(cuda._state, "ops", None)
    monkeypatch.setitem(cuda._state, "error", None)
    lib = tmp_path / "_C.so"
    monkeypatch.setenv("DUALKV_CUDA_LIBRARY", str(lib))
    assert cuda.unavailable_reason() == f"DUALKV_CUDA_LIBRARY={lib}: no such file"
    with pytest.raises(RuntimeError, match="DUALKV_CUDA_LIBRARY=.*_C.so: no such file"):
        cuda.load_extension()
    lib.write_text("not a shared library")
    monkeypatch.setitem(cuda._state, "error", None)
    assert cuda._ops_if_built() is None
    with pytest.raises(RuntimeError, match="DUALKV_CUDA_LIBRARY=.*_C.so: loading it failed"):
        cuda.load_extension()


def test_check_supported_names_the_argument():
    from dualkv.core.backends import cuda

    q = torch.empty(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: the cuda backend needs CUDA tensors"):
        cuda.check_supported(q, q, q, None, None)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="q: the cuda backend supports float16 and bfloat16"):
            cuda.check_supported(q.float().cuda(), q, q, None, None)
        with pytest.raises(ValueError, match="q: the cuda backend supports headdim"):
            cuda.check_supported(torch.empty(4, 2, 80, dtype=torch.bfloat16, device="cuda"), q, q, None, None)


def test_emulation_only_names_a_case_of_its_list():
    """emulate.py --only out of range is a usage error naming the flag and the range (before any build)."""
    import importlib.util

    script = CSRC / "emulation" / "emulate.py"
    spec = importlib.util.spec_from_file_location("emulate", script)
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    n_bwd, n_default = len(emulate.SM90_BWD_CASES), len(emulate.CASES)
    for args, top in ((["--sm90-bwd", "--only", str(n_bwd)], n_bwd - 1), (["--only", "-1"], n_default - 1)):
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"--only: expected a case index 0 .. {top}, got {args[-1]}" in proc.stderr


def test_backend_pairs_name_a_forward_and_a_backward():
    from dualkv.core.backends import BACKEND_CHOICES, get_backend, resolve_backend, split_backend

    assert split_backend("cuda") == ("cuda", "cuda")
    assert split_backend("triton+cuda") == ("triton", "cuda")
    assert "triton+cuda" in BACKEND_CHOICES
    for bad in ("triton+", "+cuda", "triton+cuda+reference", "tritn+cuda", "fast"):
        with pytest.raises(ValueError, match="forward\\+backward pair"):
            split_backend(bad)
    with pytest.raises(ValueError, match="forward\\+backward pair"):
        get_backend("triton+cuda")  # one module per name
    # an explicit pair is checked half by half: the CUDA half is not built on this machine
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available"):
        resolve_backend("reference+cuda", "cpu")
    assert resolve_backend("reference+reference", "cpu") == "reference+reference"


def test_a_pair_runs_one_backend_forward_and_the_other_backward(monkeypatch):
    """backend="triton+reference": Triton's forward (interpreter), the reference backward on its out
    and lse; the gradients equal the reference's own."""
    from dualkv.core import PackedLayout, dualkv_attention
    from dualkv.core.backends import get_backend

    triton = get_backend("triton")
    if not triton.is_available():
        pytest.skip(triton.unavailable_reason())
    calls = []
    for name in ("triton", "reference"):
        module = get_backend(name)
        for fn in ("forward", "backward"):
            original = getattr(module, fn)
            monkeypatch.setattr(module, fn, lambda *a, _f=original, _n=f"{name}.{fn}": calls.append(_n) or _f(*a))
    torch.manual_seed(0)
    layout = PackedLayout.from_lengths([9], [[5, 3]])
    T = layout.total_tokens
    q, k, v = (torch.randn(T, h, 32, requires_grad=True) for h in (2, 1, 1))
    dout = torch.randn(T, 2, 32)
    grads = {}
    for backend in ("triton+reference", "reference"):
        out = dualkv_attention(q, k, v, layout, backend=backend)
        grads[backend] = (out, *torch.autograd.grad(out, (q, k, v), dout))
    assert calls == ["triton.forward", "reference.backward", "reference.forward", "reference.backward"]
    for got, want in zip(grads["triton+reference"], grads["reference"]):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
