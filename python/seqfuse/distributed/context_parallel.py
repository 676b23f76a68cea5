"""Context parallelism (CP) for attention: one sequence spread over the ranks
of a process group, each rank holding 1/cp of the tokens of q, k and v.

Why: attention's activations and its O(s^2) work grow with the sequence; CP
splits both over cp GPUs so contexts longer than one GPU holds can train.

Token layout (Transformer Engine's "DualChunkSwap", Megatron's load-balanced
split): every sequence is cut into 2*cp equal chunks and rank r holds chunks
r and 2cp-1-r, in that order.  Under a causal mask chunk c attends to chunks
0..c, so pairing an early chunk with a late one gives every rank the same
amount of work.  bshd/sbhd: the sequence length must be a multiple of 2*cp.
thd (packed): every sequence is split that way, so every sequence length
must be a multiple of 2*cp (pad each sequence at its end; split_batch.py has
the padding and splitting helpers).  ``cu_seqlens_q`` given to this module
are those of the FULL packed batch, as in TE; the rank's tokens are the
ones split_batch_for_cp_rank picks.

Two ways to meet the other ranks' keys and values (``cp_comm_type``):

- "p2p": a ring.  K and V travel one rank forward per step (torch.distributed
  isend/irecv, batched); while the next block is in flight the rank runs
  attention of its queries against the block in hand.  With the split above,
  the block from rank j needs (causal): j == r, the rank's own chunks under
  the plain causal mask of its 2-chunk local sequence; j < r, all local
  queries against the first half (chunk j) of the block, no mask (chunk
  2cp-1-j lies in the future of both local chunks); j > r, the second local
  half (chunk 2cp-1-r) against the whole block, no mask (the first local
  chunk r is earlier than both of j's chunks).  Without a causal mask every
  block is needed whole.
- "all_gather": one all-gather of K and V, put back in sequence order; each
  local chunk c attends to the prefix of chunks 0..c (bottom-right causal)
  or to everything (no mask).  The backward reduce-scatters dK and dV.

Partial results are merged exactly with their softmax log-sum-exp (lse):
lse = logaddexp(lse_a, lse_b), out = out_a * exp(lse_a - lse) + out_b *
exp(lse_b - lse), accumulated in float32.  The backward runs every block's
seqfuse.ops.attention_backward with the FINAL out and lse, which makes each
block's dq, dk, dv exactly its share of the full gradient (P = exp(S - lse)
is the global probability); the ring carries float32 dK/dV accumulators with
the K/V blocks, each returning to its owner after cp steps.

Not supported (each raises): dropout (NotImplementedError: the Philox mask of
a block would have to be drawn at its global offsets), sliding windows,
padding masks in bshd/sbhd, cross-attention (k's length must equal q's),
cp_comm_type "a2a" and "a2a+p2p".
"""
import torch
import torch.distributed as dist

from .. import ops
from ..ops.attn import PerTensorCache
from ..ops import device_checks

COMM_TYPES = ("p2p", "all_gather")
_TE_ONLY_COMM_TYPES = ("a2a", "a2a+p2p")
_CAUSAL = {"causal", "padding_causal", "padding,causal", "causal,padding"}
_FULL = {"no_mask", "padding"}


def check_comm_type(cp_comm_type, who):
    """cp_comm_type is one this module runs: "p2p" or "all_gather"."""
    if cp_comm_type in _TE_ONLY_COMM_TYPES:
        raise NotImplementedError(f"{who}: cp_comm_type {cp_comm_type!r} (Ulysses all-to-all) is not supported; "
                                  f"use one of {COMM_TYPES}")
    if cp_comm_type not in COMM_TYPES:
        raise ValueError(f"{who}: cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")


def group_ranks(cp_group, cp_global_ranks, who):
    """(cp size, this rank's index in cp_group, the group's global ranks),
    checked: cp_global_ranks, when given, must list the group's members in
    group-rank order (it is how TE names them; the ring's peers come from it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{who}: context parallelism needs an initialized torch.distributed process group")
    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"{who}: cp_group must be a torch.distributed ProcessGroup, got {type(cp_group).__name__}")
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    members = dist.get_process_group_ranks(cp_group)
    if cp_global_ranks is not None:
        given = [int(x) for x in cp_global_ranks]
        if given != list(members):
            raise ValueError(f"{who}: cp_global_ranks {given} must be the global ranks of cp_group in its rank "
                             f"order, {list(members)}")
    return size, rank, list(members)


# ---- where each token lives -------------------------------------------------

def local_token_index(lengths, cp, rank):
    """For rank ``rank`` of ``cp``: the position in the full packed batch of
    each of its tokens, in its local order (per sequence, chunk rank then
    chunk 2cp-1-rank), as a CPU int64 tensor.  ``lengths`` (CPU int64) are
    the sequence lengths, each a multiple of 2*cp."""
    chunk = lengths // (2 * cp)
    local_len = 2 * chunk
    seq = torch.repeat_interleave(torch.arange(len(lengths)), local_len)
    local_start = torch.cumsum(local_len, 0) - local_len
    offset = torch.arange(int(local_len.sum())) - local_start[seq]
    c = chunk[seq]
    half = offset // c.clamp(min=1)
    within = offset - half * c
    global_chunk = torch.where(half == 0, torch.full_like(half, rank), torch.full_like(half, 2 * cp - 1 - rank))
    global_start = torch.cumsum(lengths, 0) - lengths
    return global_start[seq] + global_chunk * c + within


def _check_lengths(lengths, cp, name, who):
    bad = (lengths % (2 * cp)) != 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{who}: with context parallelism of size {cp} every sequence length in {name} must be a "
                         f"multiple of 2*cp = {2 * cp} (pad each sequence at its end); sequence {i} has length "
                         f"{int(lengths[i])}")


class _Plan:
    """The index bookkeeping of one CP call: how to take the first/second
    half of the local tokens, and (all_gather) how the gathered tokens map
    to sequence order and which keys each local chunk sees."""

    def __init__(self, fmt, cp, rank, device, s_local=None, lengths=None):
        self.fmt, self.cp, self.rank = fmt, cp, rank
        self.seq_dim = {"bshd": 1, "sbhd": 0, "thd": 0}[fmt]
        if fmt == "thd":
            self.lengths = lengths  # full sequence lengths, CPU int64
            chunk = lengths // (2 * cp)
            zero = torch.zeros(1, dtype=torch.int64)
            self.cu_local = torch.cat([zero, torch.cumsum(2 * chunk, 0)]).to(device, torch.int32)
            self.cu_half = torch.cat([zero, torch.cumsum(chunk, 0)]).to(device, torch.int32)
            self.cu_full = torch.cat([zero, torch.cumsum(lengths, 0)]).to(device, torch.int32)
            self.max_chunk = int(chunk.max()) if len(chunk) else 0
            seq = torch.repeat_interleave(torch.arange(len(chunk)), 2 * chunk)
            start = torch.cumsum(2 * chunk, 0) - 2 * chunk
            first = (torch.arange(int(2 * chunk.sum())) - start[seq]) < chunk[seq]
            self.idx = (first.nonzero().flatten().to(device), (~first).nonzero().flatten().to(device))
            self.t_local = int(2 * chunk.sum())
        else:
            self.chunk = s_local // 2
            self.max_chunk = self.chunk
            self.t_local = s_local
        self.device = device
        self._gather_order = None
        self._chunk_keys = {}

    # halves of the local tokens (0: chunk rank, 1: chunk 2cp-1-rank) of a
    # q/k/v/out-shaped tensor or, with lse=True, of a softmax statistic
    # ([h, t] in thd, [b, h, s] otherwise)
    def _token_dim(self, lse):
        if self.fmt == "thd":
            return 1 if lse else 0
        return 2 if lse else self.seq_dim

    def half(self, x, h, lse=False):
        """Half h of x: a copy (index_select) in thd, a view (narrow) otherwise."""
        if self.fmt == "thd":
            return x.index_select(self._token_dim(lse), self.idx[h])
        return x.narrow(self._token_dim(lse), h * self.chunk, self.chunk)

    def put_half(self, x, h, value, lse=False):
        if self.fmt == "thd":
            x.index_copy_(self._token_dim(lse), self.idx[h], value)
        else:
            self.half(x, h, lse).copy_(value)

    def add_half(self, x, h, value):
        if self.fmt == "thd":
            x.index_add_(self._token_dim(False), self.idx[h], value)
        else:
            self.half(x, h).add_(value)

    def block_args(self, part_q, part_kv, mask):
        """attention_forward/backward keywords for local queries (part_q: "all" or a
        half) against a kv block (part_kv: "all" or half 0)."""
        kw = dict(qkv_format=self.fmt, attn_mask_type=mask)
        if self.fmt == "thd":
            kw["cu_seqlens_q"] = self.cu_local if part_q == "all" else self.cu_half
            kw["cu_seqlens_kv"] = self.cu_local if part_kv == "all" else self.cu_half
            kw["max_seqlen_q"] = self.max_chunk * (2 if part_q == "all" else 1)
            kw["max_seqlen_kv"] = self.max_chunk * (2 if part_kv == "all" else 1)
        return kw

    # all_gather: rank-major gathered tokens -> sequence order
    def gather_order(self):
        """int64 index (on the device) of every token of the full batch in
        the rank-major gathered tensor (ranks' local tokens end to end)."""
        if self._gather_order is None:
            lengths = self.lengths if self.fmt == "thd" else torch.tensor([2 * self.cp * self.chunk])
            order = torch.empty(int(lengths.sum()), dtype=torch.int64)
            for r in range(self.cp):
                order[local_token_index(lengths, self.cp, r)] = torch.arange(self.t_local) + r * self.t_local
            self._gather_order = order.to(self.device)
        return self._gather_order

    def chunk_keys(self, h):
        """The keys local half h sees under a causal mask, in sequence
        order: each sequence's chunks 0..c (c = its global chunk).  Returns
        (index of those keys in the sequence-ordered full tensor, or None
        for bshd/sbhd, where they are a prefix; that prefix's length, or
        None for thd; the attention keywords: bottom-right causal, which
        aligns the chunk's last query with its last key).  Built once per
        plan and half."""
        if h not in self._chunk_keys:
            self._chunk_keys[h] = self._make_chunk_keys(h)
        return self._chunk_keys[h]

    def _make_chunk_keys(self, h):
        c = self.rank if h == 0 else 2 * self.cp - 1 - self.rank
        kw = dict(qkv_format=self.fmt, attn_mask_type="causal_bottom_right")
        if self.fmt != "thd":
            return None, (c + 1) * self.chunk, kw
        chunk = self.lengths // (2 * self.cp)
        keep = (c + 1) * chunk
        seq = torch.repeat_interleave(torch.arange(len(chunk)), keep)
        start = torch.cumsum(self.lengths, 0) - self.lengths
        kstart = torch.cumsum(keep, 0) - keep
        index = (start[seq] + torch.arange(int(keep.sum())) - kstart[seq]).to(self.device)
        zero = torch.zeros(1, dtype=torch.int64)
        kw.update(attn_mask_type="padding_causal_bottom_right", cu_seqlens_q=self.cu_half,
                  cu_seqlens_kv=torch.cat([zero, torch.cumsum(keep, 0)]).to(self.device, torch.int32),
                  max_seqlen_q=self.max_chunk, max_seqlen_kv=(c + 1) * self.max_chunk)
        return index, None, kw

    def full_keys_args(self):
        """Keywords for all local queries against the whole sequence (no mask)."""
        kw = dict(qkv_format=self.fmt, attn_mask_type="no_mask")
        if self.fmt == "thd":
            kw.update(attn_mask_type="padding", cu_seqlens_q=self.cu_local, cu_seqlens_kv=self.cu_full,
                      max_seqlen_q=2 * self.max_chunk, max_seqlen_kv=2 * self.cp * self.max_chunk)
        return kw


def _thd_plan(cu_seqlens, cp, rank, who):
    cu = cu_seqlens.detach().to("cpu", torch.int64)  # one host read per cu_seqlens tensor (cached)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{who}: cu_seqlens_q must be a 1-D non-decreasing int32 tensor starting at 0")
    lengths = cu[1:] - cu[:-1]
    _check_lengths(lengths, cp, "cu_seqlens_q", who)
    return _Plan("thd", cp, rank, cu_seqlens.device, lengths=lengths)


_thd_plans = PerTensorCache(_thd_plan)
_dense_plans = {}  # bshd/sbhd plans by (format, cp, rank, device, local length): they hold the gather order


# ---- the exact merge of partial attention results ---------------------------

def _lse_to_out(w, fmt):
    """A per-row lse-shaped tensor broadcast against the output layout."""
    if fmt == "thd":      # lse [h, t] -> [t, h, 1]
        return w.transpose(0, 1).unsqueeze(-1)
    if fmt == "bshd":     # lse [b, h, s] -> [b, s, h, 1]
        return w.transpose(1, 2).unsqueeze(-1)
    return w.permute(2, 0, 1).unsqueeze(-1)  # sbhd: [s, b, h, 1]


def _no_key_to_neg_inf(lse):
    # the kernel writes +inf for a row that sees no key; for merging it weighs nothing
    return torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


def merge_partial(out_acc, lse_acc, out_i, lse_i, fmt):
    """The exact softmax merge of two partial attentions over disjoint key
    sets, in place: out_acc (float32) and lse_acc (float32, -inf meaning
    "no key yet") become those of the union; out_i may be in a lower
    precision.  out_acc/lse_acc may be views (a half of the local rows)."""
    lse_i = _no_key_to_neg_inf(lse_i)
    lse = torch.logaddexp(lse_acc, lse_i)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)  # rows still without a key: weights 0
    w_acc = _lse_to_out(torch.exp(lse_acc - safe), fmt)
    w_i = _lse_to_out(torch.exp(lse_i - safe), fmt)
    out_acc.mul_(w_acc).addcmul_(out_i, w_i)  # two passes over the output, no float32 copy of out_i
    lse_acc.copy_(lse)


# ---- communication ----------------------------------------------------------

class _Comm:
    """The ring's peers and the optional side stream for its transfers."""

    def __init__(self, group, members, size, rank, stream, device):
        self.group, self.size, self.rank = group, size, rank
        self.next = members[(rank + 1) % size]
        self.prev = members[(rank - 1) % size]
        self.stream = stream if (stream is not None and device.type == "cuda") else None

    def exchange(self, pairs):
        """Post isend(send -> next) / irecv(recv <- prev) for each (send,
        recv, tag) pair in one batch; returns the works to wait on.  With a
        cp_stream the transfers are issued from it (after it waits for the
        current stream, which produced the data)."""
        ops_ = []
        for send, recv, tag in pairs:
            ops_.append(dist.P2POp(dist.isend, send, self.next, self.group, tag))
            ops_.append(dist.P2POp(dist.irecv, recv, self.prev, self.group, tag))
        if self.stream is None:
            return dist.batch_isend_irecv(ops_)
        self.stream.wait_stream(torch.cuda.current_stream(send.device))
        with torch.cuda.stream(self.stream):
            return dist.batch_isend_irecv(ops_)

    @staticmethod
    def wait(works):
        # on CUDA the current stream waits for the transfers (no host sync)
        for w in works:
            w.wait()


_TAG_KV, _TAG_DKV = 11, 12


# ---- the autograd functions -------------------------------------------------

def _step_kind(causal, step, rank, size):
    """Which block the ring's step holds, relative to this rank: "diag" (its
    own), "earlier" (a rank before it), "later" (a rank after it), or "full"
    without a causal mask."""
    if not causal:
        return "full"
    if step == 0:
        return "diag"
    return "earlier" if (rank - step) % size < rank else "later"


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, comm, causal, scale, deterministic):
        kv = torch.stack([k.detach(), v.detach()])  # one buffer per transfer
        out_acc = lse_acc = None
        works, nxt = [], None
        for step in range(comm.size):
            if step + 1 < comm.size:
                nxt = torch.empty_like(kv)
                works = comm.exchange([(kv, nxt, _TAG_KV)])
            kind = _step_kind(causal, step, comm.rank, comm.size)
            kk, vv = kv[0], kv[1]
            if kind == "diag" or kind == "full":
                mask = "causal" if kind == "diag" else "no_mask"
                o, lse = ops.attention_forward(q, kk, vv, softmax_scale=scale, **plan.block_args("all", "all", mask))
                if out_acc is None:
                    out_acc, lse_acc = o.float(), _no_key_to_neg_inf(lse)
                else:
                    merge_partial(out_acc, lse_acc, o, lse, plan.fmt)
            elif kind == "earlier":
                o, lse = ops.attention_forward(q, plan.half(kk, 0), plan.half(vv, 0), softmax_scale=scale,
                                           **plan.block_args("all", 0, "no_mask"))
                merge_partial(out_acc, lse_acc, o, lse, plan.fmt)
            else:  # later
                o, lse = ops.attention_forward(plan.half(q, 1), kk, vv, softmax_scale=scale,
                                           **plan.block_args(1, "all", "no_mask"))
                # bshd/sbhd: the halves are views, merged in place; thd: gathered rows, merged, put back
                o_half, l_half = plan.half(out_acc, 1), plan.half(lse_acc, 1, lse=True)
                merge_partial(o_half, l_half, o, lse, plan.fmt)
                if plan.fmt == "thd":
                    plan.put_half(out_acc, 1, o_half)
                    plan.put_half(lse_acc, 1, l_half, lse=True)
            if step + 1 < comm.size:
                comm.wait(works)
                kv = nxt
        out = out_acc.to(q.dtype)
        # the kernel's convention for rows that saw no key: +inf
        lse = torch.where(torch.isneginf(lse_acc), torch.full_like(lse_acc, float("inf")), lse_acc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.comm, ctx.causal, ctx.scale, ctx.deterministic = plan, comm, causal, scale, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, comm, scale = ctx.plan, ctx.comm, ctx.scale
        dout = dout.contiguous()
        kv = torch.stack([k, v])
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        backward_args = dict(softmax_scale=scale, deterministic=ctx.deterministic)
        kv_works, dkv_works, nxt, dkv_in = [], [], None, None
        for step in range(comm.size):
            if step + 1 < comm.size:
                nxt = torch.empty_like(kv)
                kv_works = comm.exchange([(kv, nxt, _TAG_KV)])
            kind = _step_kind(ctx.causal, step, comm.rank, comm.size)
            kk, vv = kv[0], kv[1]
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this block's dK, dV
            if kind == "diag" or kind == "full":
                mask = "causal" if kind == "diag" else "no_mask"
                gq, gk, gv = ops.attention_backward(dout, q, kk, vv, out, lse, **backward_args,
                                               **plan.block_args("all", "all", mask))
                dq.add_(gq)
                dkv[0].add_(gk)
                dkv[1].add_(gv)
            elif kind == "earlier":
                gq, gk, gv = ops.attention_backward(dout, q, plan.half(kk, 0), plan.half(vv, 0), out, lse, **backward_args,
                                               **plan.block_args("all", 0, "no_mask"))
                dq.add_(gq)
                plan.add_half(dkv[0], 0, gk)
                plan.add_half(dkv[1], 0, gv)
            else:  # later
                gq, gk, gv = ops.attention_backward(plan.half(dout, 1), plan.half(q, 1), kk, vv, plan.half(out, 1),
                                               plan.half(lse, 1, lse=True).contiguous(), **backward_args,
                                               **plan.block_args(1, "all", "no_mask"))
                plan.add_half(dq, 1, gq)
                dkv[0].add_(gk)
                dkv[1].add_(gv)
            # the accumulator of this block's owner arrives from the previous rank, gains this
            # rank's share and moves on; after cp steps each accumulator is back with its owner
            if step > 0:
                comm.wait(dkv_works)
                dkv.add_(dkv_in)
            if comm.size == 1:  # a group of one: the block is the rank's own, nothing to send
                dkv_in, dkv_works = dkv, []
                break
            dkv_in = torch.empty_like(dkv)
            dkv_works = comm.exchange([(dkv, dkv_in, _TAG_DKV)])
            if step + 1 < comm.size:
                comm.wait(kv_works)
                kv = nxt
        comm.wait(dkv_works)
        return (dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), None, None, None, None, None)


def _all_gather_kv(k, v, plan, comm):
    """K and V of the whole sequence, in sequence order: one all-gather of
    the stacked local [2, ...] block, then the rank-major tokens reordered."""
    kv = torch.stack([k.detach(), v.detach()])
    gathered = torch.empty((comm.size * 2,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    dist.all_gather_into_tensor(gathered, kv, group=comm.group)  # ranks' blocks along dim 0
    gathered = gathered.unflatten(0, (comm.size, 2))
    sd = plan.seq_dim + 1  # the sequence dim in the stacked [2, ...] block
    rank_major = gathered.movedim(0, sd).flatten(sd, sd + 1)  # [2, ..., cp * t_local, ...]
    return rank_major.index_select(sd, plan.gather_order())


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, comm, causal, scale, deterministic):
        kv = _all_gather_kv(k, v, plan, comm)
        if causal:
            out = torch.empty_like(q)
            lse = torch.empty(_lse_shape(q, plan), dtype=torch.float32, device=q.device)
            for h in (0, 1):
                kk, vv, kw = _chunk_keys(kv, plan, h)
                o, l = ops.attention_forward(plan.half(q, h), kk, vv, softmax_scale=scale, **kw)
                plan.put_half(out, h, o)
                plan.put_half(lse, h, l, lse=True)
        else:
            out, lse = ops.attention_forward(q, kv[0], kv[1], softmax_scale=scale, **plan.full_keys_args())
        ctx.save_for_backward(q, k, v, out, lse)  # the gathered K/V is gathered again in the backward
        ctx.plan, ctx.comm, ctx.causal, ctx.scale, ctx.deterministic = plan, comm, causal, scale, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, comm = ctx.plan, ctx.comm
        dout = dout.contiguous()
        kv = _all_gather_kv(k, v, plan, comm)
        sd = plan.seq_dim + 1
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # sequence order
        backward_args = dict(softmax_scale=ctx.scale, deterministic=ctx.deterministic)
        if ctx.causal:
            dq = torch.empty_like(q)
            for h in (0, 1):
                kk, vv, kw = _chunk_keys(kv, plan, h)
                gq, gk, gv = ops.attention_backward(plan.half(dout, h), plan.half(q, h), kk, vv, plan.half(out, h),
                                               plan.half(lse, h, lse=True).contiguous(), **backward_args, **kw)
                plan.put_half(dq, h, gq)
                index, prefix, _ = plan.chunk_keys(h)
                if index is None:
                    dkv.narrow(sd, 0, prefix).add_(torch.stack([gk, gv]))
                else:
                    dkv.index_add_(sd, index, torch.stack([gk, gv]).float())
        else:
            dq, gk, gv = ops.attention_backward(dout, q, kv[0], kv[1], out, lse, **backward_args, **plan.full_keys_args())
            dkv[0].add_(gk)
            dkv[1].add_(gv)
        # back to rank-major order, then each rank keeps the sum of its own tokens' rows
        rank_major = torch.empty_like(dkv).index_copy_(sd, plan.gather_order(), dkv)
        send = rank_major.unflatten(sd, (comm.size, plan.t_local)).movedim(sd, 0).contiguous()
        mine = torch.empty(send.shape[1:], dtype=send.dtype, device=send.device)
        dist.reduce_scatter_tensor(mine, send.flatten(0, 1), group=comm.group)
        return dq, mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None


def _lse_shape(q, plan):
    if plan.fmt == "thd":
        return (q.shape[1], q.shape[0])
    b = q.shape[0] if plan.fmt == "bshd" else q.shape[1]
    return (b, q.shape[-2], q.shape[plan.seq_dim])


def _chunk_keys(kv, plan, h):
    index, prefix, kw = plan.chunk_keys(h)
    sd = plan.seq_dim  # in k/v (kv[0], kv[1])
    if index is None:
        return kv[0].narrow(sd, 0, prefix), kv[1].narrow(sd, 0, prefix), kw
    return kv[0].index_select(sd, index), kv[1].index_select(sd, index), kw


# ---- the entry --------------------------------------------------------------

def context_parallel_attention(q, k, v, *, cp_group, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
                               qkv_format="bshd", attn_mask_type="causal", cu_seqlens_q=None,
                               cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None,
                               softmax_scale=None, deterministic=False, dropout_p=0.0):
    """Attention of this rank's tokens (the load-balanced split above) over
    the whole sequence held by ``cp_group``; returns out in q's layout and
    dtype, with autograd.  Arguments as seqfuse.ops.attention, plus TE's CP
    arguments; for thd, ``cu_seqlens_q``/``cu_seqlens_kv`` describe the
    FULL batch (TE's convention) and the local tensors hold 1/cp of each
    sequence's tokens.  The split's lengths and indices are derived from
    cu_seqlens_q once per tensor (one host read, cached while that tensor
    lives unmodified), so ``max_seqlen_q``/``max_seqlen_kv`` are not read.
    A group of one rank is plain attention."""
    who = "context_parallel_attention"
    check_comm_type(cp_comm_type, who)
    if dropout_p:
        raise NotImplementedError(f"{who}: dropout_p > 0 (attention dropout) is not supported with context "
                                  f"parallelism, got dropout_p={dropout_p}")
    if qkv_format not in ("bshd", "sbhd", "thd"):
        raise ValueError(f"{who}: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    causal_ok, full_ok = set(_CAUSAL), set(_FULL)
    if qkv_format != "thd":
        causal_ok, full_ok = {"causal"}, {"no_mask"}
    if attn_mask_type not in causal_ok | full_ok:
        raise NotImplementedError(f"{who}: attn_mask_type {attn_mask_type!r} is not supported with context "
                                  f"parallelism in {qkv_format}; use one of {sorted(causal_ok | full_ok)}")
    causal = attn_mask_type in causal_ok
    if window_size is not None and tuple(window_size) not in ((-1, -1), (-1, 0) if causal else (-1, -1)):
        raise NotImplementedError(f"{who}: window_size {tuple(window_size)} (sliding window) is not supported with "
                                  "context parallelism")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{who}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if k.shape != v.shape:
        raise ValueError(f"{who}: k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    size, rank, members = group_ranks(cp_group, cp_global_ranks, who)
    if qkv_format == "thd":
        if cu_seqlens_q is None:
            raise ValueError(f"{who}: qkv_format 'thd' needs cu_seqlens_q (of the full batch)")
        if cu_seqlens_kv is not None and cu_seqlens_kv is not cu_seqlens_q and \
                not torch.equal(cu_seqlens_kv, cu_seqlens_q):
            raise NotImplementedError(f"{who}: cu_seqlens_kv different from cu_seqlens_q (cross-attention) is "
                                      "not supported with context parallelism")
        if device_checks.capturing(q):
            raise NotImplementedError(f"{who}: thd under CUDA graph capture is not supported (the split reads "
                                      "cu_seqlens_q on the host)")
        plan = _thd_plans(cu_seqlens_q, size, rank, who)
        if q.shape[0] != plan.t_local or k.shape[0] != plan.t_local:
            raise ValueError(f"{who}: q and k hold {q.shape[0]} and {k.shape[0]} tokens; cu_seqlens_q (full batch, "
                             f"{int(plan.lengths.sum())} tokens) gives this rank {plan.t_local} (1/{size})")
    else:
        sd = 1 if qkv_format == "bshd" else 0
        s_local = q.shape[sd]
        if k.shape[sd] != s_local:
            raise NotImplementedError(f"{who}: k's sequence length {k.shape[sd]} differs from q's {s_local}: "
                                      "cross-attention is not supported with context parallelism")
        if s_local % 2:
            raise ValueError(f"{who}: the local sequence length {s_local} must be even (the sequence length "
                             f"{s_local * size} a multiple of 2*cp = {2 * size}): each rank holds two chunks")
        key = (qkv_format, size, rank, q.device, s_local)
        plan = _dense_plans.get(key)
        if plan is None:
            if len(_dense_plans) > 64:
                _dense_plans.clear()
            plan = _dense_plans[key] = _Plan(qkv_format, size, rank, q.device, s_local=s_local)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    comm = _Comm(cp_group, members, size, rank, cp_stream, q.device)
    fn = _RingAttention if cp_comm_type == "p2p" else _AllGatherAttention
    return fn.apply(q, k, v, plan, comm, causal, float(scale), bool(deterministic))
