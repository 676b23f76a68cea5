"""Which code runs an attention call, and the environment variables that
choose it.

Kernel choice on Hopper (``attention``, ``attention_forward`` and
``attention_backward`` alike).  The forward has two kernels: the wgmma one
(``attention_forward_kernel`` 90, csrc/attn/attn_forward_sm90_cuda.cu) and the
mma.sync one (80).  The choice is ``SEQFUSE_ATTN_FORWARD_KERNEL=sm90|sm80`` or
``set_attention_forward_kernel``; the wgmma kernel is the default for head dims 64
and 128 (confirmed on an H200).  The backward has the same pair
(``attention_backward_kernel``, csrc/attn/attn_backward_sm90_cuda.cu), chosen by
``SEQFUSE_ATTN_BACKWARD_KERNEL=sm90|sm80`` or ``set_attention_backward_kernel``; the
wgmma backward is the default for head dims 64 and 128 (confirmed on an
H200), and deterministic calls always take sm80 (the wgmma backward adds dQ
with atomics).  Dropout calls take sm80 both ways (the wgmma kernels have no
dropout).  Wherever a Hopper device runs the slower kernel, the reason is
logged once (logger "seqfuse").  SEQFUSE_ATTN_FORWARD_KERNEL and
SEQFUSE_ATTN_BACKWARD_KERNEL are read here, like SEQFUSE_ATTN_BACKEND (the C
library reads no environment): once, at the first question about that
direction's kernel (every CUDA forward / backward asks), unless a
``set_attention_*_kernel`` came first; unset or empty keeps the default, any
value other than sm90 or sm80 is a ValueError naming the variable, and so is
a variable set under its former name (_KERNEL_ENV_FORMER).  The
choice itself lives in the C library (``_C.attn_set_forward_kernel``), which
this file asks (``attention_forward_kernel``, ``attention_backward_kernel``) and
whose reasons it logs.

Backend choice (``attention`` only; ``attention_forward`` and ``attention_backward``,
the explicit halves that return and take the lse, always run seqfuse's
kernels).  Routes: "seqfuse" (the kernels above); "cudnn" (cuDNN fused
attention as ``torch.nn.functional.scaled_dot_product_attention`` runs it
under ``sdpa_kernel([SDPBackend.CUDNN_ATTENTION])``: torch's cuDNN op called
directly where SDPA's own choice for the tensors is cuDNN, SDPA itself
otherwise (``_sdpa``), torch's autograd doing the backward; measured on an H200 at ESM-2 650M's shape, 16 x 1024 tokens,
20 heads of dim 64, bf16, no mask: 23.5 ms of attention per training step
against 57 ms for seqfuse's kernels); "flash" (torch's FlashAttention-2 for
what cuDNN's route cannot take: packed thd, padded batches, windows, dropout
where cuDNN refuses it; rules ``flash_eligibility`` and layouts in _torch_routes.py;
torch.nn.attention.varlen.varlen_attn, the same kernel, measured on an
H200 with torch 2.11 at 16k packed tokens (bf16, /shared/DESIGN.md)
96-257 TFLOP/s forward+backward against seqfuse's thd kernel's 91-196,
and 118-268 forward against 121-303: auto takes it for training's sake,
benchmarks/attn/bench_routes.py re-measures); "cudnn_ragged" (packed thd
batches of unequal lengths on cuDNN's variable-length attention through
``torch.ops.aten._cudnn_attention_forward`` with cu_seqlens; rules
``ragged_eligibility`` and torch 2.11's facts in _cudnn_ragged.py; OFF by
default: auto tries it, after cuDNN and before flash, only with
``SEQFUSE_ATTN_CUDNN_RAGGED=1`` or ``set_attention_cudnn_ragged(True)``,
until a GPU run (benchmarks/attn/ragged_probe.py) shows it equal and faster;
through torch 2.11's op every call rebuilds its cuDNN graph, about 45 ms,
and calls that want gradients are refused, rule ``torch_backward``; the
"frontend" provider, NVIDIA's nvidia-cudnn-frontend package where installed,
caches its graphs and takes training calls); and "torch_fp32"
(float32 on CUDA, which seqfuse's CUDA kernels do not take: torch SDPA's
memory-efficient or math kernels with an explicit mask, _torch_routes.py).
The choice is ``SEQFUSE_ATTN_BACKEND=auto|seqfuse|cudnn|flash|cudnn_ragged``
(read once, at the first attention call; unset or empty means auto; any other
value is a ValueError naming the variable, raised there) or
``set_attention_backend(name)``, which overrides it for the process.
``SEQFUSE_ATTN_CUDNN_RAGGED`` (read once at the first question that needs
it: "0" or unset off; "1" or "torch" on, through torch's op; "frontend" on,
through the nvidia-cudnn-frontend package's op where it is installed, which
also takes calls that want gradients; anything else is a ValueError naming
it) is auto's opt-in and the forced route's provider;
``set_attention_cudnn_ragged(enabled, provider="torch")`` overrides it.
``attention_backend(q, k, v, ...)`` returns (name, reason): the route a call
takes ("seqfuse", "cudnn", "flash", "cudnn_ragged" or "torch_fp32") and why.

- "auto" (the default) takes cuDNN only where every rule holds, checked in
  this order (the reason names the first one broken, as "rule: why"):
  qkv_format "bshd" or "sbhd" (``qkv_format``); no padding mask and no
  cu_seqlens (``padding``); attn_mask_type "no_mask", "causal" or
  "causal_bottom_right" (``attn_mask_type``); s_q == s_kv (``lengths``:
  SDPA's is_causal is top-left, which equals bottom-right only at equal
  lengths), at least 2, batch and heads at most 65535 (torch's cuDNN
  limits, also ``lengths``); window_size None or (-1, -1), or (-1, 0) with a
  causal mask (``window``); dropout_p == 0, or dropout without an explicit
  ``rng_state`` (which asks for seqfuse's own Philox mask) on a cuDNN other
  than 9.11-9.13, where torch refuses dropout in cuDNN attention
  (``dropout``: the mask is then cuDNN's, drawn from torch's generator as
  the flash route's is; the version unknown: refused), and in auto only
  where it measured faster than the flash route's dropout on an H200
  (benchmarks/attn/bench_routes.py): head dims of 64 and more
  (``_CUDNN_DROPOUT_MIN_HEAD_DIM``), with or without gradients (a
  recompute draws its mask on the forward's route); not deterministic and no
  ``torch.use_deterministic_algorithms(True)`` (``deterministic``: torch
  does not guarantee a deterministic cuDNN backward, and refuses cuDNN
  then); float16 or bfloat16 (``dtype``); q heads a multiple of the k/v
  heads (``gqa``; fewer k/v heads go to SDPA with ``enable_gqa``); head dim a multiple of 8, at most 128 (``head_dim``); CUDA
  tensors (``device``); compute capability exactly 9.0, where it was
  measured faster (``capability``); and
  ``torch.backends.cuda.cudnn_sdp_enabled()`` (``cudnn_sdp_enabled``).
  q, k and v that disagree (dtype, device, batch, head dim, k vs v shape,
  not 4-D) run seqfuse's kernels, whose checks report them (``inputs``).
  ``cudnn_eligibility`` is the rule check as a pure function of the call's
  facts; its answer is cached per call key, the capability per device.
  A packed (thd) call is the padding-free bshd call [b, L] when one
  cu_seqlens tensor serves q and kv and splits all t tokens into b
  sequences of the same length L = t / b (fixed-length genomic windows,
  packed): the router learns that from the facts the cu_seqlens check has
  already read on the host (ops/device_checks.py ``uniform_length``; no
  extra synchronization, never under CUDA graph capture), puts L in the
  call key, and sends the call to cuDNN by the rules above applied to
  [b, L] (its padding mask read as no mask, or causal); the reason names
  both views.
- then, in auto with the cudnn_ragged opt-in on, a thd call cuDNN does not
  take goes to "cudnn_ragged" where every rule of ``ragged_eligibility`` holds
  (the lengths facts come from the cu_seqlens check's cached host read, as
  for the uniform case: no extra synchronization, none under capture); a
  call it does not take adds "cudnn_ragged route: <rule>: why" to its
  reason.
- then, in auto, a call cuDNN does not take goes to "flash" where every
  rule of ``flash_eligibility`` holds (_torch_routes.py: ``alignment``,
  ``rng_state``, ``deterministic``, ``dtype``, ``gqa``, ``head_dim``,
  ``lengths``, ``device``, ``capability`` (9.0 in auto), ``forward_only``
  (in auto a call without gradients or dropout, at a head dim seqfuse's
  CUDA kernels take, stays on them: their forward measured faster) and
  ``flash_sdp_enabled``), then float32 CUDA calls to "torch_fp32" (rules
  ``fp32_eligibility``: ``rng_state``, ``graph_capture``); a float32 CUDA
  call that breaks those raises NotImplementedError naming the rule (no
  seqfuse kernel takes it).  A call that stays on seqfuse has the reason
  "<cuDNN's rule>: why; flash route: <flash's rule>: why".  thd and padded
  calls also need their cu_seqlens as seqfuse's kernels take them (int32,
  1-D, on q's device, b+1 long for padded rows, as long as each other in
  thd); anything else runs seqfuse's kernels, whose checks report it
  (``inputs``).
- "flash": eligible calls take torch's FlashAttention on any compute
  capability; any other broken rule is a NotImplementedError naming it.
- "cudnn_ragged": eligible calls take cuDNN's ragged attention on any
  compute capability (the capability rule is skipped); any other broken
  rule is a NotImplementedError naming it.
- "cudnn": eligible calls take cuDNN, on any compute capability (the
  capability rule is about speed and is skipped); any other broken rule is a
  NotImplementedError naming it (no silent fallback; disagreeing inputs get
  seqfuse's own errors), and torch's errors are raised as they come.
- "seqfuse": always seqfuse's kernels.

The first time auto sends a kind of call (route, layout, mask, head dim,
dtype, and for flash GQA / dropout) to a torch route, logger "seqfuse" says
so once at INFO.  If torch raises a RuntimeError from the cuDNN, cudnn_ragged
or flash forward in auto (e.g. "No available kernel"; an
out-of-memory error, or a CUDA error, which leaves the context unusable, is
raised as it is), a WARNING names the error, the call runs seqfuse's
kernels, and every later call of the same route, shapes, strides, dtype,
mask and device skips that route (until ``set_attention_backend``); other
shapes still try it.  An error in a route's backward comes from torch's
autograd and is not caught; nor is one of "torch_fp32" (nothing to fall
back to).
Layouts: SDPA takes [b, h, s, d]; q, k and v go in as permuted views (bshd
``transpose(1, 2)``, sbhd ``permute(1, 2, 0, 3)``, copied only when the
head dim is not unit-stride or, on CUDA, the start is not 16-byte aligned or
another stride is not a multiple of 8 elements: ``kernel_layout`` in _args.py,
the rule of every route, seqfuse's included), with ``scale=softmax_scale`` (1/sqrt(d) when
None) and ``is_causal``; the output is permuted back to the caller's layout
and copied only when that view is not contiguous.  Its shape and dtype are
the seqfuse path's: no autocast cast (seqfuse's kernels take none either):
SDPA runs with torch.autocast off, and torch's cuDNN op, called directly
where SDPA would pick it (``_sdpa``), has no autocast kernel (checked once,
``_direct_cudnn_ok``; a torch that gave it one would take the SDPA path).
``sdpa_kernel`` sets torch's process-wide SDPA backend flags while SDPA runs
and while SDPA's choice is first asked for a shape: another thread calling
SDPA at that moment sees them.
"""
import logging
import os
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ... import _C
from .. import device_checks
from .._call import as_float, capability_of
from . import _cudnn_ragged as ragged
from . import _torch_routes as routes
from ..device_checks import sequence_facts, uniform_length
from ._args import (FORMATS, MASKS, PADDING, capability_refusal, check_tensor, kernel_layout, kernel_refusal,
                    mask_code, refusal, window_pair)

_log = logging.getLogger("seqfuse")


# ------------------------------------------------------------ kernel choice on Hopper
_forward_reasons_logged = set()
_backward_reasons_logged = set()
# (head dim, device index[, deterministic]) keys whose kernel choice was already
# looked at since the choice last changed: each direction asks C once per key, not per call
_forward_kernel_checked = set()
_backward_kernel_checked = set()


# direction -> (environment variable, _C setter name); a direction leaves
# _kernel_env_pending once its variable was applied or a setter overrode it
_KERNEL_ENV = {"forward": ("SEQFUSE_ATTN_FORWARD_KERNEL", "attn_set_forward_kernel"),
               "backward": ("SEQFUSE_ATTN_BACKWARD_KERNEL", "attn_set_backward_kernel")}
_KERNEL_ENV_VALUES = {"sm90": 90, "sm80": 80}
_kernel_env_pending = set(_KERNEL_ENV)
# the variables' former names: a job script that still sets one would
# otherwise be ignored without a word, so it is refused, naming the new one
_KERNEL_ENV_FORMER = {"SEQFUSE_ATTN_FWD_KERNEL": "SEQFUSE_ATTN_FORWARD_KERNEL",
                      "SEQFUSE_ATTN_BWD_KERNEL": "SEQFUSE_ATTN_BACKWARD_KERNEL"}


def _apply_kernel_env(direction):
    """Hands the direction's environment variable to the C library, once
    (a bad value raises here, at every question, until it is fixed)."""
    if direction not in _kernel_env_pending:
        return
    name, setter = _KERNEL_ENV[direction]
    for former, now in _KERNEL_ENV_FORMER.items():
        if now == name and former in os.environ:
            raise ValueError(f"{former} is now spelled {now}: set {now} instead and unset {former}")
    raw = os.environ.get(name, "")
    value = raw.strip()
    if value:
        if value not in _KERNEL_ENV_VALUES:
            raise ValueError(f"{name} must be 'sm90' or 'sm80', got {raw!r}")
        getattr(_C, setter)(_KERNEL_ENV_VALUES[value])
    _kernel_env_pending.discard(direction)


def set_attention_forward_kernel(arch):
    """Forward kernel on Hopper: 90 (wgmma) or 80 (mma.sync), for the process
    (overrides SEQFUSE_ATTN_FORWARD_KERNEL)."""
    _C.attn_set_forward_kernel(arch)
    _kernel_env_pending.discard("forward")
    _forward_kernel_checked.clear()


def set_attention_backward_kernel(arch):
    """Backward kernel on Hopper: 90 (wgmma) or 80 (mma.sync), for the process
    (overrides SEQFUSE_ATTN_BACKWARD_KERNEL)."""
    _C.attn_set_backward_kernel(arch)
    _kernel_env_pending.discard("backward")
    _backward_kernel_checked.clear()


def _device_index(device):
    index = torch.cuda.current_device() if device is None else torch.device(device).index
    return 0 if index is None else index


def attention_forward_kernel(head_dim, device=None, dropout=False):
    """(arch, reason): the CUDA forward kernel a call with this head dim (and
    dropout or not) takes on ``device`` (default: the current CUDA device);
    reason is "" when it is 90 or when the device is not Hopper."""
    _apply_kernel_env("forward")
    return _C.attn_forward_kernel_for(head_dim, _device_index(device), int(bool(dropout)))


def attention_backward_kernel(head_dim, device=None, deterministic=False, dropout=False):
    """(arch, reason): the CUDA backward kernel a call with this head dim,
    deterministic flag and dropout takes on ``device``, as ``attention_forward_kernel``."""
    _apply_kernel_env("backward")
    return _C.attn_backward_kernel_for(head_dim, _device_index(device), bool(deterministic), int(bool(dropout)))


def _note_kernel(direction, key, kernel_for, checked, logged):
    """Log once per reason when a Hopper device gets an sm80 kernel."""
    _apply_kernel_env(direction)
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


def note_forward_kernel(q, dropout=False):
    _note_kernel("forward", (q.shape[-1], q.device.index or 0, int(bool(dropout))), _C.attn_forward_kernel_for,
                 _forward_kernel_checked, _forward_reasons_logged)


def note_backward_kernel(q, deterministic, dropout=False):
    _note_kernel("backward", (q.shape[-1], q.device.index or 0, bool(deterministic), int(bool(dropout))),
                 _C.attn_backward_kernel_for, _backward_kernel_checked, _backward_reasons_logged)



# ------------------------------------------------------------ backend choice
BACKENDS = ("auto", "seqfuse", "cudnn", "flash", "cudnn_ragged")
_BACKEND_LIST = ", ".join(repr(b) for b in BACKENDS)
_ENV = "SEQFUSE_ATTN_BACKEND"
_backend = None  # the process's choice; None until the first call reads the environment
# whether auto may try the cudnn_ragged route (_cudnn_ragged.py): off unless switched on
_RAGGED_ENV = "SEQFUSE_ATTN_CUDNN_RAGGED"
_ragged_on = None  # the provider auto may use ("torch", "frontend"), False: off; None until the environment is read
_ROUTE_WORDS = {"cudnn": "cuDNN fused attention", "flash": "torch's FlashAttention",
                "cudnn_ragged": "cuDNN's ragged fused attention"}
_ragged_support = {}  # provider -> its op is there, "cudnn" -> torch's cuDNN version: each asked once
_RAGGED_VALUES = {"0": False, "1": "torch", "torch": "torch", "frontend": "frontend"}
# what SDPA may run on the cudnn route (CPU tests point it at MATH to run the route there); only while it is
# _CUDNN_ONLY may the route call torch's cuDNN op itself (_sdpa)
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION]
_CUDNN_ONLY = [SDPBackend.CUDNN_ATTENTION]
# the argument names _sdpa passes torch's cuDNN op by position (SDPA's call of it, torch 2.5 to 2.15)
_CUDNN_OP_ARGS = ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
                  "return_debug_mask", "scale"]
_direct_cudnn = []  # [whether _sdpa may call torch's cuDNN op itself], decided once (_direct_cudnn_ok)
_CUDNN_CAPABILITY = (9, 0)
_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
_CUDNN_MASKS = ("no_mask", "causal", "causal_bottom_right")
_CUDNN_MAX_DIM = 65535  # torch's cuDNN attention takes batch and heads up to this
# cuDNN versions (torch.backends.cudnn.version(), inclusive) on which torch refuses dropout in cuDNN attention
# (torch's test: 91100 < version < 91400)
_CUDNN_DROPOUT_BROKEN = (91101, 91399)
# auto sends dropout to cuDNN from this head dim: on an H200 (bench_routes_dropout_s32_ce1d594, forward+backward,
# 16 x 1024 tokens, 20 heads) cuDNN's dropout took 1.53 ms against FlashAttention-2's 1.63 at head dim 64 and
# 1.66 against 1.88 at 128 (4 x 2048, 16 heads), but 1.44 against 1.20 at 32 and 1.43 against 1.25 at 16.
# Forward-only calls take the same route as training calls (the kernels alone: cuDNN 0.52 ms, FlashAttention-2
# 0.53 at head dim 64; equal at 128), so a recompute draws its mask where the forward drew it
_CUDNN_DROPOUT_MIN_HEAD_DIM = 64
_TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}
# a thd call's mask (its padding code) as the mask of the same call viewed as bshd, every sequence full
_UNIFORM_MASK = {1: "no_mask", 3: "causal", 5: "causal_bottom_right"}
_FROM_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}
_choices = {}         # call key -> (backend, rule, reason); emptied past _MAX_CHOICES keys
_MAX_CHOICES = 4096
_cudnn_picked = {}    # SDPA's cuDNN choice per shapes, strides and flags (_torch_picks_cudnn)
_route_failed = {}    # (route, shapes, strides, dtype, mask, device) -> torch's error, in auto
_logged = set()       # reasons already logged at INFO


def _read_backend():
    """The process's backend: set_attention_backend's, else the environment's
    (read once; a bad value raises here, at every call, until it is fixed)."""
    global _backend
    if _backend is None:
        _backend = _env_choice(_ENV, "auto", BACKENDS, f"one of {_BACKEND_LIST}")
    return _backend


def _env_choice(name, default, allowed, rule):
    """The environment variable ``name`` (stripped; unset or empty is
    ``default``), or a ValueError naming it and ``rule`` when its value is
    not in ``allowed``."""
    raw = os.environ.get(name, "")
    value = raw.strip() or default
    if value not in allowed:
        raise ValueError(f"{name} must be {rule}, got {raw!r}")
    return value


def set_attention_backend(name):
    """Attention backend of ``attention`` for the process: "auto", "seqfuse",
    "cudnn", "flash" or "cudnn_ragged" (overrides SEQFUSE_ATTN_BACKEND; see
    the module docstring).  Also forgets the calls whose torch route failed
    in auto."""
    global _backend
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"set_attention_backend: argument 'name' must be one of {_BACKEND_LIST}, got {name!r}")
    _backend = name
    _choices.clear()
    _cudnn_picked.clear()
    _route_failed.clear()


def _read_ragged():
    """The provider auto may take the cudnn_ragged route with ("torch" or
    "frontend"), or None (off): set_attention_cudnn_ragged's choice, else
    SEQFUSE_ATTN_CUDNN_RAGGED (read once; unset, empty or "0" is off, "1"
    or "torch" torch's op, "frontend" nvidia-cudnn-frontend's; any other
    value raises here, at every question, until it is fixed)."""
    global _ragged_on
    if _ragged_on is None:
        _ragged_on = _RAGGED_VALUES[_env_choice(_RAGGED_ENV, "0", _RAGGED_VALUES, "'0', '1', 'torch' or 'frontend'")]
    return _ragged_on or None


def _ragged_provider(mode):
    """The provider of a call routed to cudnn_ragged under ``mode``: the
    opt-in's, or torch's op when the route is forced without one."""
    return _read_ragged() or "torch" if mode == "cudnn_ragged" else _read_ragged()


def set_attention_cudnn_ragged(enabled, provider="torch"):
    """Let auto try the cudnn_ragged route (cuDNN's variable-length attention
    for packed thd batches, _cudnn_ragged.py) before the flash route:
    ``enabled`` True or False, for the process (overrides
    SEQFUSE_ATTN_CUDNN_RAGGED); ``provider`` "torch" (torch's private op)
    or "frontend" (the nvidia-cudnn-frontend package's op, where installed),
    also the provider a forced cudnn_ragged backend uses.  Returns the
    previous provider, or None when the route was off.  Off by default: see
    the module docstring."""
    global _ragged_on
    if not isinstance(enabled, bool):
        raise TypeError(f"set_attention_cudnn_ragged: argument 'enabled' must be a bool, got "
                        f"{type(enabled).__name__}")
    if not isinstance(provider, str) or provider not in ragged.PROVIDERS:
        raise ValueError(f"set_attention_cudnn_ragged: argument 'provider' must be 'torch' or 'frontend', got "
                         f"{provider!r}")
    try:
        previous = _read_ragged()
    except ValueError:  # a bad SEQFUSE_ATTN_CUDNN_RAGGED: this call overrides it
        previous = None
    _ragged_on = provider if enabled else False
    _choices.clear()
    _cudnn_picked.clear()
    _route_failed.clear()
    return previous


def _cudnn_version():
    """torch's cuDNN version (torch.backends.cudnn.version()) or None, asked once."""
    if "cudnn" not in _ragged_support:
        try:
            _ragged_support["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() \
                else None
        except RuntimeError:  # a torch whose cuDNN cannot be loaded
            _ragged_support["cudnn"] = None
    return _ragged_support["cudnn"]


def _ragged_supported(provider):
    """(the provider's op is there, torch's cuDNN version or None), each
    asked once (the frontend package is imported only when asked for)."""
    if provider not in _ragged_support:
        _ragged_support[provider] = ragged.op_available() if provider == "torch" else \
            ragged.frontend_sdpa() is not None
    return _ragged_support[provider], _cudnn_version()


def _ragged_facts(q, k, qkv_format, cu_q, cu_k, max_seqlen_q, max_seqlen_kv):
    """(covered, longest q sequence, longest k/v sequence) of a CUDA thd
    call from the cu_seqlens facts the check already read (no extra
    synchronization; device_checks.sequence_facts), else None.  covered:
    every q and k/v token lies inside a sequence, there is at least one,
    and, with separate cu_seqlens for q and kv, no key sequence is empty."""
    if qkv_format != "thd" or not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or \
            q.dim() != 3 or k.dim() != 3 or cu_q is None or cu_k is None:
        return None
    if _device_facts(q.device)[0] != "cuda":
        return None  # no cuDNN there: not worth reading the lengths
    given = [m if isinstance(m, int) and not isinstance(m, bool) else None for m in (max_seqlen_q, max_seqlen_kv)]
    fq = sequence_facts(cu_q, given[0])
    fk = fq if cu_k is cu_q and given[1] == given[0] else sequence_facts(cu_k, given[1])
    if fq is None or fk is None:
        return None
    covered = fq[0] == q.shape[0] and fk[0] == k.shape[0] and q.shape[0] >= 1 and (cu_k is cu_q or fk[1] >= 1)
    return covered, fq[2], fk[2]


def _ragged_rule(mode, provider, q, k, qkv_format, attn_mask_type, window, p, deterministic, switches, same_cu,
                 facts):
    """(rule, reason) of the cudnn_ragged route for one call (ragged_eligibility
    with the facts of this process's torch and the provider's)."""
    cudnn_enabled, _, det_algos, capturing, needs_grad = switches
    device_type, capability = _device_facts(q.device)
    op_present, cudnn_version = _ragged_supported(provider)
    return ragged.ragged_eligibility(
        device_type, capability, qkv_format, attn_mask_type, window, p, bool(deterministic), q.dtype,
        q.shape[-2], k.shape[-2], q.shape[-1], cudnn_enabled, same_cu=same_cu,
        covered=None if facts is None else facts[0], needs_grad=needs_grad, capturing=capturing,
        cudnn_version=cudnn_version, op_present=op_present, backward_trusted=ragged.ragged_backward_trusted(),
        check_capability=mode == "auto", deterministic_algorithms=det_algos, provider=provider)


def cudnn_eligibility(device_type, capability, qkv_format, attn_mask_type, s_q, s_kv, window_size, dropout_p,
                      deterministic, dtype, heads_q, heads_kv, head_dim, cudnn_enabled, *,
                      cu_seqlens=False, check_capability=True, batch=1, deterministic_algorithms=False,
                      explicit_rng=False, cudnn_version=None):
    """(rule, reason) for one call's facts: rule is "" when the call may run
    cuDNN fused attention, else the first rule it breaks (the module
    docstring's order), and reason says "rule: why".  Pure: no tensors, no
    device queries.  ``capability`` is (major, minor) or None; ``window_size``
    None or (left, right); ``cu_seqlens``: whether cu_seqlens were given;
    ``check_capability`` False skips the capability rule (forced "cudnn");
    ``deterministic_algorithms``: torch.use_deterministic_algorithms is on
    (not warn-only), under which torch refuses cuDNN attention;
    ``explicit_rng``: the call passes its own rng_state; ``cudnn_version``:
    torch.backends.cudnn.version() (None: unknown), which decides whether a
    call with dropout may go (with ``check_capability``, at head dims of 64
    and more only: where it measured faster).  The answer never depends on
    grad mode for a dropout call: a recompute (reentrant checkpoint) must
    draw its mask on the route the forward drew it on."""
    if qkv_format not in _TO_BHSD:
        return refusal("qkv_format", f"qkv_format {qkv_format!r}; the cuDNN route takes padded bshd or sbhd only")
    if attn_mask_type in MASKS and MASKS[attn_mask_type] in PADDING:
        return refusal("padding", f"attn_mask_type {attn_mask_type!r} is a padding mask")
    if cu_seqlens:
        return refusal("padding", "cu_seqlens given (padded sequences)")
    if attn_mask_type not in _CUDNN_MASKS:
        return refusal("attn_mask_type", f"attn_mask_type {attn_mask_type!r} is not one of {list(_CUDNN_MASKS)}")
    causal = attn_mask_type != "no_mask"
    if s_q != s_kv:
        return refusal("lengths", f"s_q {s_q} != s_kv {s_kv} (SDPA's is_causal is top-left; only equal lengths "
                                  "are taken)")
    if s_kv < 2:
        return refusal("lengths", f"sequence length {s_kv} (torch's cuDNN attention takes key lengths >= 2)")
    if batch > _CUDNN_MAX_DIM or heads_q > _CUDNN_MAX_DIM:
        return refusal("lengths", f"batch {batch} or {heads_q} heads above {_CUDNN_MAX_DIM} (torch's cuDNN limit)")
    window = (-1, -1) if window_size is None else tuple(window_size)
    if window != (-1, -1) and not (causal and window == (-1, 0)):
        return refusal("window", f"window_size {window_size!r} (only None, (-1, -1), or (-1, 0) with a causal mask)")
    if dropout_p != 0.0:
        if explicit_rng:
            return refusal("dropout", f"dropout_p {dropout_p} with an explicit rng_state, which asks for seqfuse's "
                                      "Philox dropout mask")
        if cudnn_version is None:
            return refusal("dropout", f"dropout_p {dropout_p} and the cuDNN version unknown (torch takes cuDNN "
                                      "attention with dropout except on cuDNN 9.11-9.13)")
        if _CUDNN_DROPOUT_BROKEN[0] <= cudnn_version <= _CUDNN_DROPOUT_BROKEN[1]:
            return refusal("dropout", f"dropout_p {dropout_p} and cuDNN {cudnn_version} (torch refuses dropout in "
                                      "cuDNN attention on cuDNN 9.11-9.13)")
        if check_capability and head_dim < _CUDNN_DROPOUT_MIN_HEAD_DIM:
            return refusal("dropout", f"dropout_p {dropout_p} at head dim {head_dim} (cuDNN's dropout measured "
                                      f"slower than FlashAttention-2's on an H200 below head dim "
                                      f"{_CUDNN_DROPOUT_MIN_HEAD_DIM})")
    if broken := kernel_refusal("cuDNN", deterministic, deterministic_algorithms, dtype, heads_q, heads_kv, head_dim,
                                dtypes=_CUDNN_DTYPES, max_head_dim=128,
                                deterministic_why="torch does not guarantee a deterministic cuDNN backward",
                                algorithms_why="torch refuses cuDNN attention"):
        return broken
    if device_type != "cuda":
        return refusal("device", f"{device_type} tensors (cuDNN fused attention is CUDA only)")
    if check_capability and (broken := capability_refusal(capability, _CUDNN_CAPABILITY,
                                                          "cuDNN attention is taken in auto only on 9.0, where "
                                                          "it was measured faster")):
        return broken
    if not cudnn_enabled:
        return refusal("cudnn_sdp_enabled", "torch.backends.cuda.cudnn_sdp_enabled() is False")
    return "", ""


def _device_facts(device):
    """(device type, capability or None), the capability asked once per device (_call.capability_of)."""
    return device.type, capability_of(device)


def _inputs_problem(q, k, v, qkv_format, code, cu_q, cu_k):
    """Why q, k, v and the cu_seqlens cannot go to a torch route as given
    (seqfuse's checks then report it), or None."""
    rank = 3 if qkv_format == "thd" else 4
    if q.dim() != rank or k.dim() != rank or v.dim() != rank:
        return f"q, k and v are not all {rank}-D"
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        return "q, k and v differ in dtype or device"
    if k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        return "k and v differ in shape, or q and k in head dim"
    if qkv_format != "thd" and q.shape[qkv_format == "sbhd"] != k.shape[qkv_format == "sbhd"]:
        return "q and k differ in batch size"
    if qkv_format == "thd" or code in PADDING:
        if cu_q is None or cu_k is None:
            return "cu_seqlens_q and cu_seqlens_kv are needed"
        for cu in (cu_q, cu_k):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or \
                    cu.device != q.device or cu.numel() < 2:
                return "cu_seqlens must be int32 1-D tensors of at least 2 elements on q's device"
        if cu_q.numel() != cu_k.numel():
            return "cu_seqlens_q and cu_seqlens_kv differ in length"
        if qkv_format != "thd" and cu_q.numel() != q.shape[qkv_format == "sbhd"] + 1:
            return "cu_seqlens must have b+1 elements"
    return None


def _decide(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_q, cu_k,
            explicit_rng, switches, uniform=None, ragged_provider=None, ragged_facts=None):
    """(backend, rule, reason) of one call key; bad argument values raise as
    the seqfuse path would.  ``switches``: (cudnn_sdp_enabled,
    flash_sdp_enabled, deterministic algorithms on, capturing, needs_grad);
    ``uniform``: L when the call is thd and its one cu_seqlens splits every
    token into sequences of length L (``_uniform``), else None;
    ``ragged_provider``: the cudnn_ragged route's provider where the mode
    may take it ("torch", "frontend"), else None; ``ragged_facts``:
    ``_ragged_facts`` of the call (None: not known)."""
    cudnn_enabled, flash_enabled, det_algos, capturing, needs_grad = switches
    if qkv_format not in FORMATS:
        raise ValueError(f"attention: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
    code = mask_code(attn_mask_type, qkv_format)
    window = window_pair(window_size)
    p = as_float("attention", "dropout_p", dropout_p)
    bad = _inputs_problem(q, k, v, qkv_format, MASKS[attn_mask_type], cu_q, cu_k)
    if bad is not None:
        return "seqfuse", "inputs", f"inputs: {bad} (seqfuse's checks report it)"
    if qkv_format in _TO_BHSD:
        s_dim = 1 if qkv_format == "bshd" else 0
        s_q, s_kv, batch = q.shape[s_dim], k.shape[s_dim], q.shape[1 - s_dim]
    else:
        s_q = s_kv = batch = None
    device_type, capability = _device_facts(q.device)
    d, hq, hk = q.shape[-1], q.shape[-2], k.shape[-2]
    dtype = str(q.dtype).replace("torch.", "")
    same_cu = cu_q is not None and cu_q is cu_k
    ragged_why = f"thd {attn_mask_type} d={d} {dtype}{' gqa' if hq != hk else ''} runs cuDNN's ragged fused " \
                 "attention through " + ("torch.ops.aten._cudnn_attention_forward" if ragged_provider == "torch"
                                         else "nvidia-cudnn-frontend's cudnn.sdpa_torch")
    if mode == "cudnn_ragged":
        r_rule, r_reason = _ragged_rule(mode, ragged_provider, q, k, qkv_format, attn_mask_type, window, p,
                                        deterministic, switches, same_cu, ragged_facts)
        return ("cudnn_ragged", "", ragged_why) if not r_rule else ("seqfuse", r_rule, r_reason)
    # the facts both cuDNN questions below share (the call as given, and a uniform thd call as bshd)
    shared = dict(check_capability=mode == "auto", deterministic_algorithms=det_algos, explicit_rng=explicit_rng,
                  cudnn_version=_cudnn_version() if p > 0.0 else None)
    rule, reason = cudnn_eligibility(device_type, capability, qkv_format, attn_mask_type, s_q, s_kv, window, p,
                                     bool(deterministic), q.dtype, hq, hk, d, cudnn_enabled,
                                     cu_seqlens=cu_q is not None or cu_k is not None, batch=batch, **shared)
    if uniform and mode in ("auto", "cudnn"):
        # a packed batch of b sequences all of length L is the padding-free [b, L] batch
        b = q.shape[0] // uniform
        u_rule, u_reason = cudnn_eligibility(device_type, capability, "bshd", _UNIFORM_MASK[code], uniform,
                                             uniform, window, p, bool(deterministic), q.dtype, hq, hk, d,
                                             cudnn_enabled, batch=b, **shared)
        if not u_rule:
            return "cudnn", "", f"thd {attn_mask_type} d={d} {dtype}{' gqa' if hq != hk else ''}" \
                                f"{' dropout' if p > 0.0 else ''}, every sequence " \
                                f"{uniform} tokens long, runs cuDNN fused attention through torch SDPA as bshd " \
                                f"[{b}, {uniform}]"
        reason = f"{reason} (as bshd [{b}, {uniform}], every sequence {uniform} tokens long: {u_reason})"
    if mode in ("auto", "cudnn"):
        if not rule:
            return "cudnn", "", f"{qkv_format} {attn_mask_type} d={d} {dtype}{' gqa' if hq != hk else ''}" \
                                f"{' dropout' if p > 0.0 else ''} runs cuDNN fused attention through torch SDPA"
        if mode == "cudnn":
            return "seqfuse", rule, reason
    if mode == "auto" and ragged_provider and qkv_format == "thd":
        r_rule, r_reason = _ragged_rule(mode, ragged_provider, q, k, qkv_format, attn_mask_type, window, p,
                                        deterministic, switches, same_cu, ragged_facts)
        if not r_rule:
            return "cudnn_ragged", "", ragged_why
        reason = f"{reason}; cudnn_ragged route: {r_reason}"
    f_rule, f_reason = routes.flash_eligibility(
        device_type, capability, qkv_format, attn_mask_type, p, bool(deterministic), q.dtype, hq, hk, d,
        flash_enabled, s_q=s_q, s_kv=s_kv, same_cu=same_cu, explicit_rng=explicit_rng,
        check_capability=mode == "auto", deterministic_algorithms=det_algos, needs_grad=needs_grad)
    if not f_rule:
        extra = "".join(x for x, on in ((" gqa", hq != hk), (" window", window != (-1, -1)),
                                        (" dropout", 0.0 < p)) if on)
        return "flash", "", f"{qkv_format} {attn_mask_type} d={d} {dtype}{extra} runs torch's FlashAttention-2"
    if mode == "flash":
        return "seqfuse", f_rule, f_reason
    reason = f"{reason}; flash route: {f_reason}"
    if q.dtype == torch.float32 and device_type == "cuda":
        p_rule, p_reason = routes.fp32_eligibility(device_type, qkv_format, q.dtype, p,
                                                   explicit_rng=explicit_rng, capturing=capturing)
        if not p_rule:
            return "torch_fp32", "", f"{qkv_format} {attn_mask_type} d={d} float32 on CUDA runs torch SDPA " \
                                     "(memory-efficient or math kernels)"
        return "seqfuse", "torch_fp32", f"torch_fp32: float32 on CUDA runs only on torch's kernels, and this " \
                                        f"call cannot: {p_reason}"
    return "seqfuse", rule, reason


def _uniform(q, k, qkv_format, cu_q, cu_k, max_seqlen_q):
    """L when a thd call's one cu_seqlens tensor (the same object for q and
    kv, k as long as q) splits all of q's tokens into sequences of length L,
    else None (device_checks.uniform_length: the facts the cu_seqlens check
    already read, no extra synchronization)."""
    if qkv_format != "thd" or cu_q is None or cu_q is not cu_k or not isinstance(q, torch.Tensor) or \
            not isinstance(k, torch.Tensor) or q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0]:
        return None
    if _device_facts(q.device)[0] != "cuda":
        return None  # no cuDNN there: not worth reading the lengths
    max_len = max_seqlen_q if isinstance(max_seqlen_q, int) and not isinstance(max_seqlen_q, bool) else None
    return uniform_length(cu_q, q.shape[0], max_len)


def _choose(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_seqlens_q,
            cu_seqlens_kv, rng_state=None, max_seqlen_q=None, max_seqlen_kv=None):
    """(backend, rule, reason) of one call under ``mode``; forced "cudnn",
    "flash" or "cudnn_ragged" raises NotImplementedError where a rule (other
    than "inputs") is broken, as does a float32 CUDA call no route takes."""
    if mode == "seqfuse":
        return "seqfuse", "", f"backend 'seqfuse' chosen ({_ENV} or set_attention_backend)"
    cudnn_enabled = torch.backends.cuda.cudnn_sdp_enabled()
    flash_enabled = torch.backends.cuda.flash_sdp_enabled()
    det_algos = torch.are_deterministic_algorithms_enabled() and \
        not torch.is_deterministic_algorithms_warn_only_enabled()
    capturing = device_checks.capturing(q)
    needs_grad = _needs_grad(q, k, v)
    switches = (cudnn_enabled, flash_enabled, det_algos, capturing, needs_grad)
    explicit_rng = rng_state is not None
    window = tuple(window_size) if isinstance(window_size, list) else window_size
    cus = tuple(None if c is None else (c.dtype, tuple(c.shape), c.device) if isinstance(c, torch.Tensor)
                else type(c) for c in (cu_seqlens_q, cu_seqlens_kv))
    uniform = _uniform(q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q)
    provider = _ragged_provider(mode) if mode in ("auto", "cudnn_ragged") else None
    facts = _ragged_facts(q, k, qkv_format, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv) \
        if provider else None
    key = (mode, q.device, qkv_format, attn_mask_type, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
           window, dropout_p, bool(deterministic), cus, cu_seqlens_q is not None and cu_seqlens_q is cu_seqlens_kv,
           explicit_rng, switches, uniform, provider, facts)
    try:
        hit = _choices.get(key)
    except TypeError:  # an unhashable argument: _decide names it
        hit, key = None, None
    if hit is None:
        hit = _decide(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic,
                      cu_seqlens_q, cu_seqlens_kv, explicit_rng, switches, uniform, provider, facts)
        if key is not None:
            if len(_choices) >= _MAX_CHOICES:
                _choices.clear()
            _choices[key] = hit
    name, rule, reason = hit
    if mode in _ROUTE_WORDS:
        if name != mode and rule != "inputs":
            route = _ROUTE_WORDS[mode]
            raise NotImplementedError(f"attention: backend {mode!r} was chosen ({_ENV} or set_attention_backend) "
                                      f"but this call cannot run {route}: {reason}")
    elif rule == "torch_fp32":
        raise NotImplementedError(f"attention: {reason}")
    elif name in _ROUTE_WORDS and _route_failed:
        error = _route_failed.get(_failure_key(name, q, k, attn_mask_type, as_float("attention", "dropout_p",
                                                                                     dropout_p)))
        if error is not None:
            return "seqfuse", f"{name}_failed", f"{name}_failed: {name} failed earlier on these shapes, strides, " \
                                                f"dtype, mask and device: {error}"
    return hit


def _failure_key(route, q, k, attn_mask_type, dropout_p):
    """What a torch route's failure in auto is remembered by: the route and
    the call's shapes, strides, dtype, mask and device (one odd call does
    not turn the route off for every other shape)."""
    return (route, q.dtype, tuple(q.shape), tuple(k.shape), q.stride(), k.stride(), attn_mask_type, q.device,
            dropout_p > 0.0)


def attention_backend(q, k, v, qkv_format="bshd", attn_mask_type="no_mask", window_size=None, dropout_p=0.0,
                      deterministic=False, cu_seqlens_q=None, cu_seqlens_kv=None, rng_state=None, *,
                      max_seqlen_q=None, max_seqlen_kv=None, softmax_scale=None):
    """(name, reason): the route ("seqfuse", "cudnn", "flash",
    "cudnn_ragged" or "torch_fp32") an ``attention`` call with these
    arguments takes under the process's choice, and why (for a call that stays on seqfuse, "rule: why"
    naming the first rule broken of each torch route looked at).  Raises
    what the call would: ValueError for a bad SEQFUSE_ATTN_BACKEND or
    argument value, NotImplementedError for a call the forced backend cannot
    run, or a float32 CUDA call no route takes.  ``max_seqlen_q`` and
    ``max_seqlen_kv`` change the choice only as keys of the cached
    cu_seqlens facts; ``softmax_scale`` does not change it; they are taken so
    that an ``attention`` call's keywords can be passed as they are."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x)
    name, _, reason = _choose(_read_backend(), q, k, v, qkv_format, attn_mask_type, window_size, dropout_p,
                              deterministic, cu_seqlens_q, cu_seqlens_kv, rng_state, max_seqlen_q, max_seqlen_kv)
    return name, reason


def _needs_grad(q, k, v):
    """Whether autograd will want gradients of q, k or v (torch's own test
    for SDPA's log-sum-exp, should_compute_logsumexp)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _sdpa(q, k, v, qkv_format, causal, scale, dropout_p=0.0):
    """SDPA on the permuted views, restricted to _SDPA_BACKENDS; the output
    back in the caller's layout.  Fewer k/v heads than q heads go in as they
    are (``enable_gqa``: cuDNN reads each k/v head for its group of q heads;
    measured on an H200 with torch 2.11 at Llama 3.2 1B's 4 x 8192 causal
    attention, 32 q / 8 k/v heads of 64, forward+backward: 8.96 ms against
    9.37 ms with k/v expanded first and 14.65 ms on FlashAttention-2).
    On CUDA, where SDPA's own choice for these views under
    ``sdpa_kernel([CUDNN_ATTENTION])`` is cuDNN (``_torch_picks_cudnn``,
    asked once per shape, strides and flags), the call goes straight to the
    op SDPA would call, ``_cudnn_attention``, with SDPA's arguments: the same
    kernels and autograd node without the backend context, the autocast
    context and the dispatcher's checks, which cost about 45 us of host work
    a call on the H200's host (benchmarks/attn/host_probe.py: a forward call
    52-57 us this way, 95-106 us through SDPA under both contexts).  (The
    route takes CUDA tensors only: cudnn_eligibility's ``device`` rule.)"""
    q, k, v = (kernel_layout(x) for x in (q, k, v))  # aligned 16-byte rows, or a copy
    if qkv_format == "bshd":  # (a transpose costs the host less than the same permute)
        qb, kb, vb = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    else:
        to = _TO_BHSD[qkv_format]
        qb, kb, vb = q.permute(to), k.permute(to), v.permute(to)
    gqa = q.shape[-2] != k.shape[-2]
    needs_grad = _needs_grad(q, k, v)
    if _SDPA_BACKENDS == _CUDNN_ONLY and _direct_cudnn_ok() and \
            _torch_picks_cudnn(qb, kb, vb, causal, scale, dropout_p, gqa, needs_grad):
        out = _cudnn_attention(qb, kb, vb, None, needs_grad, dropout_p, causal, False, scale=scale)[0]
    else:
        extra = {"enable_gqa": True} if gqa else {}
        if dropout_p > 0.0:
            extra["dropout_p"] = dropout_p
        with sdpa_kernel(_SDPA_BACKENDS), torch.autocast(q.device.type, enabled=False):
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=scale, **extra)
    out = out.transpose(1, 2) if qkv_format == "bshd" else out.permute(_FROM_BHSD[qkv_format])
    return out if out.is_contiguous() else out.contiguous()


def _direct_cudnn_ok():
    """Whether this torch lets _sdpa call its cuDNN op itself, decided once:
    the op takes SDPA's arguments in _CUDNN_OP_ARGS's order, its backend
    choice takes ``enable_gqa`` (torch 2.5 and later), and the op has no
    autocast kernel (so, as under SDPA with autocast off, nothing casts its
    inputs).  Otherwise every call takes the SDPA path."""
    if not _direct_cudnn:
        try:
            op_args = [a.name for a in torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema.arguments]
            choice_args = [a.name for a in torch.ops.aten._fused_sdp_choice.default._schema.arguments]
            autocast = torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_dot_product_cudnn_attention",
                                                                      "AutocastCUDA")
            ok = op_args == _CUDNN_OP_ARGS and "enable_gqa" in choice_args and not autocast and \
                hasattr(torch, "_scaled_dot_product_cudnn_attention")
        except (AttributeError, RuntimeError):  # a torch without the ops or the dispatcher query
            ok = False
        _direct_cudnn.append(ok)
    return _direct_cudnn[0]


def _torch_picks_cudnn(q, k, v, causal, scale, dropout_p, gqa, needs_grad):
    """Whether torch's SDPA, restricted to cuDNN, would run cuDNN attention on
    these [b, h, s, d] views (``torch._fused_sdp_choice``, SDPA's own backend
    choice, under the same ``sdpa_kernel``), remembered per shapes, strides,
    dtype, device, mask, dropout and gradient need (what torch's cuDNN
    checks read; the switches they also read, deterministic algorithms and
    cudnn_sdp_enabled, are rules of the route checked before).  False sends
    the call through SDPA itself, which then runs or refuses it as it
    always did."""
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, q.device, causal, dropout_p > 0.0,
           needs_grad)
    hit = _cudnn_picked.get(key)
    if hit is None:
        with sdpa_kernel(_SDPA_BACKENDS), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's own call warns where it refuses
            try:
                hit = torch._fused_sdp_choice(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                              enable_gqa=gqa) == SDPBackend.CUDNN_ATTENTION.value
            except RuntimeError:  # no backend takes it: SDPA's call raises its error
                hit = False
        if len(_cudnn_picked) >= _MAX_CHOICES:
            _cudnn_picked.clear()
        _cudnn_picked[key] = hit
    return hit


def _cudnn_attention(*args, **kwargs):
    """torch's cuDNN attention op with SDPA's arguments (_CUDNN_OP_ARGS):
    (output, logsumexp, ...).  Differentiable (torch's autograd runs its
    cuDNN backward); the GPU tests spy here."""
    return torch._scaled_dot_product_cudnn_attention(*args, **kwargs)


def _run_route(name, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_q, cu_k,
               max_q, max_k, scale, provider=None):
    p = as_float("attention", "dropout_p", dropout_p)
    if name == "cudnn" and qkv_format == "thd":
        # every sequence L tokens long (_uniform): the [t, h, d] tensors viewed as [t / L, L, h, d]
        length = _uniform(q, k, qkv_format, cu_q, cu_k, max_q)
        b = q.shape[0] // length
        out = _sdpa(*(x.view(b, length, *x.shape[1:]) for x in (q, k, v)), "bshd",
                    _UNIFORM_MASK[MASKS[attn_mask_type] | 1] != "no_mask", scale, p)
        return out.view(q.shape)
    if name == "cudnn":
        return _sdpa(q, k, v, qkv_format, attn_mask_type != "no_mask", scale, p)
    q, k, v = (kernel_layout(x) for x in (q, k, v))  # aligned 16-byte rows, or a copy
    if name == "cudnn_ragged":
        # the longest lengths from the facts the router read (no host read); a given max is kept
        _, longest_q, longest_k = _ragged_facts(q, k, qkv_format, cu_q, cu_k, max_q, max_k)
        max_q = max_q if isinstance(max_q, int) and not isinstance(max_q, bool) else longest_q
        max_k = max_k if isinstance(max_k, int) and not isinstance(max_k, bool) else longest_k
        with torch.autocast(q.device.type, enabled=False):
            return ragged.run_cudnn_ragged(q, k, v, attn_mask_type, scale, cu_q, cu_k, max_q, max_k, provider)
    window = window_pair(window_size)
    if name == "flash":
        with torch.autocast(q.device.type, enabled=False):
            return routes.run_flash(q, k, v, qkv_format, attn_mask_type, window, p, scale, cu_q, cu_k, max_q,
                                    max_k)
    return routes.run_fp32(q, k, v, qkv_format, attn_mask_type, window, p, scale, cu_q, cu_k, bool(deterministic))


def routed_attention_or_none(q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic,
                             cu_seqlens_q, cu_seqlens_kv, softmax_scale, max_seqlen_q=None, max_seqlen_kv=None,
                             rng_state=None):
    """``attention``'s backend step: the output of the torch route the
    process's backend choice sends this call to, else None (seqfuse's
    kernels run it).  Forced "cudnn"/"flash"/"cudnn_ragged" raise for a call
    they cannot run; in auto a RuntimeError of the cudnn, cudnn_ragged or
    flash forward falls back to seqfuse, logged and remembered (see the
    module docstring)."""
    mode = _read_backend()
    if mode == "seqfuse":
        return None
    name, _, reason = _choose(mode, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic,
                              cu_seqlens_q, cu_seqlens_kv, rng_state, max_seqlen_q, max_seqlen_kv)
    if name == "seqfuse":
        return None
    scale = routes.softmax_scale_of(q, softmax_scale)
    args = (name, q, k, v, qkv_format, attn_mask_type, window_size, dropout_p, deterministic, cu_seqlens_q,
            cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale,
            _ragged_provider(mode) if name == "cudnn_ragged" else None)
    if mode == "auto" and reason not in _logged:
        _logged.add(reason)
        _log.info("seqfuse attention: %s (set %s=seqfuse for seqfuse's kernels)", reason, _ENV)
    if mode != "auto" or name == "torch_fp32":
        return _run_route(*args)
    try:
        return _run_route(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except RuntimeError as e:
        error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "CUDA error" in error or "cudaError" in error:  # the context is broken: nothing to fall back to
            raise
        _route_failed[_failure_key(name, q, k, attn_mask_type, as_float("attention", "dropout_p", dropout_p))] = \
            error
        what = {"cudnn": "cuDNN fused attention (torch SDPA)"}.get(name, _ROUTE_WORDS[name])
        _log.warning("seqfuse attention: %s failed on %s %s d=%d %s: %s; this call and later ones of these "
                     "shapes, strides, dtype, mask and device run on seqfuse's kernels",
                     what, qkv_format, attn_mask_type, q.shape[-1], str(q.dtype).replace("torch.", ""), error)
        return None
