"""Sequence parallelism on real process groups: gloo on CPU with 2, 4 and 8 ranks.

One world is spawned per size and runs every check of this file inside it (spawning is the slow
part); each check is then reported as its own test. Checks do all their collectives first and
compare at the end, so a failing check cannot leave the other ranks waiting in a collective.

What is checked against the single-device run (``sp_group=None``):
    * Ulysses attention (fp64): outputs, lse and dq/dk/dv of every rank's slice equal the whole-
      sequence ``dualkv_attention``; GQA with sp > H_kv; a tiled K/V repeat is shown to be wrong.
    * the last-prompt-token hidden-state all-reduce: values and the gradient sent to the owner; and
      that without it (forward, or its backward) first-token log-probs / gradients come out wrong.
    * a model (the attention contract of dualkv.models): response log-probs, entropies and every
      parameter gradient (summed over the SP group) equal the single-device run, fp32, 1e-5,
      on layouts chosen to have a length not divisible by sp, a prompt ending on a rank boundary,
      responses starting on another rank than their prompt's last token, several groups.
    * (dp, sp) meshes with dp > 1: each replica's own micro-batch.
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile
import traceback
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dualkv.core import PackedLayout, dualkv_attention
from dualkv.parallel import (
    DeepSpeedLocalAttention,
    DeepSpeedUlyssesAttention,
    as_process_group,
    check_parallelized,
    deepspeed_available,
    gather_sequence,
    heads_to_seq,
    init_sp_mesh,
    parallelize_sequence,
    prepare_fsdp_for_sp,
    seq_to_heads,
    shard_sequence,
    share_last_prompt_hidden,
    sp_response_logprobs,
    sp_router_stats,
    ulysses_attention,
    unparallelize_sequence,
)
from dualkv.parallel import logprobs as lp_mod
from dualkv.parallel import ulysses as ulysses_mod
from dualkv.parallel.testing import run_local_world

WORLD_SIZES = (2, 4, 8)
CHECKS: dict = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


class Mismatches:
    """Collects comparison failures; raises once at the end of a check (after all collectives)."""

    def __init__(self):
        self.errors: list[str] = []

    def close(self, what, actual, expected, rtol, atol):
        try:
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
        except AssertionError as err:
            self.errors.append(f"{what}: {err}")

    def true(self, what, cond):
        if not cond:
            self.errors.append(what)

    def raise_if_any(self):
        if self.errors:
            raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(self.errors))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ================================================================ layouts with the SP edge cases
def _host_positions(prompts, responses):
    """(T, last prompt token of each group, (start, group) of each response) from the lengths alone."""
    last, rows, offset = [], [], 0
    for g, (p, rs) in enumerate(zip(prompts, responses)):
        last.append(offset + p - 1)
        offset += p
        for r in rs:
            rows.append((offset, g))
            offset += r
    return offset, last, rows


def sp_properties(prompts, responses, sp):
    """Which SP edge cases the layout of these lengths exercises at SP size ``sp``."""
    T, last, rows = _host_positions(prompts, responses)
    L = -(-T // sp)
    return {
        "length_not_divisible": T % sp != 0,
        "prompt_ends_on_rank_boundary": any((p + 1) % L == 0 and p + 1 < T for p in last),
        "response_starts_on_other_rank": any(s // L != last[g] // L for s, g in rows),
        "first_token_slot_on_other_rank": any((s - 1) // L != last[g] // L for s, g in rows),
        "several_groups": len(prompts) >= 2,
    }


@functools.lru_cache(maxsize=None)
def edge_case_lengths(sp, seed=0):
    """Lengths of a small multi-group layout exhibiting every ``sp_properties`` case."""
    rng = random.Random(1000 * sp + seed)
    for _ in range(20000):
        G = rng.randint(2, 3)
        prompts = [rng.randint(1, 9) for _ in range(G)]
        responses = [[rng.randint(1, 5) for _ in range(rng.randint(1, 3))] for _ in range(G)]
        if all(sp_properties(prompts, responses, sp).values()):
            return prompts, responses
    raise AssertionError(f"no layout with every SP edge case found for sp={sp}")


def edge_case_layout(sp, seed=0, vocab=50):
    prompts, responses = edge_case_lengths(sp, seed)
    T = sum(prompts) + sum(map(sum, responses))
    ids = torch.randint(0, vocab, (T,), generator=_gen(seed))
    return PackedLayout.from_lengths(prompts, responses, input_ids=ids)


# ================================================================ a model on the dualkv.models contract
class _Attention(nn.Module):
    def __init__(self, D, H, K, d, window, softcap):
        super().__init__()
        self.H, self.K, self.d, self.window, self.softcap = H, K, d, window, softcap
        self.qkv = nn.Linear(D, (H + 2 * K) * d)
        self.o = nn.Linear(H * d, D)
        self.attn_fn = dualkv_attention

    def forward(self, x_TD, cos_Td, sin_Td, layout):
        q, k, v = self.qkv(x_TD).split([self.H * self.d, self.K * self.d, self.K * self.d], dim=-1)
        q_THd, k_TKd = (_rope(t.reshape(x_TD.shape[0], -1, self.d), cos_Td, sin_Td) for t in (q, k))
        v_TKd = v.reshape(x_TD.shape[0], self.K, self.d)
        out_THd = self.attn_fn(q_THd.contiguous(), k_TKd.contiguous(), v_TKd.contiguous(), layout,
                               softmax_scale=self.d ** -0.5, window=self.window, softcap=self.softcap)
        return self.o(out_THd.reshape(x_TD.shape[0], -1))


def _rope(x_THd, cos_Td, sin_Td):
    x1, x2 = x_THd.chunk(2, dim=-1)
    return x_THd * cos_Td[:, None] + torch.cat([-x2, x1], dim=-1) * sin_Td[:, None]


class ContractLM(nn.Module):
    """Pre-norm decoder with RoPE, a sliding-window layer and a softcapped layer: just enough model to
    exercise ``hidden_states`` / ``compute_logits`` / ``attn_fn`` exactly as dualkv.models defines them."""

    def __init__(self, vocab=50, D=32, H=8, K=2, d=8, layers=((3, None), (None, 20.0))):
        super().__init__()
        self.d = d
        self.embed = nn.Embedding(vocab, D)
        self.attn = nn.ModuleList(_Attention(D, H, K, d, w, c) for w, c in layers)
        self.mlp = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D)) for _ in layers)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in layers)
        self.final = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)

    def hidden_states(self, input_ids_T, position_ids_T, layout):
        inv = 1.0 / (100.0 ** (torch.arange(0, self.d, 2).float() / self.d))
        ang = position_ids_T[:, None].float() * inv
        cos_Td, sin_Td = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x_TD = self.embed(input_ids_T)
        for attn, mlp, norm in zip(self.attn, self.mlp, self.norms):
            x_TD = x_TD + attn(norm(x_TD), cos_Td, sin_Td, layout)
            x_TD = x_TD + mlp(x_TD)
        return self.final(x_TD)

    def compute_logits(self, hidden_nD):
        return self.head(hidden_nD)


# ================================================================ helpers for model-level checks
def model_run(model, layout, sp_group, seed=7):
    """Log-probs, entropies and parameter gradients (summed over the SP group) of a fixed random loss."""
    model.zero_grad(set_to_none=True)
    lp_BR, ent_BR = sp_response_logprobs(model, layout, sp_group, temperature=0.7, return_entropy=True)
    g = _gen(seed)
    w1, w2 = torch.randn(lp_BR.shape, generator=g), torch.randn(lp_BR.shape, generator=g)
    ((lp_BR * w1).sum() + (ent_BR * w2).sum()).backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    if sp_group is not None:
        for t in grads.values():
            dist.all_reduce(t, group=as_process_group(sp_group))
    return lp_BR.detach(), ent_BR.detach(), grads


def close_rel(bad: Mismatches, what, actual, expected, rel=1e-5):
    """Norm-relative closeness ||actual - expected|| <= rel * ||expected|| (element-wise rtol is
    meaningless for entries that are sums with cancellation, e.g. a norm weight's gradient)."""
    err = (actual.double() - expected.double()).norm().item()
    ref = expected.double().norm().item()
    bad.true(f"{what}: relative error {err / max(ref, 1e-30):.2e} > {rel:.0e} (|ref| = {ref:.3e})", err <= rel * ref or err < 1e-12)


def compare_runs(bad: Mismatches, tag, got, ref, rel=1e-5):
    """Log-probs element-wise (rtol 1e-5), entropies and every parameter gradient norm-relative 1e-5."""
    lp, ent, grads = got
    lp_ref, ent_ref, grads_ref = ref
    bad.close(f"{tag} logprobs", lp, lp_ref, rel, 1e-6)
    close_rel(bad, f"{tag} entropy", ent, ent_ref, rel)
    for name in grads_ref:
        close_rel(bad, f"{tag} grad {name}", grads[name], grads_ref[name], rel)


def sp_vs_single(model, layout, group):
    ref = model_run(unparallelize_sequence(model), layout, None)
    got = model_run(parallelize_sequence(model, group), layout, group)
    unparallelize_sequence(model)
    return got, ref


@contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# ================================================================ attention-level checks
def _attention_configs(sp):
    """(H, K) pairs valid at this SP size, including sp > H_kv and MQA."""
    pairs = [(8, 8), (8, 2), (8, 1)] + ([(6, 3)] if sp == 2 else [])
    return [(H, K) for H, K in pairs if H % sp == 0]


@check
def ulysses_matches_whole_sequence_attention(ctx):
    sp, rank, bad = ctx.world, ctx.rank, Mismatches()
    layouts = [
        edge_case_layout(sp),
        PackedLayout.from_lengths([5, 1, 7], [[3, 4, 2], [2], [1, 6]]),
        PackedLayout.from_lengths([2], [[1, 2]]),  # T = 5: at sp 4 and 8 some ranks hold only padding
    ]
    opts = [dict(), dict(window=4), dict(softcap=5.0, softmax_scale=0.3)]
    for li, lay in enumerate(layouts):
        T, shard = lay.total_tokens, shard_sequence(lay, rank=rank, size=sp)
        for (H, K), opt in zip(_attention_configs(sp) * 2, opts * 2):
            g = _gen(li * 100 + H + K)
            q, dout = torch.randn(2, T, H, 16, generator=g, dtype=torch.float64)
            k, v = torch.randn(2, T, K, 16, generator=g, dtype=torch.float64)
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = dualkv_attention(*leaves, lay, return_lse=True, **opt)
            (out * dout).sum().backward()
            local = [shard.slice(t).requires_grad_() for t in (q, k, v)]
            out_L, lse_HL = ulysses_attention(*local, lay, dist.group.WORLD, return_lse=True, **opt)
            (out_L * shard.slice(dout)).sum().backward()
            n, s, tag = shard.num_valid, shard.start, f"layout {li} H={H} K={K} {opt}"
            bad.close(f"{tag} out", out_L[:n], out[s : s + n], 1e-10, 1e-10)
            bad.close(f"{tag} lse", lse_HL[:, :n], lse[:, s : s + n], 1e-10, 1e-10)
            bad.true(f"{tag} padding rows of out are zero", bool((out_L[n:] == 0).all()))
            for name, loc, full in zip("qkv", local, leaves):
                bad.close(f"{tag} d{name}", loc.grad[:n], full.grad[s : s + n], 1e-10, 1e-10)
                bad.true(f"{tag} d{name} padding rows are zero", bool((loc.grad[n:] == 0).all()))
    bad.raise_if_any()


@check
def tiled_kv_repeat_is_wrong_under_ulysses(ctx):
    """The in-place K/V repeat matters: swapping in a tiled repeat breaks the result when sp > H_kv."""
    sp, bad = ctx.world, Mismatches()
    H, K = (6, 3) if sp == 2 else (8, 2)
    lay = edge_case_layout(sp)
    shard = shard_sequence(lay, rank=ctx.rank, size=sp)
    g = _gen(3)
    q = torch.randn(lay.total_tokens, H, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, lay.total_tokens, K, 16, generator=g, dtype=torch.float64)
    ref = shard.slice(dualkv_attention(q, k, v, lay))
    args = (shard.slice(q), shard.slice(k), shard.slice(v), lay, dist.group.WORLD)
    good = ulysses_attention(*args)
    tiled = lambda x, f: x if f == 1 else x.repeat(1, f, 1)  # noqa: E731
    with patched(ulysses_mod, "replicate_kv_heads", tiled):
        wrong = ulysses_attention(*args)
    flags = torch.tensor([float((wrong - ref).abs().max() > 1e-3)])
    dist.all_reduce(flags)  # some rank must see the wrong K/V heads
    bad.close("in-place repeat", good, ref, 1e-10, 1e-10)
    bad.true("a tiled repeat gives the same result: the test could not catch it", flags.item() > 0)
    bad.raise_if_any()


@check
def seq_heads_all_to_all_round_trip_and_gradients(ctx):
    sp, bad = ctx.world, Mismatches()
    g = _gen(11)
    full_a = torch.randn(3 * sp, 2 * sp, 4, generator=g, dtype=torch.float64)
    full_b = torch.randn(3 * sp, sp, 2, generator=g, dtype=torch.float64)
    r = ctx.rank
    a, b = (t[3 * r : 3 * r + 3].clone().requires_grad_() for t in (full_a, full_b))
    ha, hb = seq_to_heads(dist.group.WORLD, a, b)
    back_a, back_b = heads_to_seq(dist.group.WORLD, ha, hb)
    (ha.sum() * 2 + (hb * hb).sum()).backward()
    bad.close("heads of a", ha, full_a[:, 2 * r : 2 * r + 2], 0, 0)
    bad.close("heads of b", hb, full_b[:, r : r + 1], 0, 0)
    bad.close("round trip a", back_a, a, 0, 0)
    bad.close("round trip b", back_b, b, 0, 0)
    bad.close("grad a", a.grad, torch.full_like(a, 2.0), 0, 0)
    bad.close("grad b", b.grad, 2 * b.detach(), 0, 0)
    bad.raise_if_any()


@check
def ulysses_rejects_sizes_that_do_not_divide(ctx):
    sp = ctx.world
    lay = PackedLayout.from_lengths([4], [[3, 3]])
    L = -(-lay.total_tokens // sp)
    q = torch.randn(L, sp + 1, 8)
    kv = torch.randn(L, 1, 8)
    with pytest.raises(ValueError, match=f"sp: expected the SP size to divide the number of query heads \\({sp + 1}\\)"):
        ulysses_attention(q, kv, kv, lay, dist.group.WORLD)
    with pytest.raises(ValueError, match=f"q/k/v: expected this rank's slice of ceil\\(T=10 / sp={sp}\\) = {L} tokens"):
        ulysses_attention(q[:-1], kv[:-1], kv[:-1], lay, dist.group.WORLD)


@check
def gather_sequence_and_its_gradient(ctx):
    sp, bad = ctx.world, Mismatches()
    lay = edge_case_layout(sp)
    shard = shard_sequence(lay, rank=ctx.rank, size=sp)
    full = torch.randn(lay.total_tokens, 3, generator=_gen(5), dtype=torch.float64)
    x = shard.slice(full).requires_grad_()
    y = gather_sequence(x, shard, dist.group.WORLD)
    w = torch.randn(lay.total_tokens, 3, generator=_gen(6), dtype=torch.float64)
    (y * w).sum().backward()
    bad.close("gathered", y, full, 0, 0)
    bad.close("local gradient", x.grad, shard.slice(w), 0, 0)
    bad.raise_if_any()


# ================================================================ the last-prompt-token hidden state
@check
def last_prompt_hidden_all_reduce_values_and_owner_gradient(ctx):
    sp, bad = ctx.world, Mismatches()
    lay = edge_case_layout(sp)
    shard = shard_sequence(lay, rank=ctx.rank, size=sp)
    D = 5
    full = torch.randn(lay.total_tokens, D, generator=_gen(9), dtype=torch.float64)
    h_LD = shard.slice(full).requires_grad_()
    h_GD = share_last_prompt_hidden(h_LD, lay, shard, dist.group.WORLD)
    weights = [torch.randn(lay.num_groups, D, generator=_gen(40 + r), dtype=torch.float64) for r in range(sp)]
    (h_GD * weights[ctx.rank]).sum().backward()  # every rank's own loss uses the shared rows
    last = lay.group_last_prompt_token
    bad.close("shared rows", h_GD, full[last], 0, 0)
    expected = torch.zeros(shard.local_tokens, D, dtype=torch.float64)
    for gi, p in enumerate(last.tolist()):
        if shard.start <= p < shard.end:
            expected[p - shard.start] += sum(w[gi] for w in weights)
    bad.close("owner receives the gradient summed over ranks", h_LD.grad, expected, 1e-12, 1e-12)
    bad.raise_if_any()


def _local_only_last_prompt_hidden(hidden_LD, layout, shard, sp_group):
    """share_last_prompt_hidden WITHOUT its all-reduce: non-owners see zeros."""
    last = layout.group_last_prompt_token
    owned = (last >= shard.start) & (last < shard.end)
    rows = hidden_LD[(last - shard.start).clamp(0, shard.local_tokens - 1)]
    return torch.where(owned[:, None], rows, torch.zeros_like(rows))


def _forward_only_sum(x, sp_group):
    """all_reduce_sum whose backward does NOT sum the ranks' gradients."""
    y = x.detach().clone()
    dist.all_reduce(y, group=sp_group)
    return x + (y - x.detach())


def _first_tokens_predicted_off_owner(layout, sp):
    """(B, R_max) bool: first response tokens whose slot is on another rank than the last prompt token."""
    L = -(-layout.total_tokens // sp)
    last = layout.group_last_prompt_token.tolist()
    mask = torch.zeros(layout.num_rows, layout.max_response_len, dtype=torch.bool)
    for b, (s, g) in enumerate(zip(layout.row_start.tolist(), layout.row_group)):
        mask[b, 0] = (s - 1) // L != last[g] // L
    return mask


@check
def contract_model_logprobs_and_gradients_match_single_device(ctx):
    sp, bad = ctx.world, Mismatches()
    torch.manual_seed(0)
    model = ContractLM()
    for seed in range(2):
        lay = edge_case_layout(sp, seed=seed)
        got, ref = sp_vs_single(model, lay, dist.group.WORLD)
        compare_runs(bad, f"layout {seed} {lay}", got, ref)
    bad.raise_if_any()


@check
def without_the_hidden_all_reduce_first_token_logprobs_are_wrong(ctx):
    """Forward: drop the all-reduce and exactly the first tokens predicted off the owner rank go wrong."""
    sp, bad = ctx.world, Mismatches()
    torch.manual_seed(0)
    model = ContractLM()
    lay = edge_case_layout(sp)
    ref = model_run(model, lay, None)
    parallelize_sequence(model, dist.group.WORLD)
    with patched(lp_mod, "share_last_prompt_hidden", _local_only_last_prompt_hidden):
        broken = model_run(model, lay, dist.group.WORLD)
    unparallelize_sequence(model)
    off = _first_tokens_predicted_off_owner(lay, sp)
    diff = (broken[0] - ref[0]).abs()
    bad.true("the layout has first tokens predicted off the owner rank", bool(off.any()))
    bad.true("without the all-reduce those log-probs are wrong", bool((diff[off] > 1e-3).all()))
    bad.true("... and every other log-prob is still right", bool((diff[~off] < 1e-5).all()))
    bad.raise_if_any()


@check
def without_the_summed_backward_gradients_are_wrong(ctx):
    """Backward: an all-reduce that does not send the summed gradient to the owner gives wrong grads."""
    sp, bad = ctx.world, Mismatches()
    torch.manual_seed(0)
    model = ContractLM()
    lay = edge_case_layout(sp)
    ref = model_run(model, lay, None)
    parallelize_sequence(model, dist.group.WORLD)
    with patched(lp_mod, "all_reduce_sum", _forward_only_sum):
        broken = model_run(model, lay, dist.group.WORLD)
    unparallelize_sequence(model)
    bad.close("log-probs are unaffected", broken[0], ref[0], 1e-5, 1e-6)
    g, g_ref = broken[2]["embed.weight"], ref[2]["embed.weight"]
    bad.true("embedding gradients differ without the summed backward", bool((g - g_ref).abs().max() > 1e-4))
    bad.raise_if_any()


@check
def dp_sp_meshes_run_each_replica_micro_batch(ctx):
    if ctx.world < 4:
        return "skip: needs dp > 1 and sp > 1"
    bad = Mismatches()
    torch.manual_seed(0)
    model = ContractLM()
    for sp in (2, ctx.world // 2) if ctx.world == 8 else (2,):
        mesh = init_sp_mesh(sp, device_type="cpu")
        bad.true("mesh rank order", ctx.rank == mesh.dp_rank * sp + mesh.sp_rank)
        bad.true("mesh sizes", (mesh.dp_size, mesh.sp_size, mesh.grad_divide_factor) == (ctx.world // sp, sp, ctx.world // sp))
        lay = edge_case_layout(sp, seed=mesh.dp_rank)  # a different micro-batch per replica
        got, ref = sp_vs_single(model, lay, mesh.sp_mesh)
        compare_runs(bad, f"dp={mesh.dp_size} sp={sp} replica {mesh.dp_rank}", got, ref)
    bad.raise_if_any()


@check
def mesh_rejects_sizes_that_do_not_divide(ctx):
    with pytest.raises(ValueError, match=f"sp_size: expected a divisor of the world size {ctx.world}, got 3"):
        init_sp_mesh(3, device_type="cpu")
    with pytest.raises(ValueError, match="dp_size: expected dp_size \\* sp_size == world size"):
        init_sp_mesh(1, dp_size=ctx.world + 1, device_type="cpu")
    with pytest.raises(ValueError, match="sp_size: expected an int >= 1"):
        init_sp_mesh(0, device_type="cpu")


@check
def unprepared_model_is_rejected(ctx):
    model = ContractLM()
    lay = edge_case_layout(ctx.world)
    with pytest.raises(ValueError, match="model: expected its attention modules prepared with parallelize_sequence"):
        sp_response_logprobs(model, lay, dist.group.WORLD)
    parallelize_sequence(model, dist.group.WORLD)
    check_parallelized(model, dist.group.WORLD)
    with pytest.raises(ValueError, match="sp_group has 1 rank"):
        check_parallelized(model, None)


# ================================================================ dualkv.models: dense, MoE, hybrid
# Tiny presets with 8 query heads (so sp = 8 divides them) and 2 or 1 K/V heads (so sp > H_kv).
MODEL_CASES = {
    "dense": ("tiny-qwen3", dict(num_attention_heads=8, num_key_value_heads=2)),
    "moe": ("tiny-qwen3-moe", dict(num_attention_heads=8, num_key_value_heads=2)),
    "hybrid": ("tiny-gemma4", dict(num_attention_heads=8, num_key_value_heads=2, num_global_key_value_heads=1)),
    "hybrid_per_layer_input_kv_sharing": ("tiny-gemma4-e", dict(num_attention_heads=8, num_key_value_heads=2)),
    "hybrid_moe": ("tiny-gemma4-moe", dict(num_attention_heads=8, num_key_value_heads=2, num_global_key_value_heads=1)),
}
AUX_COEF = 0.5  # large, so a wrong router-statistics reduction shows in the gradients


def tiny_model(case):
    from dualkv.models import build_model, preset_hf_config

    preset, over = MODEL_CASES[case]
    return build_model({**preset_hf_config(preset), **over}, dtype=torch.float32, seed=0, init_std=0.1)


def causal_lm_run(model, layout, sp_group, seed=7):
    """Like ``model_run`` for a dualkv.models CausalLM, plus its MoE load-balancing loss. sp_group
    None: the model's own single-device ``response_logprobs`` (the reference)."""
    from dualkv.models import load_balancing_loss

    model.zero_grad(set_to_none=True)
    if sp_group is None:
        lp_BR, ent_BR = model.response_logprobs(layout, temperature=0.7, return_entropy=True)
        aux = model.aux_loss
    else:
        lp_BR, ent_BR = sp_response_logprobs(model, layout, sp_group, temperature=0.7, return_entropy=True)
        stats = sp_router_stats(model.router_stats, sp_group)
        aux = load_balancing_loss(stats) if stats else None
    g = _gen(seed)
    w1, w2 = torch.randn(lp_BR.shape, generator=g), torch.randn(lp_BR.shape, generator=g)
    loss = (lp_BR * w1).sum() + (ent_BR * w2).sum() + (AUX_COEF * aux if aux is not None else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    if sp_group is not None:
        for t in grads.values():
            dist.all_reduce(t, group=as_process_group(sp_group))
    aux_value = torch.zeros(()) if aux is None else aux.detach()
    return lp_BR.detach(), ent_BR.detach(), grads, aux_value


def _models_available():
    try:
        import dualkv.models  # noqa: F401
    except ImportError as err:
        return f"skip: dualkv.models is not importable ({err})"
    return None


def _check_model_case(ctx, case):
    skip = _models_available()
    if skip:
        return skip
    sp, bad = ctx.world, Mismatches()
    model = tiny_model(case)
    for seed in range(2):
        lay = edge_case_layout(sp, seed=seed, vocab=model.config.vocab_size)
        ref = causal_lm_run(model, lay, None)
        got = causal_lm_run(parallelize_sequence(model, dist.group.WORLD), lay, dist.group.WORLD)
        unparallelize_sequence(model)
        compare_runs(bad, f"{case} layout {seed}", got[:3], ref[:3])
        bad.close(f"{case} layout {seed} load-balancing loss", got[3], ref[3], 1e-5, 1e-7)
        bad.true(f"{case}: the MoE aux loss is non-zero", ("moe" not in case) or float(ref[3]) > 0)
    bad.raise_if_any()


# One check per tiny model case: model_<case>_matches_single_device.
for _case in ("dense", "moe", "hybrid", "hybrid_per_layer_input_kv_sharing", "hybrid_moe"):
    CHECKS[f"model_{_case}_matches_single_device"] = functools.partial(_check_model_case, case=_case)


@check
def model_on_a_micro_batch_smaller_than_the_sp_group(ctx):
    """T = 5 tokens: at sp 4 and 8 whole ranks hold nothing but padding (and no log-prob slot)."""
    skip = _models_available()
    if skip:
        return skip
    bad = Mismatches()
    model = tiny_model("moe")
    lay = PackedLayout.from_lengths([2], [[1, 2]], input_ids=torch.tensor([5, 9, 7, 3, 8]))
    shard = shard_sequence(lay, dist.group.WORLD)
    ref = causal_lm_run(model, lay, None)
    got = causal_lm_run(parallelize_sequence(model, dist.group.WORLD), lay, dist.group.WORLD)
    unparallelize_sequence(model)
    compare_runs(bad, f"T=5 (rank {ctx.rank}: {shard.num_valid} real tokens)", got[:3], ref[:3])
    bad.close("load-balancing loss", got[3], ref[3], 1e-5, 1e-7)
    bad.raise_if_any()


@check
def model_without_the_hidden_all_reduce_is_wrong(ctx):
    """The all-reduce ablation on a real model (dense Qwen3)."""
    skip = _models_available()
    if skip:
        return skip
    sp, bad = ctx.world, Mismatches()
    model = tiny_model("dense")
    lay = edge_case_layout(sp, vocab=model.config.vocab_size)
    ref = causal_lm_run(model, lay, None)
    parallelize_sequence(model, dist.group.WORLD)
    with patched(lp_mod, "share_last_prompt_hidden", _local_only_last_prompt_hidden):
        broken = causal_lm_run(model, lay, dist.group.WORLD)
    unparallelize_sequence(model)
    off = _first_tokens_predicted_off_owner(lay, sp)
    diff = (broken[0] - ref[0]).abs()
    bad.true("without the all-reduce, first tokens predicted off the owner are wrong", bool((diff[off] > 1e-4).all()))
    bad.true("... and every other log-prob is right", bool((diff[~off] < 1e-5).all()))
    bad.raise_if_any()


@check
def fsdp2_over_dp_sp_gives_the_replica_mean_gradient(ctx):
    """FSDP2 sharding over the flattened (dp, sp) mesh + SP: the reduced gradient is the mean over
    data-parallel replicas of each replica's single-device gradient (MoE, with the aux loss)."""
    skip = _models_available()
    if skip:
        return skip
    if ctx.world != 4:
        return "skip: run once, at world size 4 (dp = 2, sp = 2)"
    from torch.distributed.fsdp import fully_shard

    from dualkv.models import load_balancing_loss

    bad = Mismatches()
    mesh = init_sp_mesh(2, device_type="cpu")
    model = tiny_model("moe")
    refs = [causal_lm_run(model, edge_case_layout(2, seed=d, vocab=256), None) for d in range(mesh.dp_size)]
    parallelize_sequence(model, mesh.sp_mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh.dp_sp_mesh)
    fully_shard(model, mesh=mesh.dp_sp_mesh)
    n_units = prepare_fsdp_for_sp(model, mesh)
    lay = edge_case_layout(2, seed=mesh.dp_rank, vocab=256)
    lp, ent = sp_response_logprobs(model, lay, mesh.sp_mesh, temperature=0.7, return_entropy=True)
    aux = load_balancing_loss(sp_router_stats(model.router_stats, mesh.sp_mesh))
    g = _gen(7)
    w1, w2 = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    ((lp * w1).sum() + (ent * w2).sum() + AUX_COEF * aux).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    bad.true("every layer and the root are FSDP units", n_units == len(model.model.layers) + 1)
    bad.close("log-probs of this replica", lp.detach(), refs[mesh.dp_rank][0], 1e-5, 1e-6)
    for name, grad in grads.items():
        mean = sum(r[2][name] for r in refs) / mesh.dp_size
        close_rel(bad, f"grad {name}", grad, mean)
    bad.raise_if_any()


# ================================================================ DeepSpeed-Ulysses interop
class _StandInDistributedAttention:
    """DeepSpeed's DistributedAttention contract on (s, b, h, d) or (b, s, h, d) tensors, built on our
    all-to-all: so the local-attention adapter is tested where deepspeed is not installed."""

    def __init__(self, local_attention, group, seq_dim):
        self.local, self.group, self.seq_dim = local_attention, group, seq_dim

    def __call__(self, q, k, v, **kwargs):
        b = 1 - self.seq_dim
        parts = seq_to_heads(self.group, *(t.squeeze(b) for t in (q, k, v)))
        out = self.local(*(t.unsqueeze(b) for t in parts), **kwargs)
        return heads_to_seq(self.group, out.squeeze(b))[0].unsqueeze(b)


@check
def deepspeed_local_attention_adapter(ctx):
    sp, bad = ctx.world, Mismatches()
    lay = edge_case_layout(sp)
    shard = shard_sequence(lay, rank=ctx.rank, size=sp)
    H, K = 8, 8
    g = _gen(21)
    q, dout = torch.randn(2, lay.total_tokens, H, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, lay.total_tokens, K, 16, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = dualkv_attention(*leaves, lay, window=5)
    (ref * dout).sum().backward()
    for seq_dim in (0, 1):
        local = [shard.slice(t).unsqueeze(1 - seq_dim).requires_grad_() for t in (q, k, v)]
        attn = _StandInDistributedAttention(DeepSpeedLocalAttention(), dist.group.WORLD, seq_dim)
        out = attn(*local, layout=lay, window=5)
        (out.squeeze(1 - seq_dim) * shard.slice(dout)).sum().backward()
        n, s = shard.num_valid, shard.start
        bad.close(f"seq_dim={seq_dim} out", out.squeeze(1 - seq_dim)[:n], ref[s : s + n], 1e-10, 1e-10)
        for name, t, full in zip("qkv", local, leaves):
            bad.close(f"seq_dim={seq_dim} d{name}", t.grad.squeeze(1 - seq_dim)[:n], full.grad[s : s + n], 1e-10, 1e-10)
    bad.raise_if_any()


@check
def deepspeed_distributed_attention_runs_the_model_exactly(ctx):
    if not deepspeed_available():
        return "skip: deepspeed is not installed"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    bad = Mismatches()
    torch.manual_seed(0)
    model = ContractLM()
    lay = edge_case_layout(ctx.world)
    ref = model_run(model, lay, None)
    parallelize_sequence(model, dist.group.WORLD, attention_cls=DeepSpeedUlyssesAttention)
    got = model_run(model, lay, dist.group.WORLD)
    unparallelize_sequence(model)
    compare_runs(bad, "DeepSpeed-Ulysses", got, ref)
    bad.raise_if_any()


# ================================================================ running the checks
def run_checks(names, out_dir):
    """Run the named checks in order on this rank; each outcome is also written to ``out_dir`` as it
    completes, so a world that hangs later still reports the checks that finished."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        try:
            outcome = CHECKS[name](_Ctx(rank, world))
            results[name] = outcome if isinstance(outcome, str) else None
        except BaseException:  # noqa: BLE001 - pytest.raises fails with a BaseException; all reported
            results[name] = "fail: " + traceback.format_exc()
        with open(os.path.join(out_dir, f"{rank}-{name}.json"), "w") as fh:
            json.dump(results[name], fh)
    return results


class _Ctx:
    def __init__(self, rank, world):
        self.rank, self.world = rank, world


_WORLD_RESULTS: dict = {}
# Under pytest -n, every test of one world goes to the same worker, which spawns that world once.
WORLDS = [pytest.param(world, id=str(world), marks=pytest.mark.xdist_group(f"sp-world-{world}"))
          for world in WORLD_SIZES]


def world_results(world):
    """{check name: [outcome per rank]} for one spawned world (spawned once, cached, failures too)."""
    if world not in _WORLD_RESULTS:
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                per_rank = run_local_world(run_checks, world, list(CHECKS), out_dir, timeout_s=300)
                _WORLD_RESULTS[world] = {n: [r[n] for r in per_rank] for n in CHECKS}
            except RuntimeError as err:
                _WORLD_RESULTS[world] = {n: _read_outcomes(out_dir, n, world, err) for n in CHECKS}
    return _WORLD_RESULTS[world]


def _read_outcomes(out_dir, name, world, err):
    outcomes = []
    for rank in range(world):
        path = os.path.join(out_dir, f"{rank}-{name}.json")
        if os.path.exists(path):
            with open(path) as fh:
                outcomes.append(json.load(fh))
        else:
            outcomes.append(f"fail: no outcome (the world failed: {err})")
    return outcomes


@pytest.mark.parametrize("world", WORLDS)
def test_world_runs_every_check(world):
    """Spawns the world (the slow part, so --durations shows it here) and gets an outcome per check and rank."""
    outcomes = world_results(world)
    assert set(outcomes) == set(CHECKS) and all(len(o) == world for o in outcomes.values())


@pytest.mark.parametrize("name", list(CHECKS))
@pytest.mark.parametrize("world", WORLDS)
def test_sp(world, name):
    per_rank = world_results(world)[name]
    failures = [f"rank {i}: {o}" for i, o in enumerate(per_rank) if o and o.startswith("fail")]
    assert not failures, "\n".join(failures)
    if per_rank[0] and per_rank[0].startswith("skip"):
        pytest.skip(per_rank[0][5:].strip())


def test_edge_case_layouts_have_every_case():
    for sp in WORLD_SIZES:
        for seed in range(2):
            lay = edge_case_layout(sp, seed)
            props = sp_properties(lay.prompt_lens, lay.response_lens, sp)
            assert all(props.values()), props
            T, last, rows = _host_positions(lay.prompt_lens, lay.response_lens)
            assert (T, last, [s for s, _ in rows]) == (lay.total_tokens, lay.group_last_prompt_token.tolist(), lay.row_start.tolist())


def test_dropping_the_all_reduce_matters_on_the_chosen_layouts():
    for sp in WORLD_SIZES:
        assert bool(_first_tokens_predicted_off_owner(edge_case_layout(sp), sp).any())
