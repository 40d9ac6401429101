"""Pack a random rollout batch, run DualKV attention forward and backward, and check it against
standard causal attention over the N replicated sequences.

    python -m dualkv.core.demo [--groups 2] [--n 8] [--prompt 512] [--response 128] [--device cuda]

Prints the token reduction rho = N(P+R) / (P+NR) and the largest differences of outputs and
gradients against the replicated computation (PyTorch's own scaled_dot_product_attention).
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

from dualkv.core import PackedLayout, dualkv_attention


def _replicated(q, k, v, layout, scale):
    """Causal SDPA on every replicated row (the prompt copied into each), in replicated order."""
    idx, cu = layout.replicated_index()
    rep = q.shape[1] // k.shape[1]
    outs = []
    for b in range(layout.num_rows):
        rows = idx[int(cu[b]): int(cu[b + 1])]
        qs, ks, vs = (t[rows].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0), is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt", type=int, default=512, help="max prompt length")
    ap.add_argument("--response", type=int, default=128, help="max response length")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    prompt_lens = [rng.randint(args.prompt // 2, args.prompt) for _ in range(args.groups)]
    response_lens = [[rng.randint(1, args.response) for _ in range(args.n)] for _ in range(args.groups)]
    layout = PackedLayout.from_lengths(prompt_lens, response_lens, device=args.device)
    dtype = torch.float32
    T = layout.total_tokens
    q = torch.randn(T, args.heads, args.headdim, device=args.device, dtype=dtype, requires_grad=True)
    k = torch.randn(T, args.kv_heads, args.headdim, device=args.device, dtype=dtype, requires_grad=True)
    v = torch.randn(T, args.kv_heads, args.headdim, device=args.device, dtype=dtype, requires_grad=True)
    scale = args.headdim**-0.5

    out = dualkv_attention(q, k, v, layout)
    out_rep = _replicated(q, k, v, layout, scale)
    idx, _ = layout.replicated_index()
    g = torch.randn_like(out_rep)
    grads = torch.autograd.grad(out, (q, k, v), torch.zeros_like(out).index_add_(0, idx, g))
    grads_rep = torch.autograd.grad(out_rep, (q, k, v), g)

    result = {
        "layout": repr(layout),
        "packed_tokens": T,
        "replicated_tokens": layout.replicated_tokens,
        "rho": layout.rho,
        "max_err_out": (out[idx] - out_rep).abs().max().item(),
        "max_err_grad": max((a - b).abs().max().item() for a, b in zip(grads, grads_rep)),
    }
    print(result["layout"])
    print(f"packed tokens {T}  vs replicated {layout.replicated_tokens}:  rho = {layout.rho:.2f}x fewer tokens")
    print(f"max |out - replicated| = {result['max_err_out']:.2e}   max |grad - replicated| = {result['max_err_grad']:.2e}")
    return result


if __name__ == "__main__":
    main()
