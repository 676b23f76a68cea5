"""The "cudnn_ragged" route of ``ops.attention``: packed (thd) batches of
unequal sequence lengths on cuDNN's own variable-length ("ragged offset")
fused attention, reached through torch's private op
``torch.ops.aten._cudnn_attention_forward`` with cumulative sequence lengths.
Off by default (``SEQFUSE_ATTN_CUDNN_RAGGED=1`` or
``set_attention_cudnn_ragged(True)`` lets auto try it; ``SEQFUSE_ATTN_BACKEND=
cudnn_ragged`` forces it): it stays off until a GPU run
(benchmarks/attn/ragged_probe.py) shows it equal to the current thd route and
faster.  _routing.py decides when a call takes it; this file holds its rules
(a pure function of the call's facts) and the code that runs it.

Two providers of the same cuDNN graph: "torch" (the default; torch's private
op, below) and "frontend" (``SEQFUSE_ATTN_CUDNN_RAGGED=frontend`` or
``set_attention_cudnn_ragged(True, "frontend")``): ``cudnn.sdpa_torch`` of
NVIDIA's nvidia-cudnn-frontend package (PyPI; not a seqfuse dependency, used
only where installed), whose 1.32 release registers torch.ops.cudnn.sdpa_forward /
sdpa_backward for packed (T, H, D) tensors with cu_seqlens, differentiable
(return_lse=True), and caches its cuDNN graphs by batch size, heads, max
sequence lengths, strides and flags -- not by the token count.  seqfuse
rounds the batch size up to a multiple of 16 (appending empty sequences to
the cu_seqlens, on the device) and the max lengths up to a power of two, so
that the batches of a training run share a few graphs instead of building
one per batch.  It has neither of torch 2.11's problems (1) and (2) below,
so it takes calls that want gradients; its forward allocates the output
like torch's op (tokens outside every sequence unwritten: the same lengths
rule).

Why a separate route: cuDNN's padding-free bshd attention runs at 1.3-2.3x
the speed of the FlashAttention-2 kernels that take packed batches today
(README, "Attention routes over the grid"), and cuDNN's graph API describes packed layouts
directly (a ragged offset per sequence), so a packed batch need not be
padded.  What torch 2.11 (the GPU machine's torch, 2.11.0+cu130, git
70d99e998b) offers for it, read from its wheel and PyTorch's sources:

- ``_cudnn_attention_forward(query, key, value, attn_bias, cum_seq_q,
  cum_seq_k, max_q, max_k, compute_log_sumexp, dropout_p=0.0,
  is_causal=False, return_debug_mask=False, *, scale=None)`` -> (output,
  logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed,
  philox_offset, debug_attn_mask), and ``_cudnn_attention_backward(grad_out,
  query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
  cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None)``
  -> (dq, dk, dv): native_functions.yaml of the 2.11.0 wheel
  (torchgen/packaged/ATen/native/native_functions.yaml:15291 and :15296),
  CUDA dispatch only.  The forward has an autograd formula
  (CudnnAttentionBackward0, torch/include/torch/csrc/autograd/generated/
  Functions.h:12556, saving cum_seq_q/k and max_q/k) that runs the backward.
- Given cum_seq_q the op takes the nested ("ragged") path: q, k, v are
  [total tokens, heads, head dim] (MHA.cpp:257-272 of that build asserts 3-D
  there) with any strides (the graph is given q's head, token and dim
  strides; the ragged offsets are cum_seq times the token stride); k/v may
  have fewer heads than q (grouped-query; cuDNN itself needs 9.6 or later for
  that with ragged offsets); the output is a fresh [total, heads, d] tensor
  in which only tokens inside a sequence are written; logsumexp is float32
  [total, heads, 1], token-major.  is_causal is cuDNN's top-left diagonal
  within each sequence, seqfuse's "padding_causal".  Dropout draws from
  torch's generator (seqfuse keeps its own Philox contract, so the route
  takes no dropout; cuDNN 9.11-9.13 has none either).
- Known problems in 2.11, the reason this route is off by default:
  (1) the nested path looks its cuDNN graph up in the cache but never
  inserts it, so every call builds the whole graph again (PyTorch PR
  #191576 measured 42 ms per call, fixed after 2.11; seqfuse's own H200
  run, benchmarks/results/logs/attn_routes_s9.log: 46-51 ms per forward
  against 0.24-1.8 ms for FlashAttention-2); (2) the backward reads the
  maximum sequence lengths from query.size(2), which on 3-D input is the
  head dim, and sizes cuDNN's dQ accumulator from it: out-of-bounds writes
  for any sequence longer than the head dim (PyTorch PR #186142, June 2026,
  three months after 2.11's wheel was built; the same H200 run's forward+
  backward through this op did not raise, but its gradients were not
  checked).  So this route never runs a backward on a torch not checked to
  be free of (2) (rule ``torch_backward``; ``RAGGED_BACKWARD_FROM`` is the
  first such torch, None until benchmarks/attn/ragged_probe.py's child run
  of the op's backward shows correct gradients on one), and the probe times
  (1).  (3) torch.nn.attention.varlen.varlen_attn has a cuDNN branch
  whose switch ``_should_use_cudnn`` returns False in 2.11 (varlen.py:29-32;
  its backward call, varlen.py:307-323, passes cu_seq_q/cu_seq_k where the
  schema has philox_seed/philox_offset): varlen_attn is FlashAttention-2
  only.  (4) SDPA on nested jagged tensors reaches the same nested path,
  only with TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1, on compute capability
  9.0 or 10.0, head dims multiples of 8 up to 128 (torch/nested/_internal/
  sdpa.py:115-138), and tried after FlashAttention, memory-efficient and
  math (sdpa.py:302-307).
- Alignment: cuDNN's ragged kernels need 16-byte aligned base pointers and
  row strides; PyTorch PR #194818 (after 2.11) found unaligned q/k/v giving
  silently wrong values.  The route takes q, k, v through ``kernel_layout``
  (_args.py), which guarantees both.

Rules (``ragged_eligibility``, checked in this order; the reason names the
first broken one as "rule: why"): ``qkv_format`` (thd only); ``alignment``
(a bottom-right causal mask only where cu_seqlens_q is cu_seqlens_kv:
cuDNN's diagonal is top-left); ``window`` (none); ``dropout`` (p == 0);
``deterministic``; ``dtype`` (float16, bfloat16); ``gqa`` (q heads a
multiple of the k/v heads, and grouped-query only with cuDNN 9.6 or later);
``head_dim`` (a multiple of 8, at most 128, torch's nested cuDNN limit):
these four as the other fused-attention routes have them
(``kernel_refusal`` in _args.py); ``device`` (CUDA); ``torch_op`` (torch has the op; with the frontend
provider, rule ``frontend``: the package imports); ``graph_capture`` (torch's
op builds and frees a cuDNN graph on the host in every call, the frontend's
one per new shape, and the lengths rule reads cached host facts: not under
CUDA graph capture); ``lengths`` (the cached cu_seqlens facts of
ops/device_checks.py show every q and k/v token inside a sequence, since
cuDNN leaves the others unwritten, at least one token, and, where q and k/v
have separate cu_seqlens, no empty key sequence: a query that sees no key
must come out 0); ``torch_backward`` (torch provider: no gradient wanted,
see (2)); ``capability`` (auto only: 9.0, the GPU it is meant for); and
``cudnn_sdp_enabled``.
"""
import logging

import torch

from ..tensor_cache import PerTensorCache
from ._args import MASKS, capability_refusal, kernel_refusal, refusal

RAGGED_DTYPES = (torch.float16, torch.bfloat16)
RAGGED_MAX_HEAD_DIM = 128        # torch's limit for cuDNN on nested tensors (torch/nested/_internal/sdpa.py)
RAGGED_CAPABILITY = (9, 0)       # auto takes the route only on Hopper, where it was meant to be measured
RAGGED_GQA_CUDNN = 90600         # cuDNN 9.6: grouped-query attention with ragged offsets
BOTTOM_RIGHT = {4, 5}            # mask codes of the bottom-right causal masks
CAUSAL = {2, 3, 4, 5}
PROVIDERS = ("torch", "frontend")
BUCKET_BATCH = 16                # the frontend provider's batch-size rounding (empty sequences appended)
#: The first torch release whose ragged cuDNN backward was checked on a GPU
#: to size its buffers from max_q/max_k (PyTorch PR #186142); None: none yet,
#: and the route refuses every call that wants gradients.
RAGGED_BACKWARD_FROM = None


def torch_release(version=None):
    """(major, minor) of a torch version string (default: this torch's)."""
    parts = str(torch.__version__ if version is None else version).split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def ragged_backward_trusted(version=None):
    """Whether this torch's ragged cuDNN backward may run (RAGGED_BACKWARD_FROM)."""
    return RAGGED_BACKWARD_FROM is not None and torch_release(version) >= tuple(RAGGED_BACKWARD_FROM)


def op_available():
    """Whether this torch has torch.ops.aten._cudnn_attention_forward."""
    try:
        torch.ops.aten._cudnn_attention_forward  # noqa: B018 (a lookup that raises when absent)
    except (AttributeError, RuntimeError):
        return False
    return True


_frontend_load_error = []  # the one time an installed frontend failed to load, logged once


def frontend_sdpa():
    """nvidia-cudnn-frontend's torch SDPA (cudnn.sdpa_torch), or None where
    the package is not installed or lacks it; an installed package that
    fails to load (its libcudnn, say) is also None, and logger "seqfuse"
    says why once (WARNING)."""
    try:
        import cudnn
        return cudnn.sdpa_torch
    except (ImportError, AttributeError):  # absent, or a version without sdpa_torch
        return None
    except (OSError, RuntimeError) as e:
        if not _frontend_load_error:
            _frontend_load_error.append(e)
            logging.getLogger("seqfuse").warning(
                "cudnn_ragged: nvidia-cudnn-frontend is installed but does not load (%s: %s); its provider is "
                "unavailable", type(e).__name__, e)
        return None


def ragged_eligibility(device_type, capability, qkv_format, attn_mask_type, window, dropout_p, deterministic,
                       dtype, heads_q, heads_kv, head_dim, cudnn_enabled, *, same_cu=False, covered=None,
                       needs_grad=False, capturing=False, cudnn_version=None, op_present=True,
                       backward_trusted=False, check_capability=True, deterministic_algorithms=False,
                       provider="torch"):
    """(rule, reason) of the "cudnn_ragged" route for one call's facts:
    rule "" when the call may run cuDNN's ragged attention, else the first
    rule it breaks (the module docstring's order) and reason "rule: why".
    Pure: no tensors, no device queries.  ``window``: a (left, right) pair;
    ``same_cu``: cu_seqlens_q is cu_seqlens_kv; ``covered``: True when the
    cached cu_seqlens facts show every q and k/v token inside a sequence,
    at least one token, and (separate cu_seqlens) no empty key sequence,
    False when they show otherwise, None when they are not known (CUDA
    graph capture, unreadable tensors);
    ``cudnn_version``: torch.backends.cudnn.version() (None: unknown);
    ``op_present``: the provider's op is there (torch's aten op, or the
    frontend package's); ``backward_trusted``: this torch's ragged backward
    may run (``ragged_backward_trusted``; the frontend provider does not
    need it); ``check_capability`` False skips the capability rule (forced
    route); ``provider``: "torch" or "frontend"."""
    if qkv_format != "thd":
        return refusal("qkv_format", f"qkv_format {qkv_format!r}; the cudnn_ragged route takes packed thd only")
    code = MASKS[attn_mask_type]
    if code in BOTTOM_RIGHT and not same_cu:
        return refusal("alignment", f"attn_mask_type {attn_mask_type!r} is bottom-right causal and cu_seqlens_q is "
                                    "not cu_seqlens_kv (cuDNN's causal diagonal is top-left; they agree only where "
                                    "every sequence has as many queries as keys)")
    if tuple(window) != (-1, -1):
        return refusal("window", f"window_size {tuple(window)!r} (torch's ragged cuDNN op takes no window)")
    if dropout_p != 0.0:
        return refusal("dropout", f"dropout_p {dropout_p} > 0 (this route passes no dropout to cuDNN's ragged op)")
    gqa_why = None
    if cudnn_version is None or cudnn_version < RAGGED_GQA_CUDNN:
        gqa_why = (f"grouped-query attention ({heads_q} q / {heads_kv} k/v heads) with ragged offsets needs "
                   f"cuDNN 9.6 or later, this torch has {cudnn_version}")
    if broken := kernel_refusal("cuDNN", deterministic, deterministic_algorithms, dtype, heads_q, heads_kv, head_dim,
                                dtypes=RAGGED_DTYPES, max_head_dim=RAGGED_MAX_HEAD_DIM, grouped_query_why=gqa_why,
                                deterministic_why="torch does not guarantee a deterministic cuDNN backward"):
        return broken
    if device_type != "cuda":
        return refusal("device", f"{device_type} tensors (cuDNN fused attention is CUDA only)")
    if not op_present and provider == "frontend":
        return refusal("frontend", "the nvidia-cudnn-frontend package (import cudnn; cudnn.sdpa_torch) is not "
                                   "installed here (pip install nvidia-cudnn-frontend)")
    if not op_present:
        return refusal("torch_op", f"torch {torch.__version__} has no torch.ops.aten._cudnn_attention_forward")
    if capturing:
        return refusal("graph_capture", "the op builds cuDNN graphs on the host (torch's in every call), and the "
                                        "route reads the sequence lengths' cached host facts: not under CUDA graph "
                                        "capture")
    if covered is None:
        return refusal("lengths", "the cu_seqlens facts are not known on the host (the route needs every token "
                                  "inside a sequence: cuDNN leaves the others unwritten)")
    if not covered:
        return refusal("lengths", "tokens past the last sequence, no token at all, or an empty key sequence beside "
                                  "separate query lengths (cuDNN leaves tokens outside every sequence unwritten, and "
                                  "seqfuse's thd contract makes them 0, as it does a query that sees no key)")
    if needs_grad and provider == "torch" and not backward_trusted:
        return refusal("torch_backward", f"gradients wanted, and torch {torch.__version__}'s ragged cuDNN backward is "
                                         "not trusted: torch releases before PyTorch PR #186142 size cuDNN's dQ "
                                         "accumulator from the head dim instead of max_seqlen (out-of-bounds writes)")
    if check_capability and (broken := capability_refusal(capability, RAGGED_CAPABILITY,
                                                          "the cudnn_ragged route is taken in auto only on 9.0")):
        return broken
    if not cudnn_enabled:
        return refusal("cudnn_sdp_enabled", "torch.backends.cuda.cudnn_sdp_enabled() is False")
    return "", ""


def _ragged_forward(*args, **kwargs):
    """torch's ragged cuDNN forward (the CPU tests put a stand-in here)."""
    return torch.ops.aten._cudnn_attention_forward(*args, **kwargs)


def _bucket_cus(cus, batch):
    """cu_seqlens_q, cu_seqlens_kv each extended with empty sequences to
    ``batch`` sequences (device-side: no host read)."""
    return tuple(torch.cat((cu, cu[-1:].expand(batch + 1 - cu.numel()))) for cu in cus)


_bucketed = PerTensorCache(lambda cus, batch: _bucket_cus(cus, batch))


def bucket_lengths(batch, max_q, max_k):
    """(batch, max_q, max_k) as the frontend provider hands them to cuDNN:
    the batch size rounded up to a multiple of BUCKET_BATCH, each max length
    up to a power of two (at least 64), so that batches of other lengths
    reuse a graph."""
    def up(n):
        return max(64, 1 << (max(int(n), 1) - 1).bit_length())
    return -(-batch // BUCKET_BATCH) * BUCKET_BATCH, up(max_q), up(max_k)


def run_cudnn_ragged(q, k, v, attn_mask_type, scale, cu_q, cu_k, max_q, max_k, provider="torch"):
    """The "cudnn_ragged" route of one call (eligible by
    ``ragged_eligibility``): q [t, h, d], k/v [t_k, h_k, d] in kernel_layout,
    int32 cu_seqlens covering every token, max_q/max_k the longest sequence
    lengths; returns out [t, h, d] in q's dtype, differentiable where
    gradients are wanted (torch's CudnnAttentionBackward0, or the frontend
    op's registered autograd)."""
    causal = MASKS[attn_mask_type] in CAUSAL
    wants_lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if provider == "frontend":
        batch, bq, bk = bucket_lengths(cu_q.numel() - 1, max_q, max_k)
        cus = (cu_q, cu_k) if batch + 1 == cu_q.numel() else _bucketed((cu_q, cu_k), batch)  # (never under capture)
        out = _frontend_forward(q, k, v, scale=scale, is_causal=causal, cu_seqlens_q=cus[0], cu_seqlens_kv=cus[1],
                                max_seqlen_q=bq, max_seqlen_kv=bk, return_lse=wants_lse)
        out = out[0] if wants_lse else out
    else:
        out = _ragged_forward(q, k, v, None, cu_q, cu_k, max(int(max_q), 1), max(int(max_k), 1), wants_lse, 0.0,
                              causal, False, scale=scale)[0]
    return out if out.is_contiguous() else out.contiguous()


def _frontend_forward(*args, **kwargs):
    """nvidia-cudnn-frontend's cudnn.sdpa_torch (the CPU tests put a stand-in here)."""
    sdpa = frontend_sdpa()
    if sdpa is None:  # the rules checked it: only a package removed since gets here
        raise RuntimeError("cudnn_ragged (frontend provider): nvidia-cudnn-frontend's cudnn.sdpa_torch is not "
                           "importable")
    return sdpa(*args, **kwargs)
