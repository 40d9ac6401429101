"""Per-kernel times (torch.profiler: the mean of 3 forward+backward calls after one warm-up, dout = ones)
for the (config, kernel-choice variables, backend) cases below, in one process. argv[1] is a tag
printed with each case (which build ran). Run from the repository root: PYTHONPATH=. python <this file> TAG."""
import os, sys, torch
from benchmarks.harness import AttnConfig, _random_qkv
from benchmarks.kernel_once import kernel_times
from dualkv.core import dualkv_attention

tag = sys.argv[1]
CASES = [
    ("16,32K,2K", {"DUALKV_CUDA_WGMMA_BWD": "6"}, "cuda"),
    ("16,32K,2K", {"DUALKV_CUDA_WGMMA_BWD": "5"}, "cuda"),
    ("16,32K,2K", {"DUALKV_CUDA_WGMMA": "2", "DUALKV_CUDA_WGMMA_BWD": "8"}, "cuda"),
    ("8,16K,512", {"DUALKV_CUDA_WGMMA_BWD": "6"}, "cuda"),
    ("8,16K,512", {"DUALKV_CUDA_WGMMA_BWD": "5"}, "cuda"),
    ("28,4K,2K", {"DUALKV_CUDA_WGMMA_BWD": "6"}, "cuda"),
    ("N=16,P=32K,R=2K,H=32,H_kv=8,d=64", {"DUALKV_CUDA_WGMMA_BWD": "8"}, "cuda"),
    ("N=16,P=16K,R=2K,H=16,H_kv=8,d=256", {}, "cuda"),
]
if tag == "new":
    CASES.append(("16,32K,2K", {}, "triton"))
for conf, env, backend in CASES:
    for k in ("DUALKV_CUDA_WGMMA", "DUALKV_CUDA_WGMMA_BWD"):
        os.environ.pop(k, None)
    os.environ.update(env)
    cfg = AttnConfig.parse(conf, H=32, H_kv=8, d=128)
    dev = torch.device("cuda")
    layout = cfg.layout(dev)
    q, k, v = _random_qkv(cfg, dev, 0)
    for t in (q, k, v):
        t.requires_grad_(True)
    def calls(n):
        for _ in range(n):
            out = dualkv_attention(q, k, v, layout, backend=backend)
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    calls(1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        calls(3)
    print(f"== [{tag}] {conf} {env} {backend}", flush=True)
    for name, ms in kernel_times(prof, 3, "cuda")[:4]:
        print(f"  {ms:9.3f}  {name[:90]}", flush=True)
    del q, k, v, layout
    torch.cuda.empty_cache()
