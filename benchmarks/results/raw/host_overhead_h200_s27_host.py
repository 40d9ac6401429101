"""Host (CPU) cost per call of the attention op's layers, on a tiny shape where the GPU is never the bottleneck."""
import time, torch
from dualkv.core import dualkv_attention
from dualkv.core.interface import _backend_name
from dualkv.core.ops import attention_fwd
from dualkv.core.reference import AttnMeta
from dualkv.core.validation import check_attention_inputs
from dualkv.core.backends import cuda
from benchmarks.harness import AttnConfig, _random_qkv

dev = torch.device("cuda")
cfg = AttnConfig.parse("N=2,P=256,R=64,H=32,H_kv=8,d=128")
layout = cfg.layout(dev)
q, k, v = _random_qkv(cfg, dev, 0)
meta = AttnMeta.from_layout(layout)
scale = 128 ** -0.5

def per_call(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6

rows = {
    "check_attention_inputs": lambda: check_attention_inputs(q, k, v, layout, None, None, None),
    "AttnMeta.from_layout": lambda: AttnMeta.from_layout(layout),
    "_backend_name(auto)": lambda: _backend_name("auto", True, 128, True),
    "cuda.check_supported": lambda: cuda.check_supported(q, k, v, None, None),
    "ops.fwd (C++ op)": lambda: cuda._ops().fwd(q, k, v, None, None, *meta, scale, -1, 0.0),
    "cuda.forward": lambda: cuda.forward(q, k, v, None, None, meta, scale, None, None),
    "attention_fwd (custom op)": lambda: attention_fwd(q, k, v, None, None, list(meta), scale, -1, 0.0, False, "cuda"),
    "dualkv_attention(cuda)": lambda: dualkv_attention(q, k, v, layout, backend="cuda"),
    "dualkv_attention(auto)": lambda: dualkv_attention(q, k, v, layout),
    "torch.empty x2 (yardstick)": lambda: (torch.empty(q.shape, device=dev), torch.empty(32, 4, device=dev)),
}
for name, fn in rows.items():
    print(f"{name:32s} {per_call(fn):8.1f} us/call", flush=True)
qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
print(f"{'dualkv_attention(auto), grad':32s} {per_call(lambda: dualkv_attention(qg, kg, vg, layout)):8.1f} us/call")
out = dualkv_attention(qg, kg, vg, layout)
do = torch.randn_like(out)
def fb():
    torch.autograd.grad(dualkv_attention(qg, kg, vg, layout), (qg, kg, vg), do)
print(f"{'forward+backward (auto)':32s} {per_call(fb):8.1f} us/call")
