"""Where the forward's wall time goes beyond its kernel: host time per call, small kernels, flush."""
import time, torch
from dualkv.core import dualkv_attention, PackedLayout
from benchmarks.harness import AttnConfig, _random_qkv, attention_flops

dev = torch.device("cuda")
flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev)
for text in ["8,16K,512", "16,32K,2K", "28,4K,2K"]:
    cfg = AttnConfig.parse(text)
    layout = cfg.layout(dev)
    q, k, v = _random_qkv(cfg, dev, 0)
    f = lambda: dualkv_attention(q, k, v, layout, backend="cuda")
    for _ in range(3): f()
    torch.cuda.synchronize()
    # host time of one call, GPU busy (queue ahead)
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(20): big @ big
    t0 = time.perf_counter(); f(); host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    res = {}
    for mode in ("flush", "noflush", "back2back"):
        ts = []
        for _ in range(10):
            if mode == "flush": flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if mode == "back2back":
                f()  # queue a call ahead so the timed one starts with the GPU busy
            s.record(); f(); e.record(); e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort(); res[mode] = ts[len(ts) // 2]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        f(); torch.cuda.synchronize()
    kern = [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    F = attention_flops(cfg, "fwd")
    print(f"{text}: host {host:.3f} ms/call; event-timed median: " + ", ".join(f"{m} {t:.3f} ms ({F/t/1e9:.0f})" for m, t in res.items()))
    for n, us in kern:
        print(f"    {us/1000:8.3f} ms  {n[:100]}")
