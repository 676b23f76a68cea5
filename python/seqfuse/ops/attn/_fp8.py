"""FP8 attention, the kernel half (Transformer Engine's fp8_dpa): the two calls
that take Q, K, V already in FP8 with their inverse scales and run

    forward:  S = descale_q descale_k (Q8 K8^T) * softmax_scale  (causal mask)
              P = exp(S - rowmax)              in [0, 1]
              P8 = fp8(P * scale_s)            (E4M3)
              O = descale_s descale_v (P8 V8) / rowsum(P),  O8 = fp8(O * scale_o)
              stats = rowmax + log(rowsum) (float32, for the backward)
              amax_s = max P / rowsum, amax_o = max |O| (before their casts)
    backward: P recomputed from stats, P8 as above
              dV = descale_s descale_dO (P8^T dO8)
              dP = descale_dO descale_v (dO8 V8^T)
              D = rowsum(descale_o O8 * descale_dO dO8)
              dS = P (dP - D) * softmax_scale,  dS8 = fp8(dS * scale_dp)
              dQ = descale_dp descale_k (dS8 K8),  dK = descale_dp descale_q (dS8^T Q8)
              dQ8, dK8, dV8 = fp8(dQ * scale_dq) ...; amax_dq/dk/dv of the
              unscaled results, amax_dp = max |dS| (what scale_dp casts, as
              cuDNN reports it)

with every tensor in FP8 and every scale a one-element float32 tensor read on
the device (nothing synchronizes the host).  Who picks the scales (the
delayed-scaling state and the first-step bounds) is the quantization layer's
business: seqfuse/quantization/attention.py.

Two implementations of that contract:

- CUDA (Hopper and later): cuDNN's fused FP8 attention ("sdpa_fp8" /
  "sdpa_fp8_backward" graphs), reached through NVIDIA's nvidia-cudnn-frontend
  Python package (PyPI; not a seqfuse dependency: without it a call raises
  RuntimeError naming the package).  On Hopper cuDNN takes FP8 for O and
  dQ/dK/dV as well as Q/K/V (the bfloat16-output variant is Blackwell-only,
  as Transformer Engine's own checks say), so the caller dequantizes them.
  One graph per shape and option set, built at first use and kept
  (``_GRAPHS``); a cuDNN handle per device, set to the current stream.
- CPU: the same arithmetic in float64 with the same FP8 roundings (torch's
  float8 casts, saturated first), with the whole key range as one block, so
  P8 and the rounding of O follow cuDNN's reference (cudnn-frontend's
  test/python/sdpa/fp8_ref.py) without its 128-key tiling.  It is the
  definition the CUDA route is tested against.

Layouts: "bshd" ([b, s, h, d]) and "sbhd" ([s, b, h, d]), contiguous, so the
graph strides follow from the shape.  Head dims: cuDNN 9.19 on Hopper runs
the FP8 forward at head dims that are multiples of 16 and the FP8 backward
at head dim 128 only (its graph check: "hidden_dim should be equal to
128"); a shape it declines raises NotImplementedError with cuDNN's reason.  Masks: none or causal (top-left
diagonal: query i sees keys 0..i).  Grouped-query: k/v may have fewer heads,
a divisor of q's.
"""
import logging
import threading

import torch

from ..quant import FP8_MAX
from .. import device_checks

_log = logging.getLogger("seqfuse")

LAYOUTS = ("bshd", "sbhd")


# ---- argument checks ------------------------------------------------------------

def _dims(layout, x):
    """(b, s, h, d) of a 4-D tensor in ``layout``."""
    if layout == "bshd":
        b, s, h, d = x.shape
    else:
        s, b, h, d = x.shape
    return b, s, h, d


def _check_fp8(op, name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FP8_MAX:
        raise TypeError(f"{op}: argument '{name}' must be float8_e4m3fn or float8_e5m2, got {x.dtype}")
    if x.dim() != 4 or not x.is_contiguous():
        raise ValueError(f"{op}: argument '{name}' must be a contiguous 4-D tensor, got shape "
                         f"{tuple(x.shape)}{'' if x.is_contiguous() else ' (not contiguous)'}")


def _check_scalar(op, name, t, device):
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == 1
            and t.device == device):
        got = (f"{t.dtype} with {t.numel()} elements on {t.device}" if isinstance(t, torch.Tensor)
               else type(t).__name__)
        raise TypeError(f"{op}: argument '{name}' must be a float32 tensor of one element on {device}, got {got}")


def _check_out(op, name, t, shape, dtype, device):
    if not (isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype
            and t.device == device and t.is_contiguous()):
        got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(f"{op}: argument '{name}' must be a contiguous {dtype} tensor of shape "
                         f"{tuple(shape)} on {device}, got {got}")


def check_qkv(op, q, k, v, layout):
    """The shape rules of both calls; returns (b, s_q, s_kv, h_q, h_kv, d)."""
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: argument 'layout' must be one of {LAYOUTS}, got {layout!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_fp8(op, name, x)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k and v must share one FP8 dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, s_q, h_q, d = _dims(layout, q)
    bk, s_kv, h_kv, dk = _dims(layout, k)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{op}: v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if bk != b or dk != d:
        raise ValueError(f"{op}: k {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head dim "
                         f"({layout})")
    if h_kv < 1 or h_q % h_kv:
        raise ValueError(f"{op}: q's heads ({h_q}) must be a multiple of k/v's ({h_kv})")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"{op}: q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    return b, s_q, s_kv, h_q, h_kv, d


# ---- CPU: the reference arithmetic ------------------------------------------------

def _to_bhsd(x, layout):
    """A [b, h, s, d] float64 view-copy of an FP8 tensor in ``layout``."""
    x = x.double()
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(x, layout):
    return x.permute(0, 2, 1, 3) if layout == "bshd" else x.permute(2, 0, 1, 3)


def _fp8(x, scale, dtype):
    """Round to ``dtype`` of x * scale, seqfuse's cast rule: finite values
    saturate (torch's cast alone gives NaN past E4M3's max), infinities and
    NaN become NaN."""
    m = FP8_MAX[dtype]
    y = x * scale
    return torch.where(y.isinf(), float("nan"), y.clamp(-m, m)).to(dtype)


def _scores(q, k, causal, softmax_scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * softmax_scale
    if causal:
        s_q, s_kv = s.shape[-2:]
        keep = torch.ones(s_q, s_kv, dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _expand(x, groups):
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _forward_cpu(q8, k8, v8, dq, dk, dv, scale_s, descale_s, scale_o, o8, stats, amax_s, amax_o,
                 layout, causal, softmax_scale):
    groups = _dims(layout, q8)[2] // _dims(layout, k8)[2]
    q = _to_bhsd(q8, layout) * dq.double()
    k = _expand(_to_bhsd(k8, layout), groups) * dk.double()
    v = _expand(_to_bhsd(v8, layout), groups) * dv.double()
    s = _scores(q, k, causal, softmax_scale)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    p8 = _fp8(p, scale_s.double(), q8.dtype).double() * descale_s.double()
    o = torch.matmul(p8, v) / l
    stats.copy_((m + torch.log(l)).float())
    amax_s.copy_((p / l).max().reshape(1))  # of the normalized probabilities, as cuDNN reports it
    amax_o.copy_(o.abs().max().reshape(1))
    o8.copy_(_from_bhsd(_fp8(o, scale_o.double(), o8.dtype), layout))


def _backward_cpu(q8, k8, v8, o8, do8, stats, descales, scales, dq8, dk8, dv8, amaxes, layout, causal,
                  softmax_scale):
    d_q, d_k, d_v, d_o, d_do, d_s, d_dp = (t.double() for t in descales)
    s_s, s_dp, s_dq, s_dk, s_dv = (t.double() for t in scales)
    h_q, h_kv = _dims(layout, q8)[2], _dims(layout, k8)[2]
    groups = h_q // h_kv
    q8d, k8d, v8d = _to_bhsd(q8, layout), _expand(_to_bhsd(k8, layout), groups), _expand(_to_bhsd(v8, layout), groups)
    o, do = _to_bhsd(o8, layout) * d_o, _to_bhsd(do8, layout) * d_do
    s = _scores(q8d * d_q, k8d * d_k, causal, softmax_scale)
    p = torch.exp(s - stats.double())
    p8 = _fp8(p, s_s, q8.dtype).double() * d_s
    dv = torch.matmul(p8.transpose(-1, -2), do)
    dp = torch.matmul(do, (v8d * d_v).transpose(-1, -2))
    dd = (o * do).sum(dim=-1, keepdim=True)
    ds = p * (dp - dd) * softmax_scale
    ds8 = _fp8(ds, s_dp, do8.dtype).double() * d_dp
    dq = torch.matmul(ds8, k8d * d_k)
    dk = torch.matmul(ds8.transpose(-1, -2), q8d * d_q)
    if groups > 1:  # each k/v head's gradient sums over its group of q heads
        b, _, s_kv, d = dk.shape
        dk = dk.reshape(b, h_kv, groups, s_kv, d).sum(dim=2)
        dv = dv.reshape(b, h_kv, groups, s_kv, d).sum(dim=2)
    for out, x, scale, amax in ((dq8, dq, s_dq, amaxes[0]), (dk8, dk, s_dk, amaxes[1]), (dv8, dv, s_dv, amaxes[2])):
        amax.copy_(x.abs().max().reshape(1))
        out.copy_(_from_bhsd(_fp8(x, scale, out.dtype), layout))
    amaxes[3].copy_(ds.abs().max().reshape(1))


# ---- CUDA: cuDNN's graphs through nvidia-cudnn-frontend -------------------------------

_cudnn = None
_cudnn_missing = None  # the import's failure, kept: a fallback runs every forward, and asks every time
_GRAPHS = {}
_HANDLES = {}
_lock = threading.Lock()


def cudnn_frontend():
    """The ``cudnn`` module of nvidia-cudnn-frontend, or RuntimeError saying how to get it."""
    global _cudnn, _cudnn_missing
    if _cudnn is None:
        if _cudnn_missing is None:
            try:
                import cudnn
                _cudnn = cudnn
                return _cudnn
            except Exception as e:  # ImportError, or a broken install (a missing libcudnn)
                _cudnn_missing = (f"FP8 attention on CUDA runs cuDNN's fused FP8 attention through NVIDIA's "
                                  f"nvidia-cudnn-frontend package, which is not importable here "
                                  f"({type(e).__name__}: {e}); install it with "
                                  f"'pip install nvidia-cudnn-frontend'")
        raise RuntimeError(_cudnn_missing)
    return _cudnn


def fp8_attention_unavailable(device):
    """Why FP8 attention cannot run on ``device`` (a sentence), or None."""
    if torch.device(device).type != "cuda":
        return None
    try:
        cudnn_frontend()
    except RuntimeError as e:
        return str(e)
    return None


def _handle(device):
    cudnn = cudnn_frontend()
    h = _HANDLES.get(device.index)
    if h is None:
        with torch.cuda.device(device):
            h = _HANDLES[device.index] = cudnn.create_handle()
    cudnn.set_stream(h, torch.cuda.current_stream(device).cuda_stream)
    return h


def _strides(layout, b, s, h, d):
    """Strides of the logical [b, h, s, d] in a contiguous tensor of ``layout``."""
    return (s * h * d, d, h * d, 1) if layout == "bshd" else (h * d, d, b * h * d, 1)


def _dtype(cudnn, t):
    return {torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3, torch.float8_e5m2: cudnn.data_type.FP8_E5M2}[t]


def _scalar(g, uid):
    cudnn = cudnn_frontend()
    return g.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)


def _build(g, what):
    cudnn = cudnn_frontend()
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    except Exception as e:
        raise NotImplementedError(f"fp8 attention: cuDNN {cudnn.backend_version()} has no engine for the "
                                  f"{what} ({type(e).__name__}: {e})") from e
    return g


# uids of the graphs' tensors (the variant packs bind by uid)
_FQ, _FK, _FV, _FDQ, _FDK, _FDV, _FDS, _FSS, _FSO, _FO, _FST, _FAS, _FAO = range(1, 14)
(_BQ, _BK, _BV, _BO, _BDO, _BST, _BDQS, _BDKS, _BDVS, _BDOS, _BDDOS, _BDSS, _BDDPS, _BSS, _BSDQ, _BSDK, _BSDV,
 _BSDP, _BGQ, _BGK, _BGV, _BAQ, _BAK, _BAV, _BAP) = range(101, 126)


def _forward_graph(key):
    (device, layout, b, s_q, s_kv, h_q, h_kv, d, qdt, odt, causal, softmax_scale) = key
    cudnn = cudnn_frontend()
    dt = cudnn.data_type
    g = cudnn.pygraph(io_data_type=_dtype(cudnn, qdt), intermediate_data_type=dt.FLOAT,
                      compute_data_type=dt.FLOAT, handle=_handle(device))
    q = g.tensor(uid=_FQ, dim=(b, h_q, s_q, d), stride=_strides(layout, b, s_q, h_q, d), data_type=_dtype(cudnn, qdt))
    k = g.tensor(uid=_FK, dim=(b, h_kv, s_kv, d), stride=_strides(layout, b, s_kv, h_kv, d),
                 data_type=_dtype(cudnn, qdt))
    v = g.tensor(uid=_FV, dim=(b, h_kv, s_kv, d), stride=_strides(layout, b, s_kv, h_kv, d),
                 data_type=_dtype(cudnn, qdt))
    o, stats, amax_s, amax_o = g.sdpa_fp8(
        q=q, k=k, v=v, descale_q=_scalar(g, _FDQ), descale_k=_scalar(g, _FDK), descale_v=_scalar(g, _FDV),
        descale_s=_scalar(g, _FDS), scale_s=_scalar(g, _FSS), scale_o=_scalar(g, _FSO),
        is_inference=False, attn_scale=softmax_scale, use_causal_mask=causal)
    o.set_uid(_FO).set_output(True).set_dim((b, h_q, s_q, d)).set_stride(
        _strides(layout, b, s_q, h_q, d)).set_data_type(_dtype(cudnn, odt))
    stats.set_uid(_FST).set_output(True).set_dim((b, h_q, s_q, 1)).set_stride(
        (h_q * s_q, s_q, 1, 1)).set_data_type(dt.FLOAT)
    for t, uid in ((amax_s, _FAS), (amax_o, _FAO)):
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(dt.FLOAT)
    return _build(g, f"forward of {describe(*key[1:8], causal)}")


def _backward_graph(key):
    (device, layout, b, s_q, s_kv, h_q, h_kv, d, qdt, odt, dodt, gdt, causal, softmax_scale, deterministic) = key
    cudnn = cudnn_frontend()
    dt = cudnn.data_type
    g = cudnn.pygraph(io_data_type=_dtype(cudnn, qdt), intermediate_data_type=dt.FLOAT,
                      compute_data_type=dt.FLOAT, handle=_handle(device))
    sq, skv = _strides(layout, b, s_q, h_q, d), _strides(layout, b, s_kv, h_kv, d)
    q = g.tensor(uid=_BQ, dim=(b, h_q, s_q, d), stride=sq, data_type=_dtype(cudnn, qdt))
    k = g.tensor(uid=_BK, dim=(b, h_kv, s_kv, d), stride=skv, data_type=_dtype(cudnn, qdt))
    v = g.tensor(uid=_BV, dim=(b, h_kv, s_kv, d), stride=skv, data_type=_dtype(cudnn, qdt))
    o = g.tensor(uid=_BO, dim=(b, h_q, s_q, d), stride=sq, data_type=_dtype(cudnn, odt))
    do = g.tensor(uid=_BDO, dim=(b, h_q, s_q, d), stride=sq, data_type=_dtype(cudnn, dodt))
    stats = g.tensor(uid=_BST, dim=(b, h_q, s_q, 1), stride=(h_q * s_q, s_q, 1, 1), data_type=dt.FLOAT)
    dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dp = g.sdpa_fp8_backward(
        q=q, k=k, v=v, o=o, dO=do, stats=stats,
        descale_q=_scalar(g, _BDQS), descale_k=_scalar(g, _BDKS), descale_v=_scalar(g, _BDVS),
        descale_o=_scalar(g, _BDOS), descale_dO=_scalar(g, _BDDOS), descale_s=_scalar(g, _BDSS),
        descale_dP=_scalar(g, _BDDPS), scale_s=_scalar(g, _BSS), scale_dQ=_scalar(g, _BSDQ),
        scale_dK=_scalar(g, _BSDK), scale_dV=_scalar(g, _BSDV), scale_dP=_scalar(g, _BSDP),
        attn_scale=softmax_scale, use_causal_mask=causal, use_deterministic_algorithm=deterministic)
    for t, uid, hh, ss, st in ((dq, _BGQ, h_q, s_q, sq), (dk, _BGK, h_kv, s_kv, skv), (dv, _BGV, h_kv, s_kv, skv)):
        t.set_uid(uid).set_output(True).set_dim((b, hh, ss, d)).set_stride(st).set_data_type(_dtype(cudnn, gdt))
    for t, uid in ((amax_dq, _BAQ), (amax_dk, _BAK), (amax_dv, _BAV), (amax_dp, _BAP)):
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(dt.FLOAT)
    return _build(g, f"backward of {describe(*key[1:8], causal)}")


def describe(layout, b, s_q, s_kv, h_q, h_kv, d, causal):
    return (f"{layout} b={b} s_q={s_q} s_kv={s_kv} heads {h_q}/{h_kv} head dim {d}, "
            f"{'causal' if causal else 'no mask'}")


def _graph(key, make, what):
    g = _GRAPHS.get(key)
    if g is None:
        shape = describe(*key[1:8], key[10 if what == "forward" else 12])
        if device_checks.capturing():
            raise RuntimeError(f"fp8 attention: no cuDNN {what} graph for {shape} yet, and one cannot be built "
                               "under CUDA graph capture; run the shape once eagerly first")
        with _lock:
            g = _GRAPHS.get(key)
            if g is None:
                g = _GRAPHS[key] = make(key)
                _log.info("seqfuse fp8 attention: built cuDNN's %s graph for %s", what, shape)
    return g


def _execute(g, pack, device):
    ws = torch.empty(g.get_workspace_size(), dtype=torch.uint8, device=device)
    g.execute(pack, ws, handle=_handle(device))


# ---- the two calls -----------------------------------------------------------------

def fp8_attention_forward(q, k, v, descale_q, descale_k, descale_v, scale_s, descale_s, scale_o, *, o, stats,
                          amax_s, amax_o, layout="bshd", causal=False, softmax_scale=None):
    """Writes ``o`` (FP8, q's shape and layout), ``stats`` (float32 [b, h_q,
    s_q, 1]), ``amax_s`` and ``amax_o`` (one float32 element each, written,
    not accumulated).  Scales as in the file's note."""
    op = "fp8_attention_forward"
    b, s_q, s_kv, h_q, h_kv, d = check_qkv(op, q, k, v, layout)
    dev = q.device
    for name, t in (("descale_q", descale_q), ("descale_k", descale_k), ("descale_v", descale_v),
                    ("scale_s", scale_s), ("descale_s", descale_s), ("scale_o", scale_o),
                    ("amax_s", amax_s), ("amax_o", amax_o)):
        _check_scalar(op, name, t, dev)
    if not isinstance(o, torch.Tensor) or o.dtype not in FP8_MAX:
        raise TypeError(f"{op}: argument 'o' must be an FP8 tensor, got "
                        f"{o.dtype if isinstance(o, torch.Tensor) else type(o).__name__}")
    _check_out(op, "o", o, q.shape, o.dtype, dev)
    _check_out(op, "stats", stats, (b, h_q, s_q, 1), torch.float32, dev)
    softmax_scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    if dev.type != "cuda":
        _forward_cpu(q, k, v, descale_q, descale_k, descale_v, scale_s, descale_s, scale_o, o, stats, amax_s,
                     amax_o, layout, bool(causal), softmax_scale)
        return
    key = (dev, layout, b, s_q, s_kv, h_q, h_kv, d, q.dtype, o.dtype, bool(causal), softmax_scale)
    g = _graph(key, _forward_graph, "forward")
    _execute(g, {_FQ: q, _FK: k, _FV: v, _FDQ: descale_q, _FDK: descale_k, _FDV: descale_v, _FDS: descale_s,
                 _FSS: scale_s, _FSO: scale_o, _FO: o, _FST: stats, _FAS: amax_s, _FAO: amax_o}, dev)


def fp8_attention_backward(q, k, v, o, do, stats, descale_q, descale_k, descale_v, descale_o, descale_do,
                           descale_s, descale_dp, scale_s, scale_dp, scale_dq, scale_dk, scale_dv, *, dq, dk, dv,
                           amax_dq, amax_dk, amax_dv, amax_dp, layout="bshd", causal=False, softmax_scale=None,
                           deterministic=False):
    """Writes ``dq``, ``dk``, ``dv`` (FP8, the shapes of q, k, v) and the four
    amaxes (one float32 element each).  ``o`` and ``stats``: the forward's."""
    op = "fp8_attention_backward"
    b, s_q, s_kv, h_q, h_kv, d = check_qkv(op, q, k, v, layout)
    dev = q.device
    for name, t in (("o", o), ("do", do)):
        _check_fp8(op, name, t)
        _check_out(op, name, t, q.shape, t.dtype, dev)
    descales = (descale_q, descale_k, descale_v, descale_o, descale_do, descale_s, descale_dp)
    scales = (scale_s, scale_dp, scale_dq, scale_dk, scale_dv)
    amaxes = (amax_dq, amax_dk, amax_dv, amax_dp)
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp",
             "scale_s", "scale_dp", "scale_dq", "scale_dk", "scale_dv", "amax_dq", "amax_dk", "amax_dv", "amax_dp")
    for name, t in zip(names, descales + scales + amaxes):
        _check_scalar(op, name, t, dev)
    _check_out(op, "stats", stats, (b, h_q, s_q, 1), torch.float32, dev)
    if not isinstance(dq, torch.Tensor) or dq.dtype not in FP8_MAX:
        raise TypeError(f"{op}: argument 'dq' must be an FP8 tensor, got "
                        f"{dq.dtype if isinstance(dq, torch.Tensor) else type(dq).__name__}")
    for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_out(op, name, t, like.shape, dq.dtype, dev)
    softmax_scale = float(softmax_scale) if softmax_scale is not None else d ** -0.5
    if dev.type != "cuda":
        _backward_cpu(q, k, v, o, do, stats, descales, scales, dq, dk, dv, amaxes, layout, bool(causal),
                      softmax_scale)
        return
    key = (dev, layout, b, s_q, s_kv, h_q, h_kv, d, q.dtype, o.dtype, do.dtype, dq.dtype, bool(causal),
           softmax_scale, bool(deterministic))
    g = _graph(key, _backward_graph, "backward")
    _execute(g, {_BQ: q, _BK: k, _BV: v, _BO: o, _BDO: do, _BST: stats, _BDQS: descale_q, _BDKS: descale_k,
                 _BDVS: descale_v, _BDOS: descale_o, _BDDOS: descale_do, _BDSS: descale_s, _BDDPS: descale_dp,
                 _BSS: scale_s, _BSDQ: scale_dq, _BSDK: scale_dk, _BSDV: scale_dv, _BSDP: scale_dp,
                 _BGQ: dq, _BGK: dk, _BGV: dv, _BAQ: amax_dq, _BAK: amax_dk, _BAV: amax_dv, _BAP: amax_dp}, dev)
