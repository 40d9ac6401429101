"""The packed layout: G prompt groups, each prompt stored once followed by its N responses.

Token order of a micro-batch (T = sum_g (P_g + sum_i R_g,i))::

    [ P_1 | R_1,1 | R_1,2 | ... | R_1,N1 | P_2 | R_2,1 | ... ]

The layout is described as *segments* with a *context range* (a parent): segment s owns the packed
tokens ``cu_seqlens[s]:cu_seqlens[s+1]``; its queries see every key of its context range
``seg_ctx_start[s] : seg_ctx_start[s] + seg_ctx_len[s]`` and their own segment causally. A prompt is a
segment with an empty context; a response is a segment whose context is its group's prompt.
Logical (RoPE) positions: context key j sits at position j, own token i at ``seg_ctx_len[s] + i``.

Attention pattern of one group, P = 3, two responses of lengths 2 and 2 (x = attended)::

             p0 p1 p2 a0 a1 b0 b1
        p0 [ x  .  .  .  .  .  .  ]
        p1 [ x  x  .  .  .  .  .  ]
        p2 [ x  x  x  .  .  .  .  ]
        a0 [ x  x  x  x  .  .  .  ]
        a1 [ x  x  x  x  x  .  .  ]
        b0 [ x  x  x  .  .  x  .  ]
        b1 [ x  x  x  .  .  x  x  ]

Rows: every response is one *row* (what an RL framework holds as one padded sequence). Rows keep
the order the layout was built from (for ``from_rows``: the order of the input rows).

Shape vocabulary: T packed tokens, S segments, G groups, B rows (responses), C context regions.
All metadata tensors are int32 (positions int64, as embeddings and RoPE expect). Building a layout
does at most one host synchronisation (``from_rows``, to learn the lengths), never one per sequence;
from host lengths (``from_lengths``, ``from_groups`` of host tokens) it does none: its tensors reach the
device by non-blocking copies from pinned memory (``to_device``), so a micro-batch can be built while
the device still runs the one before.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

__all__ = ["PackedLayout", "to_device"]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, without waiting for the device.

    A blocking copy to a GPU synchronises its stream first: the host would wait for every kernel
    queued so far, and the device then idle while the host builds and launches the next work.
    CUDA copies go through pinned memory instead, non-blocking (torch keeps the pinned block until
    the copy has run)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _int32(values, device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=torch.int32), device)


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Metadata of one packed micro-batch, built once and shared by every layer.

    Host-side lengths (python ints, known without a sync):
        prompt_lens: P_g for each group g.
        response_lens: response_lens[g][i] = R_{g,i}, in packed order.
        row_group / row_index_in_group: for row b (build order), its group and its index among the
            group's responses (packed order).

    Device tensors (see the module docstring for the meaning):
        input_ids (T,) int64 or None (``from_lengths`` carries no tokens)
        position_ids (T,) int64
        cu_seqlens (S+1,) int32; seg_ctx_start (S,), seg_ctx_len (S,) int32
        ctx_key_start (C,), ctx_key_len (C,), ctx_reader_start (C,), ctx_reader_end (C,) int32:
            context region c (one per group) covers keys [ctx_key_start, +ctx_key_len) and is read,
            as context, by the contiguous packed query range [ctx_reader_start, ctx_reader_end).
        token_segment (T,) int32: segment of every packed token.
        row_start (B,), row_len (B,) int32: packed start and length of each row's response.
        group_last_prompt_token (G,) int64: packed index of each group's last prompt token.
        pack_index (T,) int64 or None: for ``from_rows``, flat index into the (B*L) padded rows of
            the token each packed position was taken from.
        row_token_index (B, L) int64 or None: for ``from_rows``, the packed position of every
            response token of the padded rows (-1 elsewhere).
    """

    prompt_lens: tuple[int, ...]
    response_lens: tuple[tuple[int, ...], ...]
    row_group: tuple[int, ...]
    row_index_in_group: tuple[int, ...]
    input_ids: torch.Tensor | None
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    seg_ctx_start: torch.Tensor
    seg_ctx_len: torch.Tensor
    ctx_key_start: torch.Tensor
    ctx_key_len: torch.Tensor
    ctx_reader_start: torch.Tensor
    ctx_reader_end: torch.Tensor
    token_segment: torch.Tensor
    row_start: torch.Tensor
    row_len: torch.Tensor
    group_last_prompt_token: torch.Tensor
    pack_index: torch.Tensor | None = None
    row_token_index: torch.Tensor | None = None
    group_uids: tuple[Hashable, ...] | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ sizes
    @property
    def num_groups(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_rows(self) -> int:
        return len(self.row_group)

    @property
    def num_segments(self) -> int:
        return self.num_groups + self.num_rows

    @property
    def total_tokens(self) -> int:
        """T = sum_g (P_g + sum_i R_{g,i}), the packed length."""
        return sum(self.prompt_lens) + sum(sum(r) for r in self.response_lens)

    @property
    def replicated_tokens(self) -> int:
        """sum_g sum_i (P_g + R_{g,i}), the length of the N-replicated layout."""
        return sum(len(r) * p + sum(r) for p, r in zip(self.prompt_lens, self.response_lens))

    @property
    def rho(self) -> float:
        """Token reduction rho = N(P+R) / (P+NR), replicated over packed tokens."""
        return self.replicated_tokens / self.total_tokens

    @property
    def row_lens(self) -> list[int]:
        """Response length of each row, in row (build) order."""
        return [self.response_lens[g][i] for g, i in zip(self.row_group, self.row_index_in_group)]

    @property
    def max_response_len(self) -> int:
        return max(self.row_lens)

    @property
    def max_seqlen(self) -> int:
        """Longest segment (prompt or response)."""
        return max(max(self.prompt_lens), self.max_response_len)

    @property
    def max_ctx_len(self) -> int:
        return max(self.prompt_lens)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def group_range(self, g: int) -> tuple[int, int]:
        """Packed [start, end) of group g (its prompt and all its responses)."""
        start = sum(self.prompt_lens[:g]) + sum(sum(r) for r in self.response_lens[:g])
        return start, start + self.prompt_lens[g] + sum(self.response_lens[g])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedLayout:
        """A copy with every tensor on ``device`` (host lengths are shared)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved, _cache={})

    def __repr__(self) -> str:
        n = [len(r) for r in self.response_lens]
        return (
            f"PackedLayout(groups={self.num_groups}, rows={self.num_rows}, T={self.total_tokens}, "
            f"replicated={self.replicated_tokens}, rho={self.rho:.2f}, P={list(self.prompt_lens)}, N={n}, "
            f"device={self.device})"
        )

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_lengths(
        cls,
        prompt_lens: Sequence[int],
        response_lens: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
        input_ids: torch.Tensor | None = None,
    ) -> PackedLayout:
        """Layout for G groups: ``prompt_lens[g]`` = P_g, ``response_lens[g]`` = [R_g,1, ..., R_g,N_g].

        Rows are the responses in packed order (group by group, response by response).
        ``input_ids`` (T,), if given, are the packed tokens.
        """
        prompt_lens = [int(p) for p in prompt_lens]
        response_lens = [[int(r) for r in rs] for rs in response_lens]
        _check(len(prompt_lens) > 0, "prompt_lens: expected at least one group, got an empty list")
        _check(
            len(prompt_lens) == len(response_lens),
            f"response_lens: expected one list per group ({len(prompt_lens)} groups), got {len(response_lens)}",
        )
        for g, (p, rs) in enumerate(zip(prompt_lens, response_lens)):
            _check(p >= 1, f"prompt_lens[{g}]: expected a prompt of at least 1 token, got {p}")
            _check(len(rs) >= 1, f"response_lens[{g}]: expected at least one response in group {g}, got none")
            for i, r in enumerate(rs):
                _check(r >= 1, f"response_lens[{g}][{i}]: expected a response of at least 1 token, got {r}")
        rows = [(g, i) for g, rs in enumerate(response_lens) for i in range(len(rs))]
        return cls._build(prompt_lens, response_lens, rows, device, input_ids=input_ids)

    @classmethod
    def from_groups(
        cls, groups: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], device: torch.device | str | None = None
    ) -> PackedLayout:
        """Layout from token tensors: ``[(prompt_ids (P,), [response_ids (R_i,), ...]), ...]``.

        The packed ``input_ids`` are the prompt followed by its responses, group by group.
        """
        _check(len(groups) > 0, "groups: expected at least one (prompt_ids, [response_ids, ...]) pair, got none")
        pieces, prompt_lens, response_lens = [], [], []
        for g, item in enumerate(groups):
            _check(
                isinstance(item, (tuple, list)) and len(item) == 2,
                f"groups[{g}]: expected a (prompt_ids, [response_ids, ...]) pair, got {type(item).__name__}",
            )
            prompt, responses = item
            for name, t in [(f"groups[{g}] prompt_ids", prompt)] + [
                (f"groups[{g}] response_ids[{i}]", r) for i, r in enumerate(responses)
            ]:
                _check(isinstance(t, torch.Tensor), f"{name}: expected a 1-D tensor of token ids, got {type(t).__name__}")
                _check(t.dim() == 1, f"{name}: expected a 1-D tensor of token ids, got shape {tuple(t.shape)}")
                _check(not t.is_floating_point(), f"{name}: expected integer token ids, got dtype {t.dtype}")
            pieces.append(prompt)
            pieces.extend(responses)
            prompt_lens.append(prompt.numel())
            response_lens.append([r.numel() for r in responses])
        device = device if device is not None else groups[0][0].device
        if all(p.device.type == "cpu" for p in pieces):  # one copy, not one per sequence
            input_ids = to_device(torch.cat([p.long() for p in pieces]), device)
        else:
            input_ids = torch.cat([p.to(device=device, dtype=torch.long) for p in pieces])
        return cls.from_lengths(prompt_lens, response_lens, device=device, input_ids=input_ids)

    @classmethod
    def from_rows(
        cls,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        uid: Sequence[Hashable] | torch.Tensor | None = None,
        *,
        prompt_length: int | None = None,
        check_prompts: bool = True,
    ) -> PackedLayout:
        """Layout from padded rollout rows, as RL frameworks hold them (veRL style).

        Args:
            input_ids: (B, L) token ids; each row is [left-padded prompt | right-padded response].
            attention_mask: (B, L), 1 on real tokens.
            response_mask: (B, L_resp) with L_resp <= L, covering the last L_resp columns, 1 on
                response tokens; or give ``prompt_length`` instead (the first ``prompt_length``
                columns are the prompt region, the rest the response region).
            uid: (B,) group id of each row (any hashable, or an integer tensor). Rows with the same
                uid share one prompt; groups are numbered in order of first appearance.
            check_prompts: verify on device that rows sharing a uid have identical prompts.

        Packing order: group by group (first appearance), each group's rows in row order. Row order
        is preserved by ``unpack_logprobs`` and ``unpack_rows``.
        """
        _check(isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2,
               f"input_ids: expected a (B, L) tensor, got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
        B, L = input_ids.shape
        device = input_ids.device
        _check(B >= 1 and L >= 2, f"input_ids: expected at least one row of at least 2 tokens, got shape {(B, L)}")
        _check(not input_ids.is_floating_point(), f"input_ids: expected integer token ids, got dtype {input_ids.dtype}")
        _check(isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == (B, L),
               f"attention_mask: expected shape {(B, L)} like input_ids, got {tuple(getattr(attention_mask, 'shape', ()))}")
        _check(attention_mask.device == device, f"attention_mask: expected device {device}, got {attention_mask.device}")
        attn = attention_mask.bool()
        if response_mask is None:
            _check(prompt_length is not None, "response_mask: give a response_mask or a prompt_length, got neither")
            _check(0 < prompt_length < L, f"prompt_length: expected 0 < prompt_length < {L}, got {prompt_length}")
            resp = attn.clone()
            resp[:, :prompt_length] = False
        else:
            _check(prompt_length is None, "prompt_length: give a response_mask or a prompt_length, not both")
            _check(isinstance(response_mask, torch.Tensor) and response_mask.dim() == 2 and response_mask.shape[0] == B
                   and response_mask.shape[1] <= L,
                   f"response_mask: expected shape (B={B}, L_resp<={L}), got {tuple(getattr(response_mask, 'shape', ()))}")
            _check(response_mask.device == device, f"response_mask: expected device {device}, got {response_mask.device}")
            resp = torch.zeros_like(attn)
            resp[:, L - response_mask.shape[1]:] = response_mask.bool()
            _check(not bool((resp & ~attn).any()),
                   "response_mask: marks tokens that attention_mask says are padding; expected response tokens to be real tokens")
        prompt = attn & ~resp
        # Row-major nonzero keeps each row's tokens in sequence order.
        lens = torch.stack([prompt.sum(1), resp.sum(1)]).cpu()  # the one host sync
        row_p, row_r = lens[0].tolist(), lens[1].tolist()
        for b in range(B):
            _check(row_p[b] >= 1, f"attention_mask: row {b} has no prompt tokens; expected a prompt of at least 1 token")
            _check(row_r[b] >= 1, f"response_mask: row {b} has no response tokens; expected a response of at least 1 token")

        uids = cls._normalise_uid(uid, B)
        order: dict[Hashable, int] = {}
        row_group = [order.setdefault(u, len(order)) for u in uids]
        G = len(order)
        members: list[list[int]] = [[] for _ in range(G)]
        for b, g in enumerate(row_group):
            members[g].append(b)
        prompt_lens = [row_p[m[0]] for m in members]
        for g, m in enumerate(members):
            for b in m:
                if row_p[b] != prompt_lens[g]:
                    raise ValueError(
                        f"uid: rows {m[0]} and {b} share uid {list(order)[g]!r} but their prompts differ "
                        f"(lengths {prompt_lens[g]} and {row_p[b]}); expected identical prompts within a group"
                    )
        response_lens = [[row_r[b] for b in m] for m in members]
        row_index_in_group = [members[g].index(b) for b, g in enumerate(row_group)]

        # Flat indices of every prompt / response token in the (B*L) rows, row-major.
        flat_prompt = prompt.reshape(-1).nonzero().squeeze(1)
        flat_resp = resp.reshape(-1).nonzero().squeeze(1)
        prompt_off = [0] + torch.tensor(row_p).cumsum(0).tolist()
        resp_off = [0] + torch.tensor(row_r).cumsum(0).tolist()
        pieces = []
        for m in members:
            first = m[0]
            pieces.append((prompt_off[first], prompt_off[first + 1], flat_prompt))
            pieces.extend((resp_off[b], resp_off[b + 1], flat_resp) for b in m)
        pack_index = torch.cat([src[a:e] for a, e, src in pieces])
        flat_ids = input_ids.reshape(-1)

        if check_prompts:
            # Compare every row's prompt with its group's first row, token by token, on device.
            ref_rows = torch.tensor([members[g][0] for g in row_group])
            starts = torch.tensor(prompt_off[:-1])
            ref_idx = torch.repeat_interleave(starts[ref_rows] - starts, torch.tensor(row_p))
            ref_idx = to_device(ref_idx + torch.arange(flat_prompt.numel()), device)
            tokens = flat_ids[flat_prompt]
            bad_tok = tokens != tokens[ref_idx]
            if bool(bad_tok.any()):
                bad_row = int(torch.repeat_interleave(torch.arange(B), torch.tensor(row_p))[bad_tok.nonzero()[0, 0].cpu()])
                g = row_group[bad_row]
                raise ValueError(
                    f"uid: rows {members[g][0]} and {bad_row} share uid {list(order)[g]!r} but their prompt tokens differ; "
                    "expected identical prompts within a group"
                )

        rows = [(row_group[b], row_index_in_group[b]) for b in range(B)]
        layout = cls._build(prompt_lens, response_lens, rows, device, input_ids=flat_ids[pack_index],
                            group_uids=tuple(order))
        # Packed position of each response token of the padded rows.
        row_token_index = torch.full((B * L,), -1, dtype=torch.long, device=device)
        resp_targets = layout.response_token_index()  # row order, token order == flat_resp order
        row_token_index[flat_resp] = resp_targets
        return replace(layout, pack_index=pack_index, row_token_index=row_token_index.view(B, L), _cache={})

    @staticmethod
    def _normalise_uid(uid, B: int) -> list[Hashable]:
        _check(uid is not None, "uid: expected a group id per row (B,), got None")
        if isinstance(uid, torch.Tensor):
            _check(uid.dim() == 1 and uid.numel() == B, f"uid: expected shape ({B},), got {tuple(uid.shape)}")
            return uid.tolist()
        uids = list(uid)
        _check(len(uids) == B, f"uid: expected {B} group ids (one per row), got {len(uids)}")
        return [u.item() if hasattr(u, "item") else u for u in uids]

    @classmethod
    def _build(cls, prompt_lens, response_lens, rows, device, input_ids=None, group_uids=None) -> PackedLayout:
        """Everything else follows from the host lengths: a handful of small tensors, no sync."""
        seg_lens, seg_ctx_start, seg_ctx_len, positions = [], [], [], []
        ctx_key_start, ctx_key_len, ctx_reader_start, ctx_reader_end, last_prompt = [], [], [], [], []
        seg_start_of_row = {}
        offset = 0
        for g, (p, rs) in enumerate(zip(prompt_lens, response_lens)):
            seg_lens.append(p)
            seg_ctx_start.append(offset)
            seg_ctx_len.append(0)
            ctx_key_start.append(offset)
            ctx_key_len.append(p)
            ctx_reader_start.append(offset + p)
            ctx_reader_end.append(offset + p + sum(rs))
            last_prompt.append(offset + p - 1)
            prompt_start = offset
            offset += p
            for i, r in enumerate(rs):
                seg_start_of_row[(g, i)] = offset
                seg_lens.append(r)
                seg_ctx_start.append(prompt_start)
                seg_ctx_len.append(p)
                offset += r
        T = offset
        cu = [0]
        for n in seg_lens:
            cu.append(cu[-1] + n)
        seg_lens_t = torch.tensor(seg_lens)
        token_segment = torch.repeat_interleave(torch.arange(len(seg_lens), dtype=torch.int32), seg_lens_t)
        # position = ctx_len + (index within segment)
        within = torch.arange(T) - torch.repeat_interleave(torch.tensor(cu[:-1]), seg_lens_t)
        position_ids = within + torch.repeat_interleave(torch.tensor(seg_ctx_len), seg_lens_t)
        if input_ids is not None:
            _check(input_ids.dim() == 1 and input_ids.numel() == T,
                   f"input_ids: expected shape ({T},) matching the lengths, got {tuple(input_ids.shape)}")
        return cls(
            prompt_lens=tuple(prompt_lens),
            response_lens=tuple(tuple(r) for r in response_lens),
            row_group=tuple(g for g, _ in rows),
            row_index_in_group=tuple(i for _, i in rows),
            input_ids=None if input_ids is None else to_device(input_ids, device),
            position_ids=to_device(position_ids, device),
            cu_seqlens=_int32(cu, device),
            seg_ctx_start=_int32(seg_ctx_start, device),
            seg_ctx_len=_int32(seg_ctx_len, device),
            ctx_key_start=_int32(ctx_key_start, device),
            ctx_key_len=_int32(ctx_key_len, device),
            ctx_reader_start=_int32(ctx_reader_start, device),
            ctx_reader_end=_int32(ctx_reader_end, device),
            token_segment=to_device(token_segment, device),
            row_start=_int32([seg_start_of_row[r] for r in rows], device),
            row_len=_int32([response_lens[g][i] for g, i in rows], device),
            group_last_prompt_token=to_device(torch.tensor(last_prompt, dtype=torch.long), device),
            group_uids=group_uids,
        )

    # ------------------------------------------------------------------ maps back
    def _cached(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    @property
    def row_starts(self) -> list[int]:
        """Packed start of each row's response, in row (build) order (host ints; ``row_start`` on device).
        Computed once, in one pass over the groups (the index builders and the log-prob plans read it)."""

        def build():
            start, offset = {}, 0
            for g, (p, rs) in enumerate(zip(self.prompt_lens, self.response_lens)):
                offset += p
                for i, r in enumerate(rs):
                    start[g, i] = offset
                    offset += r
            return [start[g, i] for g, i in zip(self.row_group, self.row_index_in_group)]

        return self._cached("row_starts", build)

    def _response_token_index_host(self) -> torch.Tensor:
        def build():
            lens = torch.tensor(self.row_lens)
            within = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
            return torch.repeat_interleave(torch.tensor(self.row_starts), lens) + within

        return self._cached("response_token_index_host", build)

    def response_token_index(self) -> torch.Tensor:
        """(sum R,) int64: packed position of every response token, row by row, token by token."""
        return self._cached("response_token_index", lambda: to_device(self._response_token_index_host(), self.device))

    def logprob_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``src, tgt`` (sum R,) int64, row by row, token by token.

        ``tgt`` is each response token's packed position; ``src`` the packed position whose logits
        predict it: the previous response token, or for a response's first token its group's LAST
        PROMPT token. ``lp = log_softmax(logits[src]).gather(-1, input_ids[tgt, None])``.
        """

        def build():
            src = self._response_token_index_host() - 1
            row_first_pos = torch.cumsum(torch.tensor([0] + self.row_lens[:-1]), 0)
            last_prompt = [self.group_range(g)[0] + self.prompt_lens[g] - 1 for g in range(self.num_groups)]
            src[row_first_pos] = torch.tensor(last_prompt)[torch.tensor(self.row_group)]
            return to_device(src, self.device), self.response_token_index()

        return self._cached("logprob_index", build)

    def _row_scatter_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        def build():
            lens = torch.tensor(self.row_lens)
            rows = torch.repeat_interleave(torch.arange(self.num_rows), lens)
            cols = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
            return to_device(rows, self.device), to_device(cols, self.device)

        return self._cached("row_scatter_index", build)

    def unpack_logprobs(self, values: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
        """(sum R, ...) values in ``logprob_index`` order -> (B, R_max, ...), padded with ``pad_value``.

        Differentiable. Rows come in the order the layout was built from.
        """
        n = sum(self.row_lens)
        _check(isinstance(values, torch.Tensor) and values.dim() >= 1 and values.shape[0] == n,
               f"values: expected shape ({n}, ...) (one value per response token), got {tuple(getattr(values, 'shape', ()))}")
        rows, cols = self._row_scatter_index()
        out = values.new_full((self.num_rows, self.max_response_len, *values.shape[1:]), pad_value)
        return out.index_put((rows, cols), values)

    def response_mask(self) -> torch.Tensor:
        """(B, R_max) bool: True on real response tokens of the ``unpack_logprobs`` output."""
        return torch.arange(self.max_response_len, device=self.device)[None, :] < self.row_len[:, None]

    def pack_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) values on the padded rows of ``from_rows`` -> (T, ...) packed (prompt taken once)."""
        _check(self.pack_index is not None, "pack_rows: this layout was not built with from_rows, so it has no padded rows")
        B, L = self.row_token_index.shape
        _check(x.dim() >= 2 and tuple(x.shape[:2]) == (B, L), f"x: expected shape ({B}, {L}, ...), got {tuple(x.shape)}")
        return x.reshape(B * L, *x.shape[2:])[self.pack_index]

    # ------------------------------------------------------------------ replicated view
    def replicated_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The N-replicated layout, one sequence per row (prompt copied into every row).

        Returns ``index (T_rep,)`` int64, the packed position of each replicated token (rows in row
        order, each row = its group's prompt then its response), and ``cu_seqlens (B+1,)`` int32.
        ``x_rep = x_packed[index]`` builds the baseline every result must equal.
        """

        def build():
            pieces, cu = [], [0]
            for g, i, r_start in zip(self.row_group, self.row_index_in_group, self.row_starts):
                p_start = self.group_range(g)[0]
                p = self.prompt_lens[g]
                r = self.response_lens[g][i]
                pieces += [torch.arange(p_start, p_start + p), torch.arange(r_start, r_start + r)]
                cu.append(cu[-1] + p + r)
            return to_device(torch.cat(pieces), self.device), _int32(cu, self.device)

        return self._cached("replicated_index", build)

    def replicated_logprob_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``src, tgt`` positions in the replicated layout, in the same order as ``logprob_index``."""

        def build():
            src, tgt, row_start = [], [], 0
            for g, i in zip(self.row_group, self.row_index_in_group):
                p, r = self.prompt_lens[g], self.response_lens[g][i]
                t = torch.arange(row_start + p, row_start + p + r)
                tgt.append(t)
                src.append(t - 1)
                row_start += p + r
            return to_device(torch.cat(src), self.device), to_device(torch.cat(tgt), self.device)

        return self._cached("replicated_logprob_index", build)
