"""Shared test helpers: random rollout batches and the replicated baseline built with PyTorch's own attention."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from dualkv.core import PackedLayout


def count_calls(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.<name>`` (for the test's duration) so that every call is recorded and still runs;
    returns the list of recorded calls, one (args, kwargs) pair each."""
    calls = []
    real = getattr(owner, name)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    return calls


def random_lengths(rng: random.Random, groups=(1, 3), n=(1, 4), p=(1, 40), r=(1, 30)):
    G = rng.randint(*groups)
    prompt_lens = [rng.randint(*p) for _ in range(G)]
    response_lens = [[rng.randint(*r) for _ in range(rng.randint(*n))] for _ in range(G)]
    return prompt_lens, response_lens


def random_qkv(layout: PackedLayout, H: int, Hkv: int, d: int, dtype=torch.float64, device="cpu", requires_grad=True):
    T = layout.total_tokens
    q = torch.randn(T, H, d, dtype=dtype, device=device)
    k = torch.randn(T, Hkv, d, dtype=dtype, device=device)
    v = torch.randn(T, Hkv, d, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def replicated_attention(q, k, v, layout: PackedLayout, scale: float, window=None, softcap=None):
    """Standard causal attention over the N replicated sequences (prompt copied into every row).

    Uses torch's scaled_dot_product_attention row by row (with an explicit mask for windows and the
    math path for softcap). Returns (T_rep, H, d) in the replicated order of ``replicated_index``.
    """
    idx, cu = layout.replicated_index()
    rep = q.shape[1] // k.shape[1]
    outs = []
    for b in range(layout.num_rows):
        s, e = int(cu[b]), int(cu[b + 1])
        qs, ks, vs = (t[idx[s:e]].transpose(0, 1) for t in (q, k, v))  # (H, n, d)
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        n = e - s
        if softcap is None and window is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            pos = torch.arange(n, device=q.device)
            mask = pos[None, :] <= pos[:, None]
            if window is not None:
                mask &= (pos[:, None] - pos[None, :]) < window
            scores = qs @ ks.transpose(-1, -2) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def padded_rows(groups, rng: random.Random, pad_id: int = 0, shuffle: bool = True):
    """veRL-style padded rows from [(prompt (P,), [resp (R,), ...]), ...]: left-padded prompts,
    right-padded responses, a uid per row; rows optionally shuffled. Returns
    (input_ids (B, L), attention_mask (B, L), response_mask (B, Lr), uid list, row list of (g, i))."""
    rows = [(g, i) for g, (_, rs) in enumerate(groups) for i in range(len(rs))]
    if shuffle:
        rng.shuffle(rows)
    Lp = max(p.numel() for p, _ in groups) + rng.randint(0, 3)
    Lr = max(r.numel() for _, rs in groups for r in rs) + rng.randint(0, 3)
    B = len(rows)
    ids = torch.full((B, Lp + Lr), pad_id, dtype=torch.long)
    attn = torch.zeros(B, Lp + Lr, dtype=torch.long)
    resp_mask = torch.zeros(B, Lr, dtype=torch.long)
    for b, (g, i) in enumerate(rows):
        p, r = groups[g][0], groups[g][1][i]
        ids[b, Lp - p.numel(): Lp] = p
        attn[b, Lp - p.numel(): Lp] = 1
        ids[b, Lp: Lp + r.numel()] = r
        attn[b, Lp: Lp + r.numel()] = 1
        resp_mask[b, : r.numel()] = 1
    uid = [f"prompt-{g}" for g, _ in rows]
    return ids, attn, resp_mask, uid, rows


# ------------------------------------------------------------- Triton kernels compiled without a GPU
_COMPILE_SPECS = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

for spec in json.loads(open(sys.argv[1]).read()):
    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"])
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    assert len(compiled.asm["cubin"]) > 0, spec["name"]
    # a warp-specialised kernel hands registers between its producer and consumers
    split = "setmaxnreg" in compiled.asm["ptx"]
    print("compiled", spec["name"], json.dumps(spec["constexprs"], sort_keys=True),
          "warp-specialised" if split else "-", flush=True)
"""


def _launch_spec(kernel, args: tuple, kwargs: dict) -> dict:
    """A kernel launch as ASTSource arguments: Triton's own type of each argument, constexprs kept."""
    import inspect

    from triton.runtime.jit import mangle_type

    fn = getattr(kernel, "fn", kernel)
    params = list(inspect.signature(fn).parameters.values())
    values = dict(zip((p.name for p in params), args))
    values.update({k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")})
    signature, constexprs = {}, {}
    for p in params:
        v = values[p.name]
        ty = "constexpr" if "constexpr" in str(p.annotation) else mangle_type(v)
        signature[p.name] = ty
        if ty == "constexpr":
            constexprs[p.name] = v
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs, options=options,
                specialization=_specialization(kernel, params, values))


def _specialization(kernel, params, values: dict) -> dict:
    """What Triton compiles a variant per (besides types and constexprs): each pointer's 16-byte
    alignment ("D" where aligned) and each integer's being 1 or a multiple of 16, except where the
    kernel says not to (``do_not_specialize`` / ``do_not_specialize_on_alignment``)."""
    import torch

    def listed(attr):  # a JITFunction keeps the lists as attributes, the interpreter's function in kwargs
        names = getattr(kernel, attr, None) or getattr(kernel, "kwargs", {}).get(attr) or ()
        return {params[x].name if isinstance(x, int) else x for x in names}

    skip, skip_alignment = listed("do_not_specialize"), listed("do_not_specialize_on_alignment")
    spec = {}
    for p in params:
        v = values[p.name]
        if p.name in skip or (isinstance(v, torch.Tensor) and p.name in skip_alignment):
            continue
        if isinstance(v, torch.Tensor):
            spec[p.name] = "D" if v.data_ptr() % 16 == 0 else ""
        elif isinstance(v, int) and not isinstance(v, bool) and "constexpr" not in str(p.annotation):
            spec[p.name] = "1" if v == 1 else "D" if v % 16 == 0 else ""
    return spec


def record_triton_launches(monkeypatch, module, names) -> dict:
    """Wrap the kernels ``module.<name>`` so that every launch still runs and is also recorded (as
    ASTSource arguments, one entry per distinct launch) in the returned dict."""
    import json

    specs = {}

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                spec = _launch_spec(self.kernel, args, kwargs)
                specs[json.dumps(spec, sort_keys=True)] = spec
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recorder(getattr(module, name)))
    return specs


def compile_for_hopper(specs: dict, tmp_path, dtypes=("bf16",)) -> list[tuple[str, dict, bool]]:
    """Compile every recorded launch to sm_90 machine code, in a subprocess outside the Triton
    interpreter (which never runs Triton's compiler), with its fp16 arguments and descriptors as each
    of ``dtypes`` (the interpreter has no bf16, the GPU runs it). Skips where Triton has no
    ahead-of-time compile API. Returns (kernel name, constexprs, warp-specialised or not) per launch."""
    import json
    import os
    import subprocess
    import sys

    import pytest
    import triton

    if not hasattr(triton, "compile"):
        pytest.skip("this Triton has no ahead-of-time compile API")
    launches = {}
    for spec in specs.values():
        for dtype in dtypes:
            typed = {**spec, "signature": {k: v.replace("fp16", dtype) for k, v in spec["signature"].items()}}
            launches[json.dumps(typed, sort_keys=True)] = typed
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(list(launches.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SPECS, str(path)], env=env, capture_output=True, text=True,
                         timeout=900)
    if "ImportError" in run.stderr and ("GPUTarget" in run.stderr or "ASTSource" in run.stderr):
        pytest.skip("this Triton has no ahead-of-time compile API")
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [line.split(" ", 2) for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert len(lines) == len(launches), run.stdout[-2000:]
    return [(name, json.loads(rest.rsplit(" ", 1)[0]), rest.endswith(" warp-specialised")) for _, name, rest in lines]


def compute_sanitizer() -> str | None:
    """The compute-sanitizer executable (on PATH, or under CUDA_HOME or /usr/local/cuda), or None."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "compute-sanitizer").is_file():
            return str(Path(home) / "bin" / "compute-sanitizer")
    return None


def check_sanitizer_log(proc, done: str) -> None:
    """Judge a compute-sanitizer run (a finished subprocess) of a script that prints `done` at its end:
    skip where the sanitizer cannot attach, else require the script to finish and the tool's summary to
    be clean (memcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed
    (0 errors, ...)")."""
    import pytest

    log = proc.stdout + proc.stderr
    if "Device not supported" in log:
        pytest.skip("compute-sanitizer cannot attach to this device (sandboxed runtime)")
    assert done in log, log[-4000:]
    clean = "ERROR SUMMARY: 0 errors" in log or "RACECHECK SUMMARY: 0 hazards displayed (0 errors" in log
    assert proc.returncode == 0 and clean, log[-4000:]
