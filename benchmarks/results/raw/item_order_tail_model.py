"""List-scheduling model of the persistent dK/dV kernel's items (132 blocks, item cost = query rows walked / 64 x GQA
rep + 4): the makespan over the ideal in the numbering's order (per segment its context tiles, then its own),
all context tiles first, and longest first. Run: python benchmarks/results/raw/item_order_tail_model.py (CPU)."""
import heapq, random, math
def items(P, lens, hkv, rep, chunk_rows=8192, bn=128, bm=64, overhead=4):
    # per kv head: for each segment: ctx tiles (if chunk leader) then own tiles
    segs = []
    row = 0; lead_bin = None; chunks = []
    for i, n in enumerate(lens):
        b = row // chunk_rows
        if i == 0 or b != lead_bin or P > 32768:
            chunks.append([i]); lead_bin = b
        else:
            chunks[-1].append(i)
        row += n
    leader = {c[0]: c for c in chunks}
    per_head = []
    for s, n in enumerate(lens):
        if s in leader:
            rows = sum(lens[j] for j in leader[s])
            # reader tiles: per segment ceil(n/bm) per head
            rt = sum(math.ceil(lens[j] / bm) for j in leader[s]) * rep
            per_head += [("ctx", overhead + rt)] * math.ceil(P / bn)
        for j in range(math.ceil(n / bn)):
            per_head.append(("own", overhead + math.ceil((n - j * bn) / bm) * rep))
    return [(h, k, c) for h in range(hkv) for k, c in per_head]
def makespan(its, sms=132):
    heap = [0.0] * sms; heapq.heapify(heap)
    for _, _, c in its:
        t = heapq.heappop(heap); heapq.heappush(heap, t + c)
    return max(heap)
def report(name, P, lens, hkv, rep, chunk_rows=8192):
    its = items(P, lens, hkv, rep, chunk_rows)
    total = sum(c for *_, c in its) / 132
    cur = makespan(its)
    lpt2 = makespan([x for x in its if x[1] == "ctx"] + [x for x in its if x[1] == "own"])
    lpt = makespan(sorted(its, key=lambda x: -x[2]))
    print(f"{name}: items {len(its)} ideal {total:.0f} current {cur/total:.3f} ctx-first {lpt2/total:.3f} LPT {lpt/total:.3f}")
random.seed(0)
for seed in range(3):
    random.seed(seed)
    lens = [random.randint(131, 2048) for _ in range(8)]
    report(f"1.7b step mb8 seed{seed}", 8192, lens, 8, 2)
    report(f"4b step mb4 seed{seed}", 8192, lens[:4], 8, 4)
    report(f"4b step mb8 seed{seed}", 8192, lens, 8, 4)
report("28,4K,2K", 4096, [2048]*28, 8, 4)
report("28,16K,2K", 16384, [2048]*28, 8, 4)
report("16,32K,2K", 32768, [2048]*16, 8, 4)
report("16,64K,2K", 65536, [2048]*16, 8, 4)
report("32,8K,2K", 8192, [2048]*32, 8, 4)
report("8,16K,512", 16384, [512]*8, 8, 4)
random.seed(5); report("dec:8K,16", 8192, [random.randint(131, 2048) for _ in range(16)], 8, 4)
