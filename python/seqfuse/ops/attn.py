"""Fused attention (csrc/attn/): softmax(scale * Q K^T + mask) V without the
attention matrix, for padded (bshd, sbhd) and packed (thd) batches.

``attention`` is the autograd-aware entry; ``attention_fwd`` and
``attention_bwd`` are the two halves, with the log-sum-exp the forward saves
for the backward.  Masks and layouts are spelled as in Transformer Engine:

- ``qkv_format``: "bshd" [b, s, h, d], "sbhd" [s, b, h, d], "thd" [t, h, d]
  (sequences packed back to back, delimited by ``cu_seqlens_q/kv``, int32
  [b+1] cumulative lengths).
- ``attn_mask_type``: "no_mask", "padding", "causal", "padding_causal"
  (top-left aligned diagonal, as TE's "causal" and torch's ``is_causal``),
  "causal_bottom_right", "padding_causal_bottom_right" (diagonal through the
  last query and the last key, as flash-attn 2.1+).  In thd every mask is a
  padding mask (sequences never see each other).
- ``window_size`` = (left, right): query r sees keys r+off-left .. r+off+right,
  -1 for unbounded; (-1, -1) or None means no window.  off is 0 for the
  top-left causal masks and sk - sq otherwise (as TE).
- GQA/MQA: k and v may have fewer heads than q (a divisor of its count).

CUDA: float16/bfloat16, head dims 16, 24, 32, 64 and 128.  CPU: the reference in double
precision, any head dim, float32 too.

Dropout (``dropout_p`` in [0, 1), as flash-attn and TE's ``attention_dropout``):
P = softmax(S) is multiplied by keep / (1 - p) before P V; the mask is never
stored, both halves regenerate it from Philox4x32-10 keyed by ``rng_state =
(seed, offset)`` and each element's (sequence, head, query, key) coordinates
(csrc/attn/attn_philox.h), so the CPU and CUDA backends draw the same mask.
Without an explicit ``rng_state`` it comes from torch's default generator of
q's device: on CUDA (seed, offset) = (initial_seed(), get_offset()) and the
generator's offset advances by the call's use, batch * heads rounded up to a
multiple of 4, as flash-attn's philox_args do, so ``torch.manual_seed`` makes
runs repeatable; on the CPU (whose generator has no offset) a fresh seed is
drawn with offset 0.  Drawing reads and sets the generator's offset on the
host, so a forward with dropout and without ``rng_state`` is NOT capturable in
a CUDA graph (pass ``rng_state`` from outside the graph, or use dropout_p=0).
The autograd function saves the pair for its backward.  On CUDA dropout runs
in the sm80 forward and backward kernels (on Hopper a dropout call leaves the
wgmma kernels for them, logged once), checked on an H200 against the CPU
backend's identical Philox mask.

On Hopper the forward has two kernels: the wgmma one (``attention_fwd_kernel`` 90,
csrc/attn/attn_fwd_sm90_cuda.cu) and the mma.sync one (80).  The choice is
``SEQFUSE_ATTN_FWD_KERNEL=sm90|sm80`` or ``set_attention_fwd_kernel``; the wgmma kernel is
the default for head dims 64 and 128 (confirmed on an H200).  The backward has the
same pair (``attention_bwd_kernel``, csrc/attn/attn_bwd_sm90_cuda.cu), chosen by
``SEQFUSE_ATTN_BWD_KERNEL=sm90|sm80`` or ``set_attention_bwd_kernel``; the wgmma
backward is the default for head dims 64 and 128 (confirmed on an H200), and
deterministic calls always take sm80 (the wgmma backward adds dQ with atomics).  Wherever a Hopper device runs
the slower kernel, the reason is logged once (logger "seqfuse").

Backend choice (``attention`` only; ``attention_fwd`` and ``attention_bwd``,
the explicit halves that return and take the lse, always run seqfuse's
kernels).  Two backends: "seqfuse" (the kernels above) and "cudnn" (cuDNN
fused attention through ``torch.nn.functional.scaled_dot_product_attention``
under ``sdpa_kernel([SDPBackend.CUDNN_ATTENTION])``, torch's autograd doing
the backward; measured on an H200 at ESM-2 650M's shape, 16 x 1024 tokens,
20 heads of dim 64, bf16, no mask: 23.5 ms of attention per training step
against 57 ms for seqfuse's kernels).  The choice is ``SEQFUSE_ATTN_BACKEND=auto|seqfuse|cudnn``
(read once, at the first attention call; unset or empty means auto; any other
value is a ValueError naming the variable, raised there) or
``set_attention_backend(name)``, which overrides it for the process.
``attention_backend(q, k, v, ...)`` returns (name, reason): what a call
would take and why.

- "auto" (the default) takes cuDNN only where every rule holds, checked in
  this order (the reason names the first one broken, as "rule: why"):
  qkv_format "bshd" or "sbhd" (``qkv_format``); no padding mask and no
  cu_seqlens (``padding``); attn_mask_type "no_mask", "causal" or
  "causal_bottom_right" (``attn_mask_type``); s_q == s_kv (``lengths``:
  SDPA's is_causal is top-left, which equals bottom-right only at equal
  lengths), at least 2, batch and heads at most 65535 (torch's cuDNN
  limits, also ``lengths``); window_size None or (-1, -1), or (-1, 0) with a
  causal mask (``window``); dropout_p == 0 (``dropout``: seqfuse's dropout
  has its own Philox mask contract); not deterministic and no
  ``torch.use_deterministic_algorithms(True)`` (``deterministic``: torch
  does not guarantee a deterministic cuDNN backward, and refuses cuDNN
  then); float16 or bfloat16 (``dtype``); as many k/v heads as q heads
  (``gqa``); head dim a multiple of 8, at most 128 (``head_dim``); CUDA
  tensors (``device``); compute capability exactly 9.0, where it was
  measured faster (``capability``); and
  ``torch.backends.cuda.cudnn_sdp_enabled()`` (``cudnn_sdp_enabled``).
  q, k and v that disagree (dtype, device, batch, head dim, k vs v shape,
  not 4-D) run seqfuse's kernels, whose checks report them (``inputs``).
  ``cudnn_eligibility`` is the rule check as a pure function of the call's
  facts; its answer is cached per call key, the capability per device.
- "cudnn": eligible calls take cuDNN, on any compute capability (the
  capability rule is about speed and is skipped); any other broken rule is a
  NotImplementedError naming it (no silent fallback; disagreeing inputs get
  seqfuse's own errors), and torch's errors are raised as they come.
- "seqfuse": always seqfuse's kernels.

The first time auto sends a kind of call (layout, mask, head dim, dtype) to
cuDNN, logger "seqfuse" says so once at INFO.  If torch raises a
RuntimeError from the cuDNN forward in auto (e.g. "No available kernel"; an
out-of-memory error, or a CUDA error, which leaves the context unusable, is
raised as it is), a WARNING names the error, the call runs seqfuse's
kernels, and every later call of the same shapes, strides, dtype, mask and
device skips cuDNN (until ``set_attention_backend``); other shapes still try
it.  An error in cuDNN's backward comes from torch's autograd and is not
caught.
Layouts: SDPA takes [b, h, s, d]; q, k and v go in as permuted views (bshd
``permute(0, 2, 1, 3)``, sbhd ``permute(1, 2, 0, 3)``, copied only when the
head dim is not unit-stride), with ``scale=softmax_scale`` (1/sqrt(d) when
None) and ``is_causal``; the output is permuted back to the caller's layout
and copied only when that view is not contiguous.  Its shape and dtype are
the seqfuse path's: SDPA runs with torch.autocast off (seqfuse's kernels
take no autocast cast either).  ``sdpa_kernel`` sets torch's process-wide
SDPA backend flags for the call: another thread calling SDPA at that moment
sees them.
"""
import logging
import math
import os
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _C
from ._call import as_float, as_int, stream_for

FORMATS = {"bshd": 0, "sbhd": 1, "thd": 2}
MASKS = {
    "no_mask": 0,
    "padding": 1,
    "causal": 2,
    "padding_causal": 3,
    "padding,causal": 3,
    "causal,padding": 3,
    "causal_bottom_right": 4,
    "padding_causal_bottom_right": 5,
}
_PADDING = {1, 3, 5}

_log = logging.getLogger("seqfuse")
_fwd_reasons_logged = set()
_bwd_reasons_logged = set()
# (head dim, device index[, deterministic]) keys whose kernel choice was already
# looked at since the choice last changed: each direction asks C once per key, not per call
_fwd_kernel_checked = set()
_bwd_kernel_checked = set()


def set_attention_fwd_kernel(arch):
    """Forward kernel on Hopper: 90 (wgmma) or 80 (mma.sync), for the process."""
    _C.attn_set_fwd_kernel(arch)
    _fwd_kernel_checked.clear()


def set_attention_bwd_kernel(arch):
    """Backward kernel on Hopper: 90 (wgmma) or 80 (mma.sync), for the process."""
    _C.attn_set_bwd_kernel(arch)
    _bwd_kernel_checked.clear()


def _device_index(device):
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    return 0 if index is None else index


def attention_fwd_kernel(head_dim, device=None, dropout=False):
    """(arch, reason): the CUDA forward kernel a call with this head dim (and
    dropout or not) takes on ``device`` (default: the current CUDA device);
    reason is "" when it is 90 or when the device is not Hopper."""
    return _C.attn_fwd_kernel_for(head_dim, _device_index(device), int(bool(dropout)))


def attention_bwd_kernel(head_dim, device=None, deterministic=False, dropout=False):
    """(arch, reason): the CUDA backward kernel a call with this head dim,
    deterministic flag and dropout takes on ``device``, as ``attention_fwd_kernel``."""
    return _C.attn_bwd_kernel_for(head_dim, _device_index(device), bool(deterministic), int(bool(dropout)))


def _note_kernel(direction, key, kernel_for, checked, logged):
    """Log once per reason when a Hopper device gets an sm80 kernel."""
    if key in checked:
        return
    checked.add(key)
    arch, why = kernel_for(*key)
    if arch != 90 and why and why not in logged:
        logged.add(why)
        # an explicit choice (or the default) is news; anything else is a missed fast path
        level = logging.INFO if why.startswith(("sm80 kernel chosen", "sm80 backward chosen")) else logging.WARNING
        _log.log(level, "seqfuse attention %s: the sm80 (mma.sync) kernel runs on this Hopper GPU: %s",
                 direction, why)


def _note_fwd_kernel(q, dropout=False):
    _note_kernel("forward", (q.shape[-1], q.device.index or 0, int(bool(dropout))), _C.attn_fwd_kernel_for,
                 _fwd_kernel_checked, _fwd_reasons_logged)


def _note_bwd_kernel(q, deterministic, dropout=False):
    _note_kernel("backward", (q.shape[-1], q.device.index or 0, bool(deterministic), int(bool(dropout))),
                 _C.attn_bwd_kernel_for, _bwd_kernel_checked, _bwd_reasons_logged)


def _mask_code(attn_mask_type, qkv_format):
    if attn_mask_type not in MASKS:
        raise ValueError(f"attention: attn_mask_type must be one of {sorted(MASKS)}, got {attn_mask_type!r}")
    code = MASKS[attn_mask_type]
    if qkv_format == "thd" and code not in _PADDING:
        code = {0: 1, 2: 3, 4: 5}[code]  # packed sequences are always delimited
    return code


def _window(window_size):
    if window_size is None:
        return -1, -1
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"attention: window_size must be (left, right), got {window_size!r}")
    left, right = (as_int("attention", "window_size", w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"attention: window_size entries must be -1 or >= 0, got {window_size!r}")
    return left, right


def _max_seqlen(cu, given, name):
    if given is not None:
        return as_int("attention", name, given, 0)
    if cu.numel() < 2:
        return 0
    return int((cu[1:] - cu[:-1]).max().item())  # one host sync, as TE does


def _num_sequences(q, qkv_format, cu_seqlens_q):
    if qkv_format == "thd":
        return max(int(cu_seqlens_q.numel()) - 1, 0) if cu_seqlens_q is not None else 0
    return q.shape[0] if qkv_format == "bshd" else q.shape[1]


def dropout_rng_state(q, qkv_format="bshd", cu_seqlens_q=None):
    """(seed, offset) for one attention call with dropout on q's device,
    drawn from torch's default generator (see the module docstring); the
    CUDA generator's offset advances by the call's use."""
    used = _num_sequences(q, qkv_format, cu_seqlens_q) * q.shape[-2]
    if q.is_cuda:
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        seed, offset = gen.initial_seed(), gen.get_offset()
        gen.set_offset(offset + (used + 3) // 4 * 4)  # torch keeps offsets multiples of 4
        return seed, offset
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item()), 0


def _rng_cfg(dropout_p, rng_state):
    """The (dropout_p, seed, offset) tail of the C config."""
    p = as_float("attention", "dropout_p", dropout_p)
    if p == 0.0 or rng_state is None:
        return (p, 0, 0)
    if not isinstance(rng_state, (tuple, list)) or len(rng_state) != 2:
        raise TypeError(f"attention: argument 'rng_state' must be a (seed, offset) pair, got {rng_state!r}")
    seed, offset = (as_int("attention", "rng_state", x) if not isinstance(x, int) else x for x in rng_state)
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"attention: rng_state must be two integers in [0, 2**64), got {rng_state!r}")
    return (p, seed, offset)


def _wants_rng(dropout_p):
    p = as_float("attention", "dropout_p", dropout_p)
    return 0.0 < p < 1.0  # anything else is 0 (no mask) or an error C reports naming dropout_p


def _last_dim_contiguous(x):
    """x as the kernel reads it: unit stride in the head dim and, on CUDA,
    16-byte aligned rows (the kernel loads 16-byte vectors).  Anything else
    (an expanded or sliced gradient, say) is copied once, here."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return x.contiguous()
    if x.is_cuda and (x.data_ptr() % 16 or any(st % 8 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)):
        return x.contiguous()
    return x


def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"attention: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if name != "lse" and x.dim() < 3:  # (lse is [h, t] in thd; C checks its shape)
        raise ValueError(f"attention: argument '{name}' must be 3-D (thd) or 4-D (bshd, sbhd), got "
                         f"shape {tuple(x.shape)}")


def _config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
            max_seqlen_kv, window_size, softmax_scale, deterministic, dropout_p=0.0, rng_state=None):
    if qkv_format not in FORMATS:
        raise ValueError(f"attention: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    mask = _mask_code(attn_mask_type, qkv_format)
    left, right = _window(window_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if qkv_format == "thd":
        if cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError("attention: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv")
        msq = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        msk = _max_seqlen(cu_seqlens_kv, max_seqlen_kv, "max_seqlen_kv")
    else:
        s_dim = 1 if qkv_format == "bshd" else 0
        msq, msk = q.shape[s_dim], k.shape[s_dim]
        if mask not in _PADDING:
            cu_seqlens_q = cu_seqlens_kv = None  # full rows: lengths not needed
        elif cu_seqlens_q is None or cu_seqlens_kv is None:
            raise ValueError(f"attention: attn_mask_type {attn_mask_type!r} in {qkv_format} needs "
                             "cu_seqlens_q and cu_seqlens_kv (or an attention_mask in the module)")
    cfg = (FORMATS[qkv_format], mask, left, right, as_float("attention", "softmax_scale", softmax_scale), msq, msk,
           int(bool(deterministic))) + _rng_cfg(dropout_p, rng_state)
    return cfg, cu_seqlens_q, cu_seqlens_kv


def _lse_shape(q, qkv_format, cfg):
    if qkv_format == "thd":
        return (q.shape[1], q.shape[0])
    b = q.shape[0] if qkv_format == "bshd" else q.shape[1]
    return (b, q.shape[-2], cfg[5])


def attention_fwd(q, k, v, *, qkv_format="bshd", attn_mask_type="no_mask", cu_seqlens_q=None,
                  cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None,
                  softmax_scale=None, dropout_p=0.0, rng_state=None, out=None, lse=None):
    """Forward only: returns (out, lse).  out has q's shape and dtype; lse is
    float32 [b, h, s_q] (bshd/sbhd) or [h, t] (thd), +inf on rows that see
    no key (the undropped log-sum-exp).  With ``dropout_p`` > 0 the mask comes
    from ``rng_state`` = (seed, offset), drawn by :func:`dropout_rng_state`
    when None (pass the same pair to :func:`attention_bwd`).
    ``out``/``lse`` may be given to write into.  Always seqfuse's kernels
    (the backend choice applies to ``attention`` only)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    q, k, v = (_last_dim_contiguous(x.detach()) for x in (q, k, v))
    if rng_state is None and _wants_rng(dropout_p):
        rng_state = dropout_rng_state(q, qkv_format, cu_seqlens_q)
    cfg, cu_q, cu_k = _config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                              max_seqlen_q, max_seqlen_kv, window_size, softmax_scale, False,
                              dropout_p, rng_state)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(_lse_shape(q, qkv_format, cfg), dtype=torch.float32, device=q.device)
    if q.is_cuda:
        _note_fwd_kernel(q, cfg[8] > 0.0)
    _C.attn_fwd(q, k, v, cu_q, cu_k, out, lse, cfg, stream_for(q))
    return out, lse


def attention_bwd(dout, q, k, v, out, lse, *, qkv_format="bshd", attn_mask_type="no_mask",
                  cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None,
                  window_size=None, softmax_scale=None, deterministic=False, dropout_p=0.0,
                  rng_state=None, dq=None, dk=None, dv=None):
    """Backward: returns (dq, dk, dv) in the shapes of q, k, v (given
    tensors are written into).  With ``deterministic`` the CUDA kernel
    computes dQ without atomics (bitwise reproducible, about 40 % more
    backward math).  With ``dropout_p`` > 0, ``rng_state`` must be the
    forward's (seed, offset).  Always seqfuse's kernels (the backend choice
    applies to ``attention`` only)."""
    for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)):
        _check_tensor(name, x)
    if rng_state is None and _wants_rng(dropout_p):
        raise ValueError("attention_bwd: dropout_p > 0 needs the forward's rng_state (seed, offset)")
    dout, q, k, v, out = (_last_dim_contiguous(x.detach()) for x in (dout, q, k, v, out))
    cfg, cu_q, cu_k = _config(q, k, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv,
                              max_seqlen_q, max_seqlen_kv, window_size, softmax_scale, deterministic,
                              dropout_p, rng_state)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if dk is None else dk
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if dv is None else dv
    dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    if q.is_cuda:
        _note_bwd_kernel(q, deterministic, cfg[8] > 0.0)
    _C.attn_bwd(q, k, v, out, dout, lse, cu_q, cu_k, dq, dk, dv, dq_accum, delta, cfg, stream_for(q))
    return dq, dk, dv


# ------------------------------------------------------------ padding masks
class PerTensorCache:
    """The results last computed from a few tensors (plus an extra key), each
    reused while those very tensor objects are alive and unmodified (same
    ``_version``).  ``cache(t, *extra)``: ``t`` is a tensor or a tuple of
    tensors (matched by identity), ``extra`` hashable values compared with
    ``==``.  A few entries, not one: models that alternate sliding-window and
    full-attention layers hand their layers two masks in turn.  Never used
    under CUDA graph capture (callers recompute then: a replay reads new
    contents of the same tensors)."""

    SIZE = 4

    def __init__(self, compute):
        self.compute = compute
        self.entries = []  # (weakrefs, versions, extra, result), newest first

    @staticmethod
    def _alive(refs, versions):
        ts = tuple(r() for r in refs)
        return ts if all(t is not None and t._version == v for t, v in zip(ts, versions)) else None

    def __call__(self, t, *extra):
        ts = t if isinstance(t, tuple) else (t,)
        for refs, versions, key, result in self.entries:
            alive = self._alive(refs, versions)
            if alive is not None and len(alive) == len(ts) and all(a is b for a, b in zip(alive, ts)) \
                    and key == extra:
                return result
        result = self.compute(t, *extra)
        # keep the entries that can still match: not a dead tensor's, not an older version's
        live = [e for e in self.entries if self._alive(e[0], e[1]) is not None]
        self.entries = [(tuple(weakref.ref(x) for x in ts), tuple(x._version for x in ts), extra, result)] + \
            live[:self.SIZE - 1]
        return result


class PaddingLayout(NamedTuple):
    """How a padded batch runs in the kernel (see ``padding_layout``)."""
    qkv_format: str       # "bshd": every row right-padded, the kernel's padded layout; "thd": rows end to end
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    cu_seqlens_kv: torch.Tensor
    max_seqlen_kv: int
    poison: object        # None, or float32 [b]: 0, NaN for a row that breaks the rule (CUDA graph capture)
    padded: object        # whether any position is padding (None: not read, under CUDA graph capture)


def _runs(keep):
    """(first, length, bad) of a bool [b, s] keep-mask: each row's first
    token (0 when it has none), its number of tokens, and where the row
    differs from the one run [first, first + length) (bool [b, s])."""
    length = keep.sum(1, dtype=torch.int32)
    first = torch.where(length > 0, keep.to(torch.int32).argmax(1).to(torch.int32), 0)
    ar = torch.arange(keep.shape[1], device=keep.device, dtype=torch.int32)
    run = (ar >= first[:, None]) & (ar < (first + length)[:, None])
    return first, length, run != keep


def padding_layout(keep_kv, keep_q=None, s_q=None, *, who="attention", names=("attention_mask",) * 2,
                   hole_error=ValueError):
    """The layout of a key-padded batch for the fused kernel, exact for any
    padding where each row is ONE run of tokens: right padding (tokens
    then padding), left padding (padding then tokens), or both.

    ``keep_kv``: bool [b, s_kv], True = token (a real key).  ``keep_q``: bool
    [b, s_q] for the queries, or None: the queries are the last ``s_q``
    (default s_kv) key positions (self-attention; s_q < s_kv is a key cache).
    Causal masks align within each row's runs of tokens (top-left: first
    query with first key; bottom-right: last with last), as for cu_seqlens.

    Every row right-padded: "bshd" with the rows' lengths as cu_seqlens (the
    kernel's padded layout).  Otherwise "thd" over the rows laid end to end
    (the caller views q [b, s_q, h, d] as [b * s_q, h, d], k and v alike):
    each row becomes five sequences with separate q and kv extents, (leading
    query padding, no keys), (no queries, leading key padding), (query
    tokens, key tokens), (trailing query padding, no keys), (no queries,
    trailing key padding), so tokens see only tokens and a padding position
    sees no key: its output (and every gradient through it) is 0, as the
    padded layout's padding rows, and a row without tokens is all 0 (torch's
    SDPA gives NaN there).

    A row that is not one run (a hole) raises ``hole_error`` naming
    ``names`` (q's, kv's), the row and the position.  Cost: the lengths,
    offsets and the check run on the mask's device; their few numbers come
    back in ONE host read (a sync on CUDA; on an H200, 16 x 1024 mask: about
    0.45 ms of host time, small kernels and the read; a cache hit in
    DotProductAttention about 5 us).  Callers cache the result per mask
    tensor (``PerTensorCache``) so a model's layers read it once.
    Under CUDA graph capture nothing is read: the layout is "thd" with the
    padded lengths as the max lengths (exact for every one-run row) and
    ``poison`` is NaN for rows with a hole (the caller adds it to the
    output: such a row comes out NaN, never silently wrong)."""
    b, s_kv = keep_kv.shape
    dev = keep_kv.device
    first_k, len_k, bad_k = _runs(keep_kv)
    s_q = s_kv if keep_q is None and s_q is None else s_q
    same = keep_q is None and s_q == s_kv  # self-attention: the queries' runs are the keys'
    if same:
        first_q, len_q, bad_q = first_k, len_k, None
    elif keep_q is None:
        shift = s_kv - s_q
        first_q = (first_k - shift).clamp(0, s_q)
        len_q = (first_k + len_k - shift).clamp(0, s_q) - first_q
        bad_q = None
    else:
        s_q = keep_q.shape[1]
        first_q, len_q, bad_q = _runs(keep_q)
    row = torch.arange(b, device=dev, dtype=torch.int32)[:, None]
    end_q, end_k = first_q + len_q, first_k + len_k
    fq, fk = first_q[:, None], first_k[:, None]
    zero = torch.zeros(1, dtype=torch.int32, device=dev)
    k_ends = torch.cat((torch.zeros_like(fk), fk, end_k[:, None], end_k[:, None], torch.full_like(fk, s_kv)), 1)
    cu_k = torch.cat((zero, (k_ends + row * s_kv).flatten()))
    q_ends = torch.cat((fq, fq, end_q[:, None], torch.full_like(fq, s_q), torch.full_like(fq, s_q)), 1)
    cu_q = torch.cat((zero, (q_ends + row * s_q).flatten()))
    bads = [x for x in (bad_q, bad_k) if x is not None]
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        poison = torch.zeros(b, dtype=torch.float32, device=dev)
        for bad in bads:
            poison = poison.masked_fill(bad.any(1), float("nan"))
        return PaddingLayout("thd", cu_q, s_q, cu_k, s_kv, poison, None)
    if b == 0 or s_q == 0 or s_kv == 0:
        return PaddingLayout("thd", cu_q, 0, cu_k, 0, None, False)
    # the numbers the host needs, int32 on the device, then one read
    stats = [first_k.max(), (cu_k.diff().max()), (len_k != s_kv).any().to(torch.int32)]
    if not same:
        stats += [first_q.max(), cu_q.diff().max(), (len_q != s_q).any().to(torch.int32)]
    for bad in (bad_q, bad_k):
        if bad is not None:
            stats += list(bad.flatten().to(torch.int32).max(0))  # (any, first index: max's first maximum)
    vals = torch.stack([x.to(torch.int32) for x in stats]).tolist()  # the one host read
    if same:
        left, max_k, padded = vals[:3]
        max_q, rest = max_k, vals[3:]
    else:
        left, max_k, padded = vals[0] or vals[3], vals[1], vals[2] or vals[5]
        max_q, rest = vals[4], vals[6:]
    holes = []
    for bad in (bad_q, bad_k):
        holes.append(rest[:2] if bad is not None else (0, 0))
        rest = rest[2:] if bad is not None else rest
    for i, (any_bad, at) in enumerate(holes):
        if any_bad:
            width = s_q if i == 0 else s_kv
            raise hole_error(f"{who}: {names[i]}: each row's padding must be one contiguous run at the end (right "
                             "padding) or the start (left padding) of the row, or both, around one run of "
                             f"tokens; row {at // width} has a hole at position {at % width} (padding between "
                             "tokens; holes are not supported)")
    if not left:
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=dev)
        torch.cumsum(len_k, 0, out=cu_k[1:])
        if same:
            cu_q = cu_k
        else:
            cu_q = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            torch.cumsum(len_q, 0, out=cu_q[1:])
        return PaddingLayout("bshd", cu_q, s_q, cu_k, s_kv, None, bool(padded))
    return PaddingLayout("thd", cu_q, max_q, cu_k, max_k, None, True)


# ------------------------------------------------------------ backend choice
BACKENDS = ("auto", "seqfuse", "cudnn")
_ENV = "SEQFUSE_ATTN_BACKEND"
_backend = None  # the process's choice; None until the first call reads the environment
# what SDPA may run on the cudnn route (CPU tests point it at MATH to run the route there)
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION]
_CUDNN_CAPABILITY = (9, 0)
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
_CUDNN_MASKS = ("no_mask", "causal", "causal_bottom_right")
_CUDNN_MAX_DIM = 65535  # torch's cuDNN attention takes batch and heads up to this
_TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}
_FROM_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}
_choices = {}         # call key -> (backend, rule, reason); emptied past _MAX_CHOICES keys
_MAX_CHOICES = 4096
_capabilities = {}    # CUDA device index -> (major, minor)
_cudnn_failed = {}    # (dtype, head dim, causal, device) -> torch's error, in auto
_cudnn_logged = set()  # reasons already logged at INFO


def _read_backend():
    """The process's backend: set_attention_backend's, else the environment's
    (read once; a bad value raises here, at every call, until it is fixed)."""
    global _backend
    if _backend is None:
        raw = os.environ.get(_ENV, "")
        value = raw.strip() or "auto"
        if value not in BACKENDS:
            raise ValueError(f"{_ENV} must be one of 'auto', 'seqfuse', 'cudnn', got {raw!r}")
        _backend = value
    return _backend


def set_attention_backend(name):
    """Attention backend of ``attention`` for the process: "auto", "seqfuse"
    or "cudnn" (overrides SEQFUSE_ATTN_BACKEND; see the module docstring).
    Also forgets the shape classes whose cuDNN call failed in auto."""
    global _backend
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"set_attention_backend: argument 'name' must be one of 'auto', 'seqfuse', 'cudnn', "
                         f"got {name!r}")
    _backend = name
    _choices.clear()
    _cudnn_failed.clear()


def cudnn_eligibility(device_type, capability, qkv_format, attn_mask_type, s_q, s_kv, window_size, dropout_p,
                      deterministic, dtype, heads_q, heads_kv, head_dim, cudnn_enabled, *,
                      cu_seqlens=False, check_capability=True, batch=1, deterministic_algorithms=False):
    """(rule, reason) for one call's facts: rule is "" when the call may run
    cuDNN fused attention, else the first rule it breaks (the module
    docstring's order), and reason says "rule: why".  Pure: no tensors, no
    device queries.  ``capability`` is (major, minor) or None; ``window_size``
    None or (left, right); ``cu_seqlens``: whether cu_seqlens were given;
    ``check_capability`` False skips the capability rule (forced "cudnn");
    ``deterministic_algorithms``: torch.use_deterministic_algorithms is on
    (not warn-only), under which torch refuses cuDNN attention."""
    def no(rule, why):
        return rule, f"{rule}: {why}"
    if qkv_format not in _TO_BHSD:
        return no("qkv_format", f"qkv_format {qkv_format!r}; the cuDNN route takes padded bshd or sbhd only")
    if attn_mask_type in MASKS and MASKS[attn_mask_type] in _PADDING:
        return no("padding", f"attn_mask_type {attn_mask_type!r} is a padding mask")
    if cu_seqlens:
        return no("padding", "cu_seqlens given (padded sequences)")
    if attn_mask_type not in _CUDNN_MASKS:
        return no("attn_mask_type", f"attn_mask_type {attn_mask_type!r} is not one of {list(_CUDNN_MASKS)}")
    causal = attn_mask_type != "no_mask"
    if s_q != s_kv:
        return no("lengths", f"s_q {s_q} != s_kv {s_kv} (SDPA's is_causal is top-left; only equal lengths "
                             "are taken)")
    if s_kv < 2:
        return no("lengths", f"sequence length {s_kv} (torch's cuDNN attention takes key lengths >= 2)")
    if batch > _CUDNN_MAX_DIM or heads_q > _CUDNN_MAX_DIM:
        return no("lengths", f"batch {batch} or {heads_q} heads above {_CUDNN_MAX_DIM} (torch's cuDNN limit)")
    window = (-1, -1) if window_size is None else tuple(window_size)
    if window != (-1, -1) and not (causal and window == (-1, 0)):
        return no("window", f"window_size {window_size!r} (only None, (-1, -1), or (-1, 0) with a causal mask)")
    if dropout_p != 0.0:
        return no("dropout", f"dropout_p {dropout_p} > 0 (seqfuse's dropout has its own Philox mask contract)")
    if deterministic:
        return no("deterministic", "deterministic=True (torch does not guarantee a deterministic cuDNN backward)")
    if deterministic_algorithms:
        return no("deterministic", "torch.use_deterministic_algorithms(True) (torch refuses cuDNN attention)")
    if dtype not in _CUDNN_DTYPES:
        return no("dtype", f"dtype {dtype} (cuDNN takes float16 and bfloat16)")
    if heads_q != heads_kv:
        return no("gqa", f"{heads_q} q heads and {heads_kv} k/v heads (GQA/MQA)")
    if head_dim % 8 or not 0 < head_dim <= 128:
        return no("head_dim", f"head dim {head_dim} (a multiple of 8, at most 128)")
    if device_type != "cuda":
        return no("device", f"{device_type} tensors (cuDNN fused attention is CUDA only)")
    if check_capability and tuple(capability or ()) != _CUDNN_CAPABILITY:
        cap = "unknown" if capability is None else "%d.%d" % tuple(capability)
        return no("capability", f"compute capability {cap} (cuDNN attention is taken in auto only on 9.0, "
                                "where it was measured faster)")
    if not cudnn_enabled:
        return no("cudnn_sdp_enabled", "torch.backends.cuda.cudnn_sdp_enabled() is False")
    return "", ""


def _device_facts(device):
    """(device type, capability or None), the capability asked once per device."""
    if device.type != "cuda":
        return device.type, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capabilities.get(index)
    if cap is None:
        cap = _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return "cuda", cap


def _decide(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_seqlens,
            cudnn_enabled, deterministic_algorithms):
    """(backend, rule, reason) of one call key; bad argument values raise as
    the seqfuse path would."""
    if qkv_format not in FORMATS:
        raise ValueError(f"attention: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    _mask_code(attn_mask_type, qkv_format)
    window = _window(window_size)
    p = as_float("attention", "dropout_p", dropout_p)
    if qkv_format in _TO_BHSD:
        bad = None
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            bad = "q, k and v are not all 4-D"
        elif not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            bad = "q, k and v differ in dtype or device"
        elif k.shape != v.shape or q.shape[-1] != k.shape[-1]:
            bad = "k and v differ in shape, or q and k in head dim"
        elif q.shape[qkv_format == "sbhd"] != k.shape[qkv_format == "sbhd"]:
            bad = "q and k differ in batch size"
        if bad is not None:
            return "seqfuse", "inputs", f"inputs: {bad} (seqfuse's checks report it)"
        s_dim = 1 if qkv_format == "bshd" else 0
        s_q, s_kv, batch = q.shape[s_dim], k.shape[s_dim], q.shape[1 - s_dim]
    else:
        s_q = s_kv = batch = None
    device_type, capability = _device_facts(q.device)
    rule, reason = cudnn_eligibility(device_type, capability, qkv_format, attn_mask_type, s_q, s_kv, window, p,
                                     bool(deterministic), q.dtype, q.shape[-2], k.shape[-2], q.shape[-1],
                                     cudnn_enabled, cu_seqlens=cu_seqlens, check_capability=mode == "auto",
                                     batch=batch, deterministic_algorithms=deterministic_algorithms)
    if rule:
        return "seqfuse", rule, reason
    return "cudnn", "", (f"{qkv_format} {attn_mask_type} d={q.shape[-1]} {str(q.dtype).replace('torch.', '')} "
                         "runs cuDNN fused attention through torch SDPA")


def _choose(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_seqlens_q,
            cu_seqlens_kv):
    """(backend, rule, reason) of one call under ``mode``; forced "cudnn"
    raises NotImplementedError where a rule (other than "inputs") is broken."""
    if mode == "seqfuse":
        return "seqfuse", "", f"backend 'seqfuse' chosen ({_ENV} or set_attention_backend)"
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    det_algos = torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()
    cu = cu_seqlens_q is not None or cu_seqlens_kv is not None
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    key = (mode, q.device, qkv_format, attn_mask_type, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
           window, dropout_p, bool(deterministic), cu, enabled, det_algos)
    try:
        hit = _choices.get(key)
    except TypeError:  # an unhashable argument: _decide names it
        hit, key = None, None
    if hit is None:
        hit = _decide(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu,
                      enabled, det_algos)
        if key is not None:
            if len(_choices) >= _MAX_CHOICES:
                _choices.clear()
            _choices[key] = hit
    name, rule, reason = hit
    if mode == "cudnn":
        if name != "cudnn" and rule != "inputs":
            raise NotImplementedError(f"attention: backend 'cudnn' was chosen ({_ENV} or set_attention_backend) "
                                      f"but this call cannot run cuDNN fused attention: {reason}")
    elif name == "cudnn" and _cudnn_failed:
        error = _cudnn_failed.get(_failure_key(q, k, attn_mask_type))
        if error is not None:
            return "seqfuse", "cudnn_failed", f"cudnn_failed: cuDNN failed earlier on these shapes, strides, " \
                                              f"dtype, mask and device: {error}"
    return hit


def _failure_key(q, k, attn_mask_type):
    """What a cuDNN failure in auto is remembered by: the call's shapes,
    strides, dtype, mask and device (one odd call does not turn the route
    off for every other shape)."""
    return (q.dtype, tuple(q.shape), tuple(k.shape), q.stride(), k.stride(), attn_mask_type, q.device)


def attention_backend(q, k, v, qkv_format="bshd", attn_mask_type="no_mask", window_size=None, dropout_p=0.0,
                      deterministic=False, cu_seqlens_q=None, cu_seqlens_kv=None):
    """(name, reason): the backend ("seqfuse" or "cudnn") an ``attention``
    call with these arguments takes under the process's choice, and why (for
    a call that stays on seqfuse, "rule: why" naming the first rule broken).
    Raises what the call would: ValueError for a bad SEQFUSE_ATTN_BACKEND
    or argument value, NotImplementedError for a call the forced "cudnn"
    backend cannot run."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    name, _, reason = _choose(_read_backend(), q, k, v, qkv_format, attn_mask_type, window_size, dropout_p,
                              deterministic, cu_seqlens_q, cu_seqlens_kv)
    return name, reason


def _sdpa(q, k, v, qkv_format, causal, scale):
    """SDPA on the permuted views, restricted to _SDPA_BACKENDS; the output
    back in the caller's layout."""
    to = _TO_BHSD[qkv_format]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    with sdpa_kernel(_SDPA_BACKENDS), torch.autocast(q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q.permute(to), k.permute(to), v.permute(to), is_causal=causal,
                                             scale=scale)
    out = out.permute(_FROM_BHSD[qkv_format])
    return out if out.is_contiguous() else out.contiguous()


def _cudnn_attention(mode, reason, q, k, v, qkv_format, attn_mask_type, softmax_scale):
    """The cudnn route of one call; None where auto falls back to seqfuse."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else \
        as_float("attention", "softmax_scale", softmax_scale)
    if mode == "auto" and reason not in _cudnn_logged:
        _cudnn_logged.add(reason)
        _log.info("seqfuse attention: %s (set %s=seqfuse for seqfuse's kernels)", reason, _ENV)
    if mode != "auto":
        return _sdpa(q, k, v, qkv_format, attn_mask_type != "no_mask", scale)
    try:
        return _sdpa(q, k, v, qkv_format, attn_mask_type != "no_mask", scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "CUDA error" in error or "cudaError" in error:  # the context is broken: nothing to fall back to
            raise
        _cudnn_failed[_failure_key(q, k, attn_mask_type)] = error
        _log.warning("seqfuse attention: cuDNN fused attention (torch SDPA) failed on %s %s d=%d %s: %s; this "
                     "call and later ones of these shapes, strides, dtype, mask and device run on seqfuse's "
                     "kernels",
                     qkv_format, attn_mask_type, q.shape[-1], str(q.dtype).replace("torch.", ""), error)
        return None


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, deterministic):
        # opts carries dropout_p and the call's rng_state (drawn by attention()),
        # so the backward regenerates the forward's mask
        out, lse = attention_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **opts)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_kv)
        ctx.opts, ctx.deterministic = opts, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = attention_bwd(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_k,
                                   deterministic=ctx.deterministic, **ctx.opts)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, *, qkv_format="bshd", attn_mask_type="no_mask", cu_seqlens_q=None,
              cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None,
              softmax_scale=None, deterministic=False, dropout_p=0.0, rng_state=None):
    """Fused attention with autograd: returns out (q's shape and dtype).
    ``dropout_p``: attention dropout (the caller decides training vs eval);
    ``rng_state``: its (seed, offset), drawn from torch's generator when None.
    Runs seqfuse's kernels or cuDNN fused attention through torch SDPA, as
    the backend choice says (module docstring, ``attention_backend``)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    mode = _backend if _backend is not None else _read_backend()
    # auto looks at bshd/sbhd calls only (thd, the packed hot path, is never
    # eligible: no call key to build); forced cudnn looks at every call, to refuse
    if mode == "cudnn" or (mode == "auto" and qkv_format in _TO_BHSD):
        name, _, reason = _choose(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p,
                                  deterministic, cu_seqlens_q, cu_seqlens_kv)
        if name == "cudnn":
            out = _cudnn_attention(mode, reason, q, k, v, qkv_format, attn_mask_type, softmax_scale)
            if out is not None:
                return out
    if rng_state is None and _wants_rng(dropout_p):
        rng_state = dropout_rng_state(q, qkv_format, cu_seqlens_q)
    if qkv_format == "thd" and cu_seqlens_q is not None and cu_seqlens_kv is not None:
        # resolve the max lengths once so forward and backward agree without a second sync
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        max_seqlen_kv = _max_seqlen(cu_seqlens_kv, max_seqlen_kv, "max_seqlen_kv")
    opts = dict(qkv_format=qkv_format, attn_mask_type=attn_mask_type, max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv, window_size=window_size, softmax_scale=softmax_scale,
                dropout_p=dropout_p, rng_state=rng_state)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, cu_seqlens_q, cu_seqlens_kv, opts, bool(deterministic))
    return attention_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, **opts)[0]
