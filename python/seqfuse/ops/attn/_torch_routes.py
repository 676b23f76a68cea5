"""Two routes of ``ops.attention`` through torch's own fused kernels, for the
calls the cuDNN route (torch SDPA on padding-free bshd/sbhd, _routing.py)
cannot take: packed (thd) batches, padded batches with key masks, grouped
query attention, sliding windows, attention dropout, and float32 on CUDA.
_routing.py decides which route a call takes; this file holds each route's
rules (pure functions of the call's facts) and the code that runs it.

"flash": torch's FlashAttention-2 (``torch.ops.aten._flash_attention_forward``,
the kernel behind ``torch.nn.attention.varlen.varlen_attn`` and SDPA's
FLASH_ATTENTION backend; present with this signature from torch 2.5 through
2.15), forward and backward (torch's autograd runs
``_flash_attention_backward`` with the forward's saved RNG state, so the
backward drops exactly the forward's elements).  float16/bfloat16, head dims
multiples of 8 up to 256, GQA/MQA natively, windows, dropout.  Layouts:

- thd: q, k, v as given ([t, h, d]) with the caller's cu_seqlens, plus
  extension sequences that cover the tokens past the last sequence (the
  "tail"): queries in chunks of at most max_seqlen_q that see no key, then
  keys in chunks of at most max_seqlen_kv that no query sees.  FlashAttention
  writes 0 for a query without keys and 0 gradients for a key without
  queries, so the tail comes out 0 both ways, as in seqfuse's kernels,
  without reading the lengths on the host.
- padded bshd/sbhd (a padding mask with per-row cu_seqlens): the rows laid
  end to end ([b * s, h, d], sbhd copied to bshd first), each row three
  sequences: (its q tokens, its kv tokens), (its query padding, no keys),
  (no queries, its key padding); padding queries come out 0, as in seqfuse's
  kernels.  The rows' lengths are clamped to [0, s] on the device (as
  seqfuse's kernels clamp); they are never read on the host.
- bshd/sbhd without padding: the [b, s, h, d] views as they are.

FlashAttention aligns causal masks and windows bottom-right (query r of a
sequence of sq queries and sk keys is diagonal to key r + sk - sq), which is
seqfuse's rule for every mask except the top-left causal ones ("causal",
"padding_causal"); those are taken only where every sequence has as many
queries as keys: equal s_q and s_kv without padding, or the very same
cu_seqlens tensor for q and kv (rule ``alignment``).

Dropout on this route is torch's: the keep mask comes from torch's CUDA
generator through FlashAttention's own Philox stream, not seqfuse's
(seed, offset) scheme (_dropout.py).  Each attention weight is dropped
independently and the kept ones are scaled by 1 / (1 - p), as in seqfuse's
kernels, so the results are distributed alike but are not the same
elements; one difference: FlashAttention keeps a weight when an 8-bit draw
is at most floor((1 - p) * 255), a keep rate within 1/256 of 1 - p (0.8984
for p = 0.1), while the scale stays 1 / (1 - p).  torch's autograd saves
the forward's RNG state, so the backward drops the same elements (checked in
tests/test_attn_routes_cuda.py).  A call that passes an explicit
``rng_state`` asks for seqfuse's mask and stays on seqfuse's kernels (rule
``rng_state``).

"torch_fp32": float32 on CUDA, which seqfuse's CUDA kernels do not take.
torch SDPA with its memory-efficient or math backend (math only when
``deterministic``), with an explicit boolean mask built on the device where
the call needs one (padding, windows, bottom-right causal at unequal
lengths): exact in float32, every mask, window and GQA ratio (k and v
repeated per q head), dropout through SDPA's dropout_p (torch's RNG, as
above).  A query that sees no key is given key 0 inside SDPA (whose softmax
would be NaN over nothing) and its output set to 0 after, which also makes
its gradients 0.  thd runs one SDPA call per sequence (the lengths are read
on the host: one sync, and not under CUDA graph capture, rule
``graph_capture``).  Its speed is not the point: it is what Transformer
Engine's unfused path does.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .._call import as_float
from ._args import MASKS, PADDING, capability_refusal, kernel_refusal, max_seqlen, refusal
from ..tensor_cache import PerTensorCache
from .. import device_checks

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_CAPABILITY = (9, 0)  # auto takes the route where it was measured (an H200)
SEQFUSE_CUDA_HEAD_DIMS = (16, 24, 32, 64, 128)  # what seqfuse's CUDA kernels take
TOP_LEFT = {2, 3}           # mask codes of "causal" and "padding_causal"
CAUSAL = {2, 3, 4, 5}
# SDPA backends of the float32 route (CPU tests run it as it is: MATH is the CPU's)
FP32_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_constants = {}  # (what, device, *sizes) -> int32 tensor, the layout helpers' aranges


def flash_eligibility(device_type, capability, qkv_format, attn_mask_type, dropout_p, deterministic, dtype,
                      heads_q, heads_kv, head_dim, flash_enabled, *, s_q=None, s_kv=None, same_cu=False,
                      explicit_rng=False, check_capability=True, deterministic_algorithms=False, needs_grad=True):
    """(rule, reason) of the "flash" route for one call's facts: rule "" when
    the call may run torch's FlashAttention-2, else the first rule it breaks
    (in this order) and reason "rule: why".  Pure: no tensors, no device
    queries.  ``s_q``/``s_kv``: the sequence lengths of a bshd/sbhd call
    (None for thd); ``same_cu``: cu_seqlens_q and cu_seqlens_kv are the same
    tensor; ``explicit_rng``: the call passes its own rng_state with
    dropout; ``check_capability`` False skips the speed rules, capability
    and forward_only (forced "flash"); ``flash_enabled``:
    torch.backends.cuda.flash_sdp_enabled(); ``needs_grad``: autograd will
    want gradients of q, k or v.  forward_only: a call without gradients
    or dropout, at a head dim seqfuse's CUDA kernels take, stays on them
    (their forward measured faster than FlashAttention's on an H200: packed
    16k tokens, 121 / 244 / 303 TFLOP/s against 118 / 232 / 268 at ESM-2
    650M and two Llama 1B shapes, DESIGN.md)."""
    code = MASKS[attn_mask_type]
    varlen = qkv_format == "thd" or code in PADDING
    if code in TOP_LEFT:
        if varlen and not same_cu:
            return refusal("alignment", f"attn_mask_type {attn_mask_type!r} is top-left causal and cu_seqlens_q is "
                                        "not cu_seqlens_kv (FlashAttention aligns the diagonal bottom-right; they "
                                        "agree only where every sequence has as many queries as keys)")
        if not varlen and s_q != s_kv:
            return refusal("alignment", f"attn_mask_type {attn_mask_type!r} is top-left causal and s_q {s_q} != "
                                        f"s_kv {s_kv} (FlashAttention aligns the diagonal bottom-right)")
    if explicit_rng and dropout_p > 0.0:
        return refusal("rng_state", "an explicit rng_state asks for seqfuse's Philox dropout mask")
    if broken := kernel_refusal("FlashAttention", deterministic, deterministic_algorithms, dtype, heads_q, heads_kv,
                                head_dim, dtypes=FLASH_DTYPES, max_head_dim=FLASH_MAX_HEAD_DIM,
                                deterministic_why="seqfuse's deterministic backward"):
        return broken
    if not varlen and (s_q < 1 or s_kv < 1):
        return refusal("lengths", f"s_q {s_q}, s_kv {s_kv} (an empty call)")
    if device_type != "cuda":
        return refusal("device", f"{device_type} tensors (FlashAttention is CUDA only)")
    if check_capability and (broken := capability_refusal(capability, FLASH_CAPABILITY,
                                                          "torch's FlashAttention is taken in auto only on 9.0, "
                                                          "where it was measured")):
        return broken
    if check_capability and not needs_grad and dropout_p == 0.0 and head_dim in SEQFUSE_CUDA_HEAD_DIMS:
        return refusal("forward_only", "no gradient is needed and seqfuse's forward measured faster than "
                                       "FlashAttention's")
    if not flash_enabled:
        return refusal("flash_sdp_enabled", "torch.backends.cuda.flash_sdp_enabled() is False")
    return "", ""


def fp32_eligibility(device_type, qkv_format, dtype, dropout_p, *, explicit_rng=False, capturing=False):
    """(rule, reason) of the "torch_fp32" route, as ``flash_eligibility``:
    float32 CUDA calls, unless they pin seqfuse's dropout mask or are packed
    (thd, whose lengths this route reads on the host) under CUDA graph
    capture (``capturing``)."""
    if dtype != torch.float32:
        return refusal("dtype", f"dtype {dtype} (this route is for float32)")
    if device_type != "cuda":
        return refusal("device", f"{device_type} tensors (seqfuse's CPU backend takes float32 itself)")
    if explicit_rng and dropout_p > 0.0:
        return refusal("rng_state", "an explicit rng_state asks for seqfuse's Philox dropout mask, which only "
                                    "seqfuse's kernels draw, and they take float32 on the CPU only")
    if qkv_format == "thd" and capturing:
        return refusal("graph_capture", "float32 thd reads the sequence lengths on the host, which CUDA graph "
                                        "capture forbids")
    return "", ""


# ------------------------------------------------------------------ layouts
def _constant(what, device, n, step):
    """int32 [n] = arange(n) * step on device, made once per (device, n, step)
    (not kept when made under CUDA graph capture: its memory is the graph's)."""
    key = (what, device, n, step)
    t = _constants.get(key)
    if t is None:
        t = torch.arange(n, dtype=torch.int32, device=device) * step
        if device_checks.capturing(device):
            return t
        if len(_constants) > 256:
            _constants.clear()
        _constants[key] = t
    return t


def _cached(cache, cus, *extra):
    """cache(cus, *extra), computed afresh under CUDA graph capture (a
    replay reads new contents of the same cu_seqlens tensors)."""
    if device_checks.capturing(cus[0]):
        return cache.compute(cus, *extra)
    return cache(cus, *extra)


def _thd_cover(cu_q, cu_k, t_q, t_k, max_q, max_k):
    """cu_seqlens extended past the last sequence (the module docstring's
    tail): int32 cu_q, cu_k over all t_q queries and t_k keys."""
    n_q, n_k = -(-t_q // max_q), -(-t_k // max_k)
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    dev = cu_q.device
    steps_q = _constant("thd_q", dev, n_q + 1, max_q)[1:]
    steps_k = _constant("thd_k", dev, n_k + 1, max_k)[1:]
    tail_q = torch.cat(((cu_q[-1:] + steps_q).clamp_(max=t_q), cu_q.new_full((n_k,), t_q)))
    tail_k = torch.cat((cu_k[-1:].expand(n_q), (cu_k[-1:] + steps_k).clamp_(max=t_k)))
    return torch.cat((cu_q, tail_q)), torch.cat((cu_k, tail_k))


def _padded_cus(cu_q, cu_k, b, s_q, s_kv):
    """Per-row cu_seqlens [b+1] of a padded batch -> the bounds of the rows
    laid end to end, three sequences a row (its tokens; its query padding,
    no keys; no queries, its key padding): int32 (cu over the b * s_q
    queries, cu over the b * s_kv keys), 3b+1 each.  Row lengths are
    clamped to [0, s] on the device."""
    lq = cu_q.to(torch.int32).diff().clamp_(0, s_q)
    lk = lq if cu_k is cu_q and s_q == s_kv else cu_k.to(torch.int32).diff().clamp_(0, s_kv)
    rows_q, rows_k = _constant("rows", cu_q.device, b, s_q), _constant("rows", cu_q.device, b, s_kv)
    zero = _constant("zero", cu_q.device, 1, 0)
    full_q = rows_q + s_q
    cuq = torch.cat((zero, torch.stack((rows_q + lq, full_q, full_q), 1).flatten()))
    end_k = rows_k + lk
    cuk = torch.cat((zero, torch.stack((end_k, end_k, rows_k + s_kv), 1).flatten()))
    return cuq, cuk


# a model's layers pass the same cu_seqlens tensors: their layouts are made once per tensor pair
_thd_covers = PerTensorCache(lambda cus, *extra: _thd_cover(*cus, *extra))
_padded_covers = PerTensorCache(lambda cus, *extra: _padded_cus(*cus, *extra))


# ------------------------------------------------------------------ flash
def _flash_forward(*args, **kwargs):
    """torch's FlashAttention forward (the CPU tests put a stand-in here)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def run_flash(q, k, v, qkv_format, attn_mask_type, window, dropout_p, scale, cu_q, cu_k, max_q, max_k):
    """The "flash" route of one call (eligible by ``flash_eligibility``):
    the output in q's layout and dtype, differentiable through torch's
    autograd.  ``window`` is a (left, right) pair; ``max_q``/``max_k`` the
    thd max lengths or None (then read from cu_seqlens: one host sync)."""
    code = MASKS[attn_mask_type]
    causal = code in CAUSAL
    left, right = window
    kw = {"scale": scale}
    if left >= 0 or (right >= 0 and not causal):
        kw.update(window_size_left=left, window_size_right=0 if causal else right)
    if qkv_format == "thd":
        max_q = max_seqlen(cu_q, max_q, "max_seqlen_q")
        max_k = max_seqlen(cu_k, max_k, "max_seqlen_kv")
        cq, ck = _cached(_thd_covers, (cu_q, cu_k), q.shape[0], k.shape[0], max(max_q, 1), max(max_k, 1))
        return _flash_forward(q, k, v, cq, ck, max(max_q, 1), max(max_k, 1), dropout_p, causal, False, **kw)[0]
    if qkv_format == "sbhd":
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    b, s_q, h, d = q.shape
    s_kv = k.shape[1]
    if code not in PADDING:
        out = _flash_forward(q, k, v, None, None, s_q, s_kv, dropout_p, causal, False, **kw)[0]
    else:
        cq, ck = _cached(_padded_covers, (cu_q, cu_k), b, s_q, s_kv)
        q2, k2, v2 = (x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3]) for x in (q, k, v))
        out = _flash_forward(q2, k2, v2, cq, ck, s_q, s_kv, dropout_p, causal, False, **kw)[0]
        out = out.view(b, s_q, h, d)
    if qkv_format == "sbhd":
        out = out.transpose(0, 1)
    return out if out.is_contiguous() else out.contiguous()


# ------------------------------------------------------------------ float32
def _allowed(s_q, s_kv, len_q, len_k, code, window, device):
    """bool [b or 1, s_q, s_kv]: which key each query sees (seqfuse's rule,
    _args.py / csrc/attn/attn.h), with len_q/len_k int32 [b] row lengths or
    None (full rows); and bool [.., s_q, 1]: the queries that see no key."""
    left, right = window
    if code in CAUSAL:
        right = 0
    r = torch.arange(s_q, device=device)[:, None]
    c = torch.arange(s_kv, device=device)[None, :]
    if len_q is None:
        lq, lk = s_q, s_kv
        ok = torch.ones(1, s_q, s_kv, dtype=torch.bool, device=device)
    else:
        lq, lk = len_q[:, None, None].long(), len_k[:, None, None].long()
        ok = (r < lq) & (c < lk)
    off = 0 if code in TOP_LEFT else lk - lq
    if right >= 0:
        ok = ok & (c <= r + off + right)
    if left >= 0:
        ok = ok & (c >= r + off - left)
    none = ~ok.any(-1, keepdim=True)
    return ok | (none & (c == 0)), none


def _sdpa_fp32(q, k, v, code, window, dropout_p, scale, len_q, len_k, backends):
    """q [b, h, s_q, d], k/v [b, hk, s_kv, d] float32 -> out [b, h, s_q, d],
    exact under seqfuse's mask rule (see the module docstring)."""
    s_q, s_kv = q.shape[2], k.shape[2]
    if s_q == 0:
        return q.new_zeros(q.shape)
    if s_kv == 0:  # nothing to see: 0 (and a 0 gradient to q)
        return torch.nan_to_num(q * 0.0, nan=0.0)
    if q.shape[1] != k.shape[1]:
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    need_mask = len_q is not None or window != (-1, -1) or (code in (4, 5) and s_q != s_kv)
    with sdpa_kernel(backends), torch.autocast(q.device.type, enabled=False):
        if not need_mask:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=code in CAUSAL,
                                                  scale=scale)
        ok, none = _allowed(s_q, s_kv, len_q, len_k, code, window, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ok[:, None], dropout_p=dropout_p, scale=scale)
    return out.masked_fill(none[:, None], 0.0)


def run_fp32(q, k, v, qkv_format, attn_mask_type, window, dropout_p, scale, cu_q, cu_k, deterministic):
    """The "torch_fp32" route of one call: the output in q's layout."""
    code = MASKS[attn_mask_type]
    if qkv_format == "thd" and code not in PADDING:
        code = {0: 1, 2: 3, 4: 5}[code]
    backends = [SDPBackend.MATH] if deterministic else FP32_SDPA_BACKENDS
    if qkv_format == "thd":
        bq, bk = cu_q.tolist(), cu_k.tolist()  # the one host read (the route's rule keeps it out of capture)
        pieces = []
        for i in range(len(bq) - 1):
            qi, ki, vi = (x[a:e].transpose(0, 1)[None] for x, a, e in
                          ((q, bq[i], bq[i + 1]), (k, bk[i], bk[i + 1]), (v, bk[i], bk[i + 1])))
            pieces.append(_sdpa_fp32(qi, ki, vi, code, window, dropout_p, scale, None, None,
                                     backends)[0].transpose(0, 1))
        pieces.append(q.new_zeros((q.shape[0] - bq[-1],) + tuple(q.shape[1:])))  # the tail: 0
        return torch.cat(pieces)
    to = (0, 2, 1, 3) if qkv_format == "bshd" else (1, 2, 0, 3)
    len_q = len_k = None
    if code in PADDING:
        len_q = cu_q.to(torch.int32).diff().clamp(0, q.shape[to[2]])
        len_k = len_q if cu_k is cu_q and q.shape[to[2]] == k.shape[to[2]] else \
            cu_k.to(torch.int32).diff().clamp(0, k.shape[to[2]])
    out = _sdpa_fp32(q.permute(to), k.permute(to), v.permute(to), code, window, dropout_p, scale, len_q, len_k,
                     backends)
    out = out.permute((0, 2, 1, 3) if qkv_format == "bshd" else (2, 0, 1, 3))
    return out if out.is_contiguous() else out.contiguous()


def softmax_scale_of(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else \
        as_float("attention", "softmax_scale", softmax_scale)
