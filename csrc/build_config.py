"""Compiler flags of the ``dualkv._C`` CUDA extension, shared by setup.py, the just-in-time loader
(``dualkv.core.backends.cuda``) and the compile-only CI test.

Targets follow ``TORCH_CUDA_ARCH_LIST`` when it is set (``"8.0;9.0a"``, ``"8.6 9.0+PTX"``, or names
such as ``"Ampere;Hopper"``), else sm_80 and sm_90a. The kernels use mma.sync with bf16 operands,
so compute capability 8.0 is the minimum.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

CSRC = Path(__file__).resolve().parent
DEFAULT_ARCHS = ("8.0", "9.0a")
MIN_CAPABILITY = (8, 0)
_NAMED = {"ampere": ("8.0", "8.6"), "ada": ("8.9",), "hopper": ("9.0a",), "blackwell": ("10.0", "12.0")}

NVCC_FLAGS = [
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xptxas=-O3",
]
CXX_FLAGS = ["-O3"]  # the C++ standard is left to torch.utils.cpp_extension (its headers set the minimum)


def find_nvcc() -> str | None:
    """nvcc from PATH, CUDA_HOME, CUDA_PATH or /usr/local/cuda; None without a CUDA toolkit."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def parse_arch_list(value: str | None) -> list[str]:
    """``TORCH_CUDA_ARCH_LIST``-style text -> arch strings such as ``"8.0"``, ``"9.0a"``, ``"9.0+PTX"``."""
    if not value or not value.strip():
        return list(DEFAULT_ARCHS)
    archs: list[str] = []
    for token in re.split(r"[;\s,]+", value.strip()):
        if not token:
            continue
        ptx = token.endswith("+PTX")
        base = token[:-4] if ptx else token
        expanded = _NAMED.get(base.lower(), (base,))
        for arch in expanded:
            if not re.fullmatch(r"\d+\.\d+a?", arch):
                raise ValueError(f"TORCH_CUDA_ARCH_LIST: expected entries like 8.0, 9.0a or 9.0+PTX, got {token!r}")
            major, minor = (int(x) for x in arch.rstrip("a").split("."))
            if (major, minor) < MIN_CAPABILITY:
                raise ValueError(
                    f"TORCH_CUDA_ARCH_LIST: the DualKV kernels need compute capability 8.0 or newer (mma.sync with "
                    f"bf16), got {token!r}"
                )
            archs.append(arch + ("+PTX" if ptx else ""))
    if not archs:
        return list(DEFAULT_ARCHS)
    return archs


def gencode_flags(archs: list[str]) -> list[str]:
    """``-gencode`` flags for each arch (``9.0a`` -> ``arch=compute_90a,code=sm_90a``)."""
    flags: list[str] = []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        arch = arch[:-4] if ptx else arch
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def nvcc_flags(archs: list[str] | None = None) -> list[str]:
    """Every nvcc flag of a kernel translation unit (arch flags included)."""
    if archs is None:
        archs = parse_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    return [*NVCC_FLAGS, *gencode_flags(archs)]


def kernel_sources() -> list[Path]:
    """The kernel translation units (every .cu file of csrc/), sorted."""
    return sorted(CSRC.glob("*.cu"))


def extension_kwargs() -> dict:
    """Keyword arguments of ``CUDAExtension`` / ``torch.utils.cpp_extension.load`` (sources excluded)."""
    return {
        "extra_compile_args": {"cxx": list(CXX_FLAGS), "nvcc": nvcc_flags()},
        "include_dirs": [str(CSRC)],
    }
