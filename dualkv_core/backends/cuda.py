"""CUDA backend: the csrc/ kernels behind the op contract (``dualkv.core.backends``).

Forward: one launch; per query tile the kernel walks two physically disjoint KV regions -- the
group's shared prompt (context) keys, then the segment's own keys -- with a logical-position causal
mask, an online softmax across both, and an independent partial tile at the end of each region.
Backward: a query-parallel kernel writes dQ directly; a key-parallel kernel accumulates dK/dV in
registers, writes response keys directly, and adds the shared-prompt dK/dV partials of every reading
sequence into an fp32 workspace with atomics; a convert kernel casts that workspace once. On sm_90
at head dim 128 the dK/dV kernel also computes dQ and adds it into an fp32 workspace with bulk
reduce-adds (no dQ kernel; 2-5% faster forward+backward on an H200, an extra H x T x 144 floats
during the backward), so there dQ too depends on the order of the additions.
``deterministic=True`` instead walks every reader of a prompt key tile in one block and writes dQ
from its own kernel (no atomics, bit-identical run to run; fewer, longer work items).

Loading: the prebuilt extension ``dualkv.core._C`` (``pip install --no-build-isolation .`` on a machine
with a CUDA toolkit and a CUDA build of torch), else a just-in-time build of csrc/ on first use,
cached by torch in its extensions directory. CPU installs have neither: ``backend="cuda"`` then
raises a clear "the CUDA extension is not built" error. ``DUALKV_CUDA_LIBRARY=path/to/_C.so`` loads
that built library file instead, and nothing else (``benchmarks.build_ab`` times two builds that way).

Supported: float16 / bfloat16, head dims 64, 96, 128, 192, 256, 512, GQA/MQA, sliding window,
softcap, compute capability 8.0+.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import threading
from pathlib import Path

import torch

NAME = "cuda"
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256, 512)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_NOT_BUILT = "the CUDA extension is not built: "
_JIT_NAME = "dualkv_cuda_jit"
# Where setup.py may put the prebuilt extension (dualkv._C; dualkv.core._C for a build mapped into
# the dualkv_core package folder).
_MODULE_NAMES = ("dualkv.core._C", "dualkv._C")
# A built library file to load instead of the installed module (no fallback to a just-in-time build).
LIBRARY_VAR = "DUALKV_CUDA_LIBRARY"

_lock = threading.Lock()
_state: dict = {"ops": None, "error": None, "how": None}


def _csrc_dir() -> Path | None:
    """csrc/ of a source checkout (editable install), or None for an installed wheel without it."""
    path = Path(__file__).resolve().parents[2] / "csrc"
    return path if (path / "dkv_api.cpp").is_file() and (path / "build_config.py").is_file() else None


def _cuda_toolkit() -> str | None:
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # noqa: BLE001 - a broken toolchain lookup means "no toolkit"
        return None
    return CUDA_HOME


def _static_reason() -> str:
    """Why the extension cannot be used here without trying to load it ('' if it might)."""
    if torch.version.cuda is None:
        return (
            _NOT_BUILT + f"this torch ({torch.__version__}) has no CUDA support; install a CUDA build of torch on a "
            "GPU machine and run `pip install --no-build-isolation -e .`, or use backend='triton' / 'reference'"
        )
    if not torch.cuda.is_available():
        return _NOT_BUILT + "no CUDA device is visible to torch (torch.cuda.is_available() is False)"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"the CUDA backend needs compute capability 8.0 or newer, got {torch.cuda.get_device_capability()}"
    if _state["error"] is not None:
        return _state["error"]
    return ""


def _library_override() -> str | None:
    """The library file DUALKV_CUDA_LIBRARY names, or None when it is unset or empty."""
    return os.environ.get(LIBRARY_VAR) or None


def _prebuilt_available() -> bool:
    if _library_override() is not None:
        return True  # loading it says what is wrong with it
    for name in _MODULE_NAMES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return bool(_prebuilt_files())


def _prebuilt_files() -> list[Path]:
    """A built ``_C`` library next to the sources (in-place / editable builds), newest first."""
    root = Path(__file__).resolve().parents[2]
    patterns = ("dualkv/_C*.so", "dualkv_core/_C*.so", "build/lib*/dualkv/_C*.so", "build/lib*/dualkv/core/_C*.so")
    found = [f for pattern in patterns for f in root.glob(pattern)]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def _load_prebuilt() -> None:
    """Imports the prebuilt extension, or loads a built library file directly; raises ImportError if
    neither works. With DUALKV_CUDA_LIBRARY set, that file and nothing else."""
    override = _library_override()
    if override is not None:
        if not Path(override).is_file():
            raise ImportError(f"{LIBRARY_VAR}={override}: no such file (expected a built _C library, e.g. "
                              "dualkv_core/_C.cpython-312-x86_64-linux-gnu.so of a build)")
        try:
            torch.ops.load_library(override)
        except OSError as load_err:
            raise ImportError(f"{LIBRARY_VAR}={override}: loading it failed: {load_err}") from load_err
        return
    err = None
    for name in _MODULE_NAMES:
        try:
            importlib.import_module(name)
            return
        except ImportError as e:
            err = e
    files = _prebuilt_files()
    if not files:
        raise err
    try:
        torch.ops.load_library(str(files[0]))
    except OSError as load_err:
        raise ImportError(f"{err}; loading {files[0]} failed: {load_err}") from load_err


def unavailable_reason() -> str:
    reason = _static_reason()
    if reason:
        return reason
    override = _library_override()
    if _state["ops"] is None and override is not None and not Path(override).is_file():
        return f"{LIBRARY_VAR}={override}: no such file"
    if _state["ops"] is None and not _prebuilt_available():
        if _csrc_dir() is None:
            return _NOT_BUILT + "dualkv._C is not installed and no csrc/ source tree is found for a just-in-time build"
        if _cuda_toolkit() is None:
            return _NOT_BUILT + "dualkv._C is not installed and no CUDA toolkit (nvcc) is found for a just-in-time build"
    return ""


def is_available() -> bool:
    return unavailable_reason() == ""


def _jit_build():
    """Builds csrc/ with torch.utils.cpp_extension.load (cached across processes) and registers the ops."""
    import importlib.util as iu

    from torch.utils.cpp_extension import load

    csrc = _csrc_dir()
    spec = iu.spec_from_file_location("dualkv_build_config", csrc / "build_config.py")
    config = iu.module_from_spec(spec)
    spec.loader.exec_module(config)
    kwargs = config.extension_kwargs()
    sources = [str(p) for p in config.kernel_sources()] + [str(csrc / "dkv_api.cpp")]
    os.environ.setdefault("MAX_JOBS", str(max(1, min(16, os.cpu_count() or 1))))
    load(
        name=f"{_JIT_NAME}_{_source_digest(csrc, kwargs)}",
        sources=sources,
        extra_cflags=kwargs["extra_compile_args"]["cxx"],
        extra_cuda_cflags=kwargs["extra_compile_args"]["nvcc"],
        extra_include_paths=kwargs["include_dirs"],
        is_python_module=False,
        verbose=os.environ.get("DUALKV_VERBOSE_BUILD", "0") == "1",
    )


def _source_digest(csrc: Path, kwargs: dict) -> str:
    """Hash of every source and header and of the flags: torch's build cache only tracks the listed
    sources, so a changed header must give a new extension name."""
    h = hashlib.sha256(repr(sorted(kwargs["extra_compile_args"].items())).encode())
    for path in sorted(csrc.glob("*")):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp", ".py") and path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _ops():
    """torch.ops.dualkv_cuda, loading the prebuilt extension or building it on first use."""
    if _state["ops"] is not None:
        return _state["ops"]
    reason = _static_reason()
    if reason:
        raise RuntimeError(f"backend 'cuda' is not available here: {reason}")
    with _lock:
        if _state["ops"] is None:
            try:
                _load_prebuilt()
                _state["how"] = _loaded_how()
            except ImportError as prebuilt_err:
                if _library_override() is not None:  # the file asked for, or an error: never another build
                    _state["error"] = f"{prebuilt_err}"
                    raise RuntimeError(f"backend 'cuda' is not available here: {_state['error']}") from prebuilt_err
                if _csrc_dir() is None or _cuda_toolkit() is None:
                    _state["error"] = _NOT_BUILT + f"importing dualkv._C failed ({prebuilt_err}) and no csrc/ + CUDA toolkit is found for a just-in-time build"
                    raise RuntimeError(f"backend 'cuda' is not available here: {_state['error']}") from prebuilt_err
                try:
                    _jit_build()
                    _state["how"] = "just-in-time build"
                except Exception as err:  # noqa: BLE001 - report any toolchain failure as one clear error
                    _state["error"] = _NOT_BUILT + f"the just-in-time build of csrc/ failed: {err}"
                    raise RuntimeError(f"backend 'cuda' is not available here: {_state['error']}") from err
            _state["ops"] = torch.ops.dualkv_cuda
    return _state["ops"]


def _loaded_how() -> str:
    override = _library_override()
    return f"library file {override} ({LIBRARY_VAR})" if override else "prebuilt dualkv._C"


def load_extension() -> str:
    """Loads (or builds) the extension now; returns how ('prebuilt dualkv._C', 'just-in-time build' or
    'library file PATH (DUALKV_CUDA_LIBRARY)')."""
    _ops()
    return _state["how"]


def runs_wgmma(head_dim: int, device: int | None = None) -> bool:
    """The extension is loaded or importable (this starts no just-in-time build) and runs its Hopper
    wgmma kernels, forward and backward, for this head dim on CUDA device ``device`` (default: the
    current one): an sm_90 GPU, code built for sm_90a, the kernel-choice variables unset or on."""
    if _static_reason() or _ops_if_built() is None:
        return False
    device = torch.cuda.current_device() if device is None else device
    return _runs_wgmma(head_dim, device, os.environ.get("DUALKV_CUDA_WGMMA"), os.environ.get("DUALKV_CUDA_WGMMA_BWD"))


def built_for_sm90(device: int | None = None) -> bool:
    """The extension is loaded or importable (this starts no just-in-time build) and CUDA device
    ``device`` (default: the current one) is an sm_90 GPU (H100 / H200), the card ``auto``'s table
    for d = 512 with the wgmma backward switched off (the mma.sync backward) was measured on."""
    if _static_reason() or _ops_if_built() is None:
        return False
    device = torch.cuda.current_device() if device is None else device
    return torch.cuda.get_device_capability(device) == (9, 0)


def _ops_if_built():
    """The ops when the extension is loaded or its prebuilt module loads; None otherwise (no build)."""
    if _state["ops"] is None and _prebuilt_available():
        with _lock:
            if _state["ops"] is None:
                try:
                    _load_prebuilt()
                except ImportError:
                    return None
                _state["how"] = _loaded_how()
                _state["ops"] = torch.ops.dualkv_cuda
    return _state["ops"]


@functools.lru_cache(maxsize=None)
def _runs_wgmma(head_dim: int, device: int, fwd_choice: str | None, bwd_choice: str | None) -> bool:
    """runs_wgmma, asked of the extension once per head dim, device and kernel-choice variables."""
    return bool(_ops_if_built().wgmma_path(device, head_dim))


def check_supported(q, k, v, window, softcap) -> None:
    if q.device.type != "cuda":
        raise ValueError(f"q: the cuda backend needs CUDA tensors, got device {q.device}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q: the cuda backend supports float16 and bfloat16, got {q.dtype} (use backend='reference' for fp32/fp64)"
        )
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q: the cuda backend supports headdim {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, got {q.shape[-1]}")


def _aligned(t):
    """Rows the kernels can load 16 bytes at a time (else a contiguous copy); None passes through."""
    if t is None:
        return None
    ok = t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()


def _options(window, softcap):
    return (-1 if window is None else int(window)), (0.0 if softcap is None else float(softcap))


def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap):
    """out (total_q, H, d) in q's dtype, lse (H, total_q) float32."""
    ops = _ops()
    w, cap = _options(window, softcap)
    q, k, v, k_ctx, v_ctx = (_aligned(t) for t in (q, k, v, k_ctx, v_ctx))
    return ops.fwd(q, k, v, k_ctx, v_ctx, *meta, float(softmax_scale), w, cap)


def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic):
    """dq, dk, dv (and dk_ctx, dv_ctx when k_ctx is given, else None)."""
    ops = _ops()
    w, cap = _options(window, softcap)
    dout, q, k, v, k_ctx, v_ctx, out = (_aligned(t) for t in (dout, q, k, v, k_ctx, v_ctx, out))
    dq, dk, dv, dk_ctx, dv_ctx = ops.bwd(
        dout, q, k, v, k_ctx, v_ctx, out, lse.contiguous(), *meta, float(softmax_scale), w, cap, bool(deterministic)
    )
    if k_ctx is None:
        return dq, dk, dv, None, None
    return dq, dk, dv, dk_ctx, dv_ctx
