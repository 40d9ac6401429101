"""What the compiler made of a Hopper kernel, on a machine without a GPU: registers, spills, and the
instructions of each warp role (producer / consumers), from nvcc's SASS.

    python csrc/sass_report.py                         # the default sm_90a kernels (PRESETS), d = 64-512
    python csrc/sass_report.py --kernel dkdv-d128      # one of them
    python csrc/sass_report.py --instantiate "dkv_bwd_sm90_ws.cuh:dkv_dkdv_sm90_ws_kernel<Bf16, 128, true, false, true, true>"
    python csrc/sass_report.py --json report.json

Each kernel is compiled alone (one explicit instantiation in a scratch translation unit, the
extension's nvcc flags, sm_90a), and its cubin (``cuobjdump -xelf``) disassembled with its source
lines (``nvdisasm -g``; the kernels are built with ``-lineinfo``).
The warp-specialised kernels give each role its registers with ``setmaxnreg``; the SASS is cut at
each ``USETMAXREG`` into regions (the code before the first is the block's common start), and each
region is counted: all instructions, ``HGMMA`` (wgmma), ``MUFU``, shared-memory loads by width,
shared-memory stores, local-memory stores / loads (``STL`` / ``LDL``: spills), barriers. A region
runs to the next ``USETMAXREG``, which is how nvcc 13 lays these kernels out (the consumers' code,
then the producer's); a change of layout shows as a region without its ``HGMMA``. Each local-memory
instruction is also traced to the source line it was spilled for.

Needs ``nvcc`` (PATH or ``CUDA_HOME``) and ``cuobjdump`` / ``nvdisasm``: the toolkit's, or the
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels (installed with the ``test`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

CSRC = Path(__file__).resolve().parent

# name -> (header, instantiation): the kernels the sm_90a defaults run (docs/cuda.md).
PRESETS = {
    # the forward at d = 128: warp-specialised, bulk tensor copies, 176-key tiles, a block per query tile
    "fwd-d128": ("dkv_fwd_sm90.cuh", "dkv_fwd_sm90_kernel<Bf16, 128, true, true, true>"),
    # the same with the merged key walk (DUALKV_CUDA_FWD_MERGE=1)
    "fwd-d128-merge": ("dkv_fwd_sm90.cuh", "dkv_fwd_sm90_kernel<Bf16, 128, true, true, true, false, true>"),
    "fwd-d64": ("dkv_fwd_sm90.cuh", "dkv_fwd_sm90_kernel<Bf16, 64, true, true>"),
    # the backward at d = 128 / 64: schedule 6 (dK/dV with dQ inside) with the bulk-tensor-copy producer
    "dkdv-d128": ("dkv_bwd_sm90_ws.cuh", "dkv_dkdv_sm90_ws_kernel<Bf16, 128, true, false, true>"),
    "dkdv-d64": ("dkv_bwd_sm90_ws.cuh", "dkv_dkdv_sm90_ws_kernel<Bf16, 64, true, false, true>"),
    # d = 192 / 256 / 512: the in-turn forward and the role-split dQ / dK/dV kernels, bulk tensor copies
    # (no setmaxnreg: one region, the whole kernel)
    **{f"{kind}-d{d}": (header, f"{kernel}<Bf16, {d}, {args}>")
       for d in (192, 256, 512)
       for kind, header, kernel, args in (("fwd", "dkv_fwd_sm90.cuh", "dkv_fwd_sm90_kernel", "false, true"),
                                          ("dq", "dkv_bwd_sm90_split.cuh", "dkv_dq_sm90_split_kernel", "true"),
                                          ("dkdv", "dkv_bwd_sm90_split.cuh", "dkv_dkdv_sm90_split_kernel", "true"))},
}

_PARAMS = {"dkv_fwd_sm90.cuh": "FwdParams", "dkv_bwd_sm90_ws.cuh": "BwdParams", "dkv_bwd_sm90.cuh": "BwdParams",
           "dkv_bwd_sm90_split.cuh": "BwdParams"}

# instruction class -> what an opcode (the SASS mnemonic, predicate stripped) starts with / is
_CLASSES = {
    "hgmma": lambda op: op.startswith("HGMMA"),
    "mufu": lambda op: op.startswith("MUFU"),
    "lds": lambda op: op == "LDS" or op.startswith("LDS."),
    "lds64": lambda op: op.startswith("LDS") and ".64" in op,
    "lds128": lambda op: op.startswith("LDS") and ".128" in op,
    "ldsm": lambda op: op.startswith("LDSM"),
    "sts": lambda op: op == "STS" or op.startswith("STS."),
    "stl": lambda op: op == "STL" or op.startswith("STL."),
    "ldl": lambda op: op == "LDL" or op.startswith("LDL."),
    "bar": lambda op: op.startswith("BAR"),
}


@dataclass
class Region:
    """One stretch of a kernel's SASS: ``kind`` is "start" (before the first setmaxnreg), "alloc"
    (a role that raises its registers: the consumers) or "dealloc" (one that lowers them: the
    producer); ``regs`` the count it asks for."""

    kind: str
    regs: int | None
    counts: dict[str, int] = field(default_factory=dict)
    # every STL / LDL: (opcode, source file name, line)
    spill_sites: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def spills(self) -> int:
        return self.counts.get("stl", 0) + self.counts.get("ldl", 0)


@dataclass
class KernelReport:
    name: str
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    regions: list[Region] = field(default_factory=list)

    def region(self, kind: str) -> Region:
        found = [r for r in self.regions if r.kind == kind]
        if len(found) != 1:
            raise ValueError(f"{self.name}: expected one {kind!r} region, found {len(found)}")
        return found[0]


def _opcode(line: str) -> str | None:
    """The mnemonic of one SASS instruction line (``/*0470*/  @P0 USETMAXREG.X ...;``), else None."""
    m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)", line)
    return m.group(1) if m else None


def parse_sass(text: str) -> dict[str, list[Region]]:
    """``nvdisasm -g`` (or ``cuobjdump -sass``) output -> for each function (mangled name) its regions,
    counted, with the source line of each local-memory instruction where the text has them."""
    out: dict[str, list[Region]] = {}
    regions: list[Region] | None = None
    where = ("?", 0)
    for line in text.splitlines():
        m = re.match(r"\.text\.(\S+):\s*$", line) or re.search(r"Function : (\S+)", line)
        if m:
            regions = out.setdefault(m.group(1), [Region("start", None)])
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
            continue
        op = _opcode(line) if regions is not None else None
        if op is None:
            continue
        if op.startswith("USETMAXREG") or op.startswith("SETMAXREG"):
            value = re.search(r"0x([0-9a-f]+)\s*;", line)
            regions.append(Region("dealloc" if "DEALLOC" in op else "alloc", int(value.group(1), 16) if value else None))
        counts = regions[-1].counts
        counts["all"] = counts.get("all", 0) + 1
        for name, test in _CLASSES.items():
            if test(op):
                counts[name] = counts.get(name, 0) + 1
        if _CLASSES["stl"](op) or _CLASSES["ldl"](op):
            regions[-1].spill_sites.append((op, *where))
    return out


def parse_ptxas(text: str) -> dict[str, tuple[int | None, int | None, int | None]]:
    """``-Xptxas -v`` output -> for each function (mangled name) (registers, spill store / load bytes)."""
    out: dict[str, tuple[int | None, int | None, int | None]] = {}
    name = None
    spills: tuple[int | None, int | None] = (None, None)
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name, spills = m.group(1), (None, None)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            spills = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = (int(m.group(1)), *spills)
            name = None
    return out


def _wheel_tool(name: str) -> str | None:
    """``name`` from the nvidia-cuda-* wheels (site-packages/nvidia/cu*/bin), if installed."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob(f"cu*/bin/{name}"), reverse=True):
            if candidate.is_file():
                return str(candidate)
    return None


def find_tools() -> tuple[str | None, str | None, str | None]:
    """(nvcc, cuobjdump, nvdisasm): from PATH, CUDA_HOME, else the wheels; None for what is missing."""
    nvcc = _build_config().find_nvcc()
    found = []
    for name in ("cuobjdump", "nvdisasm"):
        tool = shutil.which(name)
        if tool is None and nvcc is not None and (Path(nvcc).parent / name).is_file():
            tool = str(Path(nvcc).parent / name)
        found.append(tool or _wheel_tool(name))
    return nvcc, found[0], found[1]


def missing_tools() -> str | None:
    """Why the report cannot run here, or None."""
    names = ("nvcc", "cuobjdump", "nvdisasm")
    missing = [n for n, tool in zip(names, find_tools()) if tool is None]
    if not missing:
        return None
    return (f"{', '.join(missing)} not found: install the CUDA toolkit, or the nvidia-cuda-cuobjdump and "
            f"nvidia-cuda-nvdisasm wheels (pip install -e \".[test]\")")


def _ensure_executable(path: str) -> None:
    mode = os.stat(path).st_mode
    if not mode & 0o111:  # some wheel installers drop the executable bit
        try:
            os.chmod(path, mode | 0o755)
        except OSError as e:
            raise RuntimeError(f"{path} is not executable and cannot be made so ({e}): chmod +x it") from None


def _build_config():
    sys.path.insert(0, str(CSRC))
    try:
        import build_config
    finally:
        sys.path.pop(0)
    return build_config


def report(header: str, instantiation: str, *, workdir: Path | None = None) -> KernelReport:
    """Compile ``instantiation`` (a kernel template with its arguments, namespace dkv) from ``header``
    (a file in csrc/) for sm_90a alone, and report it."""
    build_config = _build_config()
    why = missing_tools()
    if why:
        raise RuntimeError(why)
    if not (CSRC / header).is_file():
        raise ValueError(f"header: no file {header!r} in {CSRC}")
    if not re.fullmatch(r"\s*\w+\s*<[^;{}]*>\s*", instantiation):
        raise ValueError(f"instantiation: expected a kernel template with its arguments, e.g. "
                         f"'dkv_fwd_sm90_kernel<Bf16, 128, true, true, true>', got {instantiation!r}")
    params = _PARAMS.get(header)
    if params is None:
        raise ValueError(f"header: expected one of {sorted(_PARAMS)}, got {header!r}")
    nvcc, cuobjdump, nvdisasm = find_tools()
    for tool in (cuobjdump, nvdisasm):
        _ensure_executable(tool)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        src, obj = Path(tmp) / "one.cu", Path(tmp) / "one.o"
        src.write_text(f'#include "{header}"\nnamespace dkv {{\ntemplate DKV_GLOBAL void {instantiation}'
                       f"(const DKV_GRID_CONSTANT {params});\n}}\n")
        cmd = [nvcc, *build_config.NVCC_FLAGS, "-std=c++17", "-Xptxas=-v", *build_config.gencode_flags(["9.0a"]),
               "-I", str(CSRC), "-c", str(src), "-o", str(obj)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(f"nvcc failed on {instantiation}:\n{built.stderr[-4000:]}")
        env = dict(os.environ, NVDISASM_PATH=str(Path(nvdisasm).parent),
                   PATH=str(Path(nvdisasm).parent) + os.pathsep + os.environ.get("PATH", ""))
        subprocess.run([cuobjdump, "-xelf", "all", str(obj)], capture_output=True, cwd=tmp, env=env)
        cubins = sorted(Path(tmp).glob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"cuobjdump -xelf found no cubin in the object of {instantiation}")
        sass = subprocess.run([nvdisasm, "-g", "-c", str(cubins[0])], capture_output=True, text=True)
        if sass.returncode != 0:
            raise RuntimeError(f"nvdisasm -g failed: {(sass.stderr or sass.stdout)[-2000:]}")
    functions = parse_sass(sass.stdout)
    ptxas = parse_ptxas(built.stderr + built.stdout)
    if len(functions) != 1:
        raise RuntimeError(f"expected one kernel in the SASS of {instantiation}, found {sorted(functions)}")
    (name, regions), = functions.items()
    regs, stores, loads = ptxas.get(name, (None, None, None))
    return KernelReport(name=name, registers=regs, spill_store_bytes=stores, spill_load_bytes=loads, regions=regions)


def format_report(label: str, rep: KernelReport) -> str:
    cols = ("all", "hgmma", "mufu", "lds", "lds64", "lds128", "ldsm", "sts", "stl", "ldl", "bar")
    lines = [f"{label}: {rep.name}",
             f"  ptxas: {rep.registers} registers at launch, spill stores {rep.spill_store_bytes} B, "
             f"spill loads {rep.spill_load_bytes} B (the whole kernel, every role)",
             "  region            " + " ".join(f"{c:>6}" for c in cols)]
    for r in rep.regions:
        what = {"start": "start", "alloc": f"alloc {r.regs}", "dealloc": f"dealloc {r.regs}"}[r.kind]
        lines.append(f"  {what:<18}" + " ".join(f"{r.counts.get(c, 0):>6}" for c in cols))
    # the producer's spills are by design
    compute = [(r.kind, *s) for r in rep.regions if r.kind != "dealloc" for s in r.spill_sites]
    if compute:
        lines.append("  local-memory stores / loads outside the producer, by the source line they were spilled for:")
        tally: dict[tuple[str, str, int], list[str]] = {}
        for kind, op, file, line in compute:
            tally.setdefault((kind, file, line), []).append(op.split(".")[0])
        for (kind, file, line), ops in sorted(tally.items()):
            lines.append(f"    {kind:<8} {file}:{line}  " + ", ".join(f"{ops.count(o)} {o}" for o in sorted(set(ops))))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", action="append", choices=sorted(PRESETS),
                    help="a preset (repeatable; default: all of them)")
    ap.add_argument("--instantiate", action="append", default=[], metavar="HEADER:KERNEL<ARGS>",
                    help="a kernel of csrc/HEADER with its template arguments (repeatable)")
    ap.add_argument("--json", help="also write the reports to this file")
    args = ap.parse_args(argv)
    jobs = [(name, *PRESETS[name]) for name in (args.kernel or ([] if args.instantiate else sorted(PRESETS)))]
    for spec in args.instantiate:
        header, sep, inst = spec.partition(":")
        if not sep:
            ap.error(f"--instantiate: expected HEADER:KERNEL<ARGS>, got {spec!r}")
        jobs.append((inst.strip(), header.strip(), inst.strip()))
    why = missing_tools()
    if why:
        ap.error(why)
    results = {}
    for label, header, inst in jobs:
        rep = report(header, inst)
        results[label] = asdict(rep)
        print(format_report(label, rep), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
