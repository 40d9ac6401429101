"""Build script: maps the four source folders under the ``dualkv.*`` namespace and, on a machine
with a CUDA toolkit and a CUDA build of torch, builds the ``dualkv.core._C`` extension from ``csrc/``.

CPU machines skip the extension with one line saying so; ``backend="cuda"`` then raises a clear
error at run time, and everything else works.
"""

import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()
FOLDERS = {"dualkv.core": "dualkv_core", "dualkv.parallel": "parallel", "dualkv.models": "models", "dualkv.train": "train"}


def find_packages_mapped():
    """Every folder holding an __init__.py below the four roots, named under dualkv.*."""
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            pkg = ".".join([name, *rel.parts]) if rel.parts else name
            packages.append(pkg)
            package_dir[pkg] = str(Path(folder, *rel.parts))
    return packages, package_dir


def cuda_extensions():
    """The csrc extension when it can be built here, else an empty list and one line why not."""
    if os.environ.get("DUALKV_SKIP_CUDA_BUILD", "0") == "1":
        print("dualkv: DUALKV_SKIP_CUDA_BUILD=1, skipping the CUDA extension build", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        print("dualkv: torch is not importable at build time (build isolation?), skipping the CUDA extension build", file=sys.stderr)
        return [], {}
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu")) + sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp")
    )
    if CUDA_HOME is None or torch.version.cuda is None or not sources:
        print("dualkv: no CUDA toolkit / CUDA build of torch found, skipping the CUDA extension build", file=sys.stderr)
        return [], {}
    sys.path.insert(0, str(ROOT / "csrc"))
    from build_config import extension_kwargs  # csrc/build_config.py: flags shared with the JIT loader

    return [CUDAExtension(name="dualkv.core._C", sources=sources, **extension_kwargs())], {"build_ext": BuildExtension}


packages, package_dir = find_packages_mapped()
ext_modules, cmdclass = cuda_extensions()
setup(packages=packages, package_dir=package_dir, ext_modules=ext_modules, cmdclass=cmdclass)
