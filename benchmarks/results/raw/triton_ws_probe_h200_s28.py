"""Does Triton's Hopper automatic warp specialisation (tl.range(warp_specialize=True), num_warps=4,
in-kernel descriptors) run on this GPU, and how fast is a plain attention forward loop with it?"""
import torch, triton, triton.language as tl, sys
from triton.testing import do_bench
print("triton", triton.__version__, torch.cuda.get_device_name())
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

@triton.jit
def attn(Q, K, V, O, N, H, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, WS: tl.constexpr, MASKALL: tl.constexpr, CAUSAL: tl.constexpr):
    pid = tl.program_id(0); h = tl.program_id(1)
    q_desc = tl.make_tensor_descriptor(Q, shape=[N * H, D], strides=[D, 1], block_shape=[BM, D])
    k_desc = tl.make_tensor_descriptor(K, shape=[N * H, D], strides=[D, 1], block_shape=[BN, D])
    v_desc = tl.make_tensor_descriptor(V, shape=[N * H, D], strides=[D, 1], block_shape=[BN, D])
    o_desc = tl.make_tensor_descriptor(O, shape=[N * H, D], strides=[D, 1], block_shape=[BM, D])
    base = h * N
    q = q_desc.load([base + pid * BM, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32); l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    qpos = pid * BM + tl.arange(0, BM)
    n = tl.cdiv((pid + 1) * BM, BN) if CAUSAL else N // BN
    for b in tl.range(n, warp_specialize=WS):
        x = b * BN
        k = k_desc.load([base + x, 0]); v = v_desc.load([base + x, 0])
        s = tl.dot(q, k.T) * 0.12
        if MASKALL:
            kpos = x + tl.arange(0, BN)
            s = tl.where((kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < N), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None]); alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1); acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.bfloat16), v, acc); m_i = m_new
    o_desc.store([base + pid * BM, 0], (acc / l_i[:, None]).to(tl.bfloat16))

N, H, D = 16384, 32, 128
q, k, v = (torch.randn(H * N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
ref = None
for causal in (False, True):
    for ws in (False, True):
        for maskall in (False, True):
            if not causal and maskall and not ws: pass
            for w, st in ((4, 2), (8, 2), (4, 3)):
                if ws and w != 4: continue
                if causal and not maskall: continue
                o = torch.empty_like(q)
                name = f"causal={causal} ws={ws} maskall={maskall} w{w} s{st}"
                try:
                    fn = lambda: attn[(N // 128, H)](q, k, v, o, N, H, BM=128, BN=128, D=D, WS=ws, MASKALL=maskall, CAUSAL=causal, num_warps=w, num_stages=st)
                    ck = fn(); torch.cuda.synchronize()
                    name += f" [warps {ck.metadata.num_warps}, setmaxnreg {ck.asm['ptx'].count('setmaxnreg')}, regs {ck.n_regs}, spills {ck.n_spills}]"
                    ms = do_bench(fn, warmup=10, rep=100)
                    flops = 4 * N * N * D * H * (0.5 if causal else 1)
                    # check against torch
                    qq, kk, vv = (t.view(H, N, D) for t in (q, k, v))
                    r = torch.nn.functional.scaled_dot_product_attention(qq[:2], kk[:2], vv[:2], is_causal=causal, scale=0.12 / 1.4426950408889634)
                    err = (o.view(H, N, D)[:2].float() - r.float()).abs().max().item()
                    print(f"{name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s err {err:.3g}", flush=True)
                except Exception as e:
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
