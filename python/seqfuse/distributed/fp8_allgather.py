"""FP8 weight all-gather under FSDP2: each rank casts its weight shard to FP8
before FSDP2's all-gather, so the gathered bytes are half of bf16's (a
quarter of fp32's), and the FP8 modules use the gathered FP8 weight as is.

    from seqfuse.distributed import enable_fp8_all_gather
    enable_fp8_all_gather(model, recipe)      # before fully_shard
    for layer in model.layers: fully_shard(layer)
    fully_shard(model)
    with seqfuse.pytorch.autocast(recipe=recipe): loss = model(x).sum()
    loss.backward()

How.  FSDP2's public extension point is a tensor subclass on the sharded
parameter's local tensor with ``fsdp_pre_all_gather`` (what to all-gather)
and ``fsdp_post_all_gather`` (what the unsharded parameter is).  Two
classes here:

  FP8ShardWeight    the sharded parameter's local tensor: the high-precision
                    shard itself (a plain torch subclass over the same
                    storage, not a wrapper), so the optimizer, state_dict,
                    torch.distributed.checkpoint and seqfuse's DLPack calls
                    see ordinary high-precision values.  Its
                    fsdp_pre_all_gather casts the shard to FP8.
  GatheredFP8Weight the unsharded parameter FSDP2 builds after the gather:
                    a wrapper tensor whose dtype is the parameter's (so
                    autograd accumulates a gradient of that dtype and FSDP2
                    reduce-scatters it in the mixed-precision policy's
                    reduce_dtype, unchanged), holding the gathered FP8
                    bytes and their scale.  seqfuse's WeightQuantizer takes
                    the FP8 operands from it instead of casting (the one
                    hook in the modules' path).

The scale agreed across ranks.  Per-tensor recipes (DelayedScaling,
Float8CurrentScaling: seqfuse scales weights from their own amax under both)
take amax = all-reduce MAX of the shards' max|w| over the FSDP mesh, then
scale = fp8_max / amax / 2**margin with the same kernel a single process
uses, then cast the shard.  The cast is elementwise, so the gathered bytes
and scale are bit for bit what one process quantizing the full weight makes.
Float8BlockScaling's 128x128 weight blocks never straddle a shard when every
shard holds a multiple of 128 rows (out_features divisible by 128 x the
FSDP world size); each rank quantizes its own blocks, the block scales are
gathered with the bytes, and again the result is the single process's.
Other shapes are refused (ValueError naming the parameter and the rule).

What the gathered weight is used for.  Under FP8 autocast the modules take
its bytes for the forward GEMM and transpose them for the input-gradient
GEMM (per-tensor) or transpose the blocks (block scaling): no second cast.
FSDP2 also gathers before the backward (reshard_after_forward=True); seqfuse's
FP8 modules saved their weight operands in the forward and only need the
unsharded parameter there as the place the gradient accumulates, so that
gather is FP8 too.  Anything else that reads the gathered weight's values
(a module run outside FP8 autocast, plain torch code) gets it dequantized
(float(fp8) * scale_inv in the parameter's dtype), logged once per operator:
the values then carry FP8 rounding, which is what the FP8 run trains anyway.

Mixed precision.  With MixedPrecisionPolicy(param_dtype=bf16) the shard is
cast to bf16 first and then to FP8, as a single process quantizes the bf16
weight it computes with.  Gradients are produced in the parameter's dtype
and reduce-scattered in reduce_dtype: FSDP2's own path, not touched.

On the wire the FP8 bytes travel as uint8 (torch.uint8 views of the
float8 tensors): gloo has no float8 all-gather, and NCCL moves bytes
either way.  FSDP2 packs a unit's parameters of several dtypes into one
uint8 all-gather, so one collective per unit remains.

Costs.  One extra all-reduce of one float per weight per gather (per-tensor
recipes), issued on FSDP2's copy-in stream before the cast: a few
microseconds each on NVLink, against the gathered bytes halved.  (torchao
can batch these into one all-reduce after the optimizer step; here that
would need a reliable sign that the weights changed, and seqfuse's fused
AdamW writes them through DLPack without moving their version counters.)
The sharded tensors carry a Python __torch_dispatch__ (to keep the subclass
through FSDP2's sharding and DTensor's ops), which adds host time to each
torch op on them: torch optimizers' per-parameter ops pay it, seqfuse's
FusedAdamW reaches their storage in one C call.  The per-forward cast of
each weight becomes a byte transpose (the input-gradient operand).
"""
import logging

import torch

from ..common.recipe import Recipe
from ..ops import quant as qops
from ..quantization.gemm_quantizers import block_weight_transposed, recipe_kind
from ..quantization.tensor import Float8BlockTensor, Float8Tensor

__all__ = ["enable_fp8_all_gather", "FP8ShardWeight", "GatheredFP8Weight", "fp8_all_gather_params",
           "gathered_bytes"]

_log = logging.getLogger("seqfuse")

#: The FP8 GEMM modules' weight parameters, by class name.
_WEIGHTS = {"Linear": ("weight",), "LayerNormLinear": ("weight",),
            "LayerNormMLP": ("fc1_weight", "fc2_weight")}
_HIGH = (torch.float32, torch.bfloat16, torch.float16)


class _Config:
    """How a weight is cast for the gather: recipe kind ("delayed",
    "current", "block"), FP8 dtype, margin; ``name`` for messages."""
    __slots__ = ("kind", "fp8_dtype", "margin", "name")

    def __init__(self, kind, fp8_dtype, margin, name):
        self.kind, self.fp8_dtype, self.margin, self.name = kind, fp8_dtype, margin, name

    def __repr__(self):
        return f"_Config({self.name}: {self.kind}, {self.fp8_dtype}, margin={self.margin})"


def _config_of(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, FP8ShardWeight):
            cfg = a.__dict__.get("_sf_cfg")
            if cfg is not None:
                return cfg
        elif isinstance(a, (list, tuple)):
            cfg = _config_of(a, {})
            if cfg is not None:
                return cfg
    return None


#: aten ops whose results stay FP8ShardWeight: views, detach, device / dtype
#: copies and the new_zeros FSDP2 pads a shard with.  (zeros_like and
#: empty_like are left out: optimizer states made like a weight stay plain.)
_KEEP = {"detach", "alias", "view", "_unsafe_view", "slice", "narrow", "as_strided", "split",
         "split_with_sizes", "chunk", "new_zeros", "new_empty", "_to_copy", "contiguous",
         "_pin_memory", "reshape", "t", "transpose"}


def plain_tensor(t):
    """A plain torch.Tensor over ``t``'s storage (same offset, shape, strides):
    what seqfuse's C calls and torch.save get for an FP8ShardWeight."""
    if type(t) is torch.Tensor:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.size(), t.stride())


_PYTHON_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot)


def _rewrap(out, cls, cfg):
    if isinstance(out, torch.Tensor) and not isinstance(out, cls):
        t = torch.Tensor._make_subclass(cls, out, out.requires_grad)
        t._sf_cfg = cfg
        return t
    if isinstance(out, (list, tuple)):
        return type(out)(_rewrap(o, cls, cfg) for o in out)
    return out


class FP8ShardWeight(torch.Tensor):
    """A high-precision weight (or FSDP2's shard of it) that FSDP2 all-gathers
    in FP8.  Same storage, dtype and values as the tensor it was made from;
    the subclass (and its cast settings) follows every tensor derived from
    it, so FSDP2's chunking, padding and DTensor wrapping keep it."""

    @staticmethod
    def __new__(cls, data, cfg):
        t = torch.Tensor._make_subclass(cls, data, data.requires_grad)
        t._sf_cfg = cfg
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Below autograd (DTensor's own ops on its local tensor, nn.Parameter's
        # detach): run the op on the storage; results that alias or copy the
        # weight (views, detach, new tensors shaped like it) stay this class
        # with the same settings, so FSDP2's DTensor keeps the extension;
        # everything else (arithmetic) gives plain tensors.
        kwargs = kwargs or {}
        with torch._C._ExcludeDispatchKeyGuard(_PYTHON_KEYS):  # the storage's own kernel
            out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name.endswith("_") and args and isinstance(args[0], FP8ShardWeight):
            return args[0]  # in place: the same object
        if name not in _KEEP:
            return out
        cfg = _config_of(args, kwargs)
        return _rewrap(out, cls, cfg) if cfg is not None else out

    def __reduce_ex__(self, proto):
        # saved (torch.save, checkpoints) as the plain high-precision tensor it
        # is: a checkpoint never needs this module to load
        return plain_tensor(self).__reduce_ex__(proto)

    def __repr__(self, *, tensor_contents=None):
        return f"FP8ShardWeight({plain_tensor(self)!r}, {self._sf_cfg!r})"

    # ---- FSDP2's extension point -------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """The FP8 bytes of this rank's shard (uint8 view, padded to FSDP2's
        padded shard rows) and, under block scaling, its block scales;
        metadata: what post_all_gather needs (the agreed scale)."""
        cfg = self._sf_cfg
        shard = plain_tensor(self)
        if shard.dim() != 2 or len(outer_size) != 2:
            raise ValueError(f"FP8 all-gather ({cfg.name}): weights must be 2-D, got shard "
                             f"{tuple(shard.shape)} of {tuple(outer_size)}")
        world = mesh.size()
        rows = int(outer_size[0])
        padded = -(-rows // world)
        dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype else shard.dtype
        x = shard if shard.dtype == dtype else shard.to(dtype)
        if x.dtype not in _HIGH:
            raise TypeError(f"FP8 all-gather ({cfg.name}): the weight must be float32, bfloat16 or "
                            f"float16, got {x.dtype}")
        if cfg.kind == "block":
            if rows % (128 * world):
                raise ValueError(
                    f"FP8 all-gather ({cfg.name}): Float8BlockScaling gathers whole 128x128 weight "
                    f"blocks, so each of the {world} shards must hold a multiple of 128 rows: "
                    f"{rows} rows is not a multiple of 128 x {world} (leave this weight out, or "
                    f"use a per-tensor recipe)")
            data, si = qops.quantize_block_fp8(x.contiguous(), 128, cfg.fp8_dtype)
            return (data.view(torch.uint8), si), (cfg, rows, None, None)
        x = x.contiguous()
        amax = qops.amax(x).reshape(1)
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        scale = torch.empty(1, dtype=torch.float32, device=x.device)
        scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        qops.fp8_compute_scale(amax, scale, scale_inv, qops.FP8_MAX[cfg.fp8_dtype], cfg.margin)
        if x.shape[0] == 0:  # this rank holds no rows (fewer rows than ranks): padding only
            data = torch.zeros((padded, x.shape[1]), dtype=torch.uint8, device=x.device)
        else:
            data = qops.cast_fp8(x, scale, None, cfg.fp8_dtype, rows=padded).view(torch.uint8)
        return (data,), (cfg, rows, amax, scale_inv)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        cfg, rows, amax, scale_inv = metadata
        data = all_gather_outputs[0].view(cfg.fp8_dtype)[:rows]
        if cfg.kind == "block":
            scale_inv = all_gather_outputs[1][:rows // 128]
        if out is not None:  # later gathers refill the parameter FSDP2 made at the first
            target = out._local_tensor if hasattr(out, "_local_tensor") else out
            if not isinstance(target, GatheredFP8Weight):
                raise TypeError(f"FP8 all-gather ({cfg.name}): FSDP2 handed back an unsharded "
                                f"parameter of type {type(target).__name__}, not GatheredFP8Weight")
            target._set(data, scale_inv, amax)
            return None
        return GatheredFP8Weight(data, scale_inv, amax, cfg, param_dtype), tuple(all_gather_outputs)


_aten = torch.ops.aten
_ALIASES = (_aten.detach.default, _aten.alias.default)
_LIKE = (_aten.empty_like.default, _aten.zeros_like.default, _aten.new_zeros.default,
         _aten.new_empty.default, _aten.ones_like.default)
_dequant_logged = set()


class GatheredFP8Weight(torch.Tensor):
    """FSDP2's unsharded parameter under FP8 all-gather: shape and dtype of the
    high-precision weight, holding the gathered FP8 bytes ``_data`` [N, K],
    ``_scale_inv`` (one float, or the 128x128 block scales) and ``_amax``
    (per-tensor: the agreed amax)."""

    @staticmethod
    def __new__(cls, data, scale_inv, amax, cfg, dtype):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=dtype, device=data.device,
                                                requires_grad=False)
        t._cfg = cfg
        t._set(data, scale_inv, amax)
        return t

    def _set(self, data, scale_inv, amax):
        self._data, self._scale_inv, self._amax = data, scale_inv, amax

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return (f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self._cfg.fp8_dtype}, kind={self._cfg.kind})")

    def dequantized(self):
        """float(fp8) * scale_inv in the parameter's dtype (a new tensor):
        what a reader off seqfuse's FP8 GEMM path gets (logged once)."""
        if not _dequant_logged:
            _dequant_logged.add("dequantized")
            _log.warning("seqfuse FP8 all-gather: an FP8-gathered weight (%s) is read outside seqfuse's "
                         "FP8 GEMM path and dequantized (FP8 values x scale, in %s)", self._cfg.name,
                         self.dtype)
        if self._cfg.kind == "block":
            return qops.dequantize_block_fp8(self._data, self._scale_inv, 128, self.dtype)
        return qops.dequantize_fp8(self._data, self._scale_inv, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            return cls._alias(args[0])
        if func is _aten.as_strided.default or func is _aten.view.default:
            t = args[0]
            if tuple(args[1]) == tuple(t.shape) and (func is _aten.view.default
                                                     or tuple(args[2]) == tuple(t.stride())):
                return cls._alias(t)
        if func in _LIKE:  # a new tensor shaped like the weight: no values read
            t = args[0]
            plain = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
            return func(plain, *args[1:], **kwargs)
        if func not in _dequant_logged:
            _dequant_logged.add(func)
            _log.warning("seqfuse FP8 all-gather: %s read an FP8-gathered weight outside seqfuse's FP8 "
                         "GEMM path; it gets the weight dequantized (FP8 values x scale, in the "
                         "parameter's dtype)", func)

        def plain(t):
            return t.dequantized() if isinstance(t, GatheredFP8Weight) else t
        args = tuple(plain(a) for a in args)
        kwargs = {k: plain(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @classmethod
    def _alias(cls, t):
        a = cls(t._data, t._scale_inv, t._amax, t._cfg, t.dtype)
        return a

    # ---- what WeightQuantizer takes ----------------------------------------------

    def sf_fp8_pair(self, quantizer, transposed=True):
        """(forward operand, input-gradient operand) as WeightQuantizer.get
        returns them, from the gathered bytes: the per-tensor Float8Tensor
        with its transposed copy made now, or the block tensor and its
        transposed blocks; with ``transposed`` False (a call that wants no
        gradient, or set_weight_transpose_cache(False), whose backward makes
        W^T itself) the second element is None and no transpose runs.
        Refuses a quantizer whose recipe differs from the one the gather was
        set up for."""
        cfg, o = self._cfg, quantizer.owner
        margin = 0 if o.kind == "block" else o.margin
        if (o.kind == "block") != (cfg.kind == "block") or quantizer.fp8_dtype != cfg.fp8_dtype \
                or margin != cfg.margin:
            raise ValueError(f"FP8 all-gather ({cfg.name}): the weight was gathered for "
                             f"{cfg.kind} scaling in {cfg.fp8_dtype} with margin {cfg.margin}, but "
                             f"the autocast recipe wants {o.kind} scaling in {quantizer.fp8_dtype} "
                             f"with margin {margin}: call enable_fp8_all_gather with the recipe "
                             f"the model runs under")
        if cfg.kind == "block":
            q = Float8BlockTensor(self._data, self._scale_inv, 128, dtype=self.dtype)
            return q, (block_weight_transposed(q) if transposed else None)
        if o.kind == "delayed":  # the weight's amax lands in its state slot, as a cast's does
            slot = o.state.amax_of(quantizer.index)
            torch.maximum(slot, self._amax.reshape(slot.shape), out=slot)
        data = self._data
        data_t = qops.transpose_fp8(data) if transposed else None
        q = Float8Tensor(data, self._scale_inv, cfg.fp8_dtype, data_t=data_t, dtype=self.dtype, shape=data.shape)
        return q, (q if transposed else None)


def _weight_dtype(recipe):
    return recipe.fp8_format.forward_dtype


def enable_fp8_all_gather(model, recipe):
    """Make FSDP2 all-gather the FP8 GEMM weights of ``model`` (Linear,
    LayerNormLinear, LayerNormMLP, as seqfuse.pytorch builds them, at any
    depth) in FP8 under ``recipe``.  Call it before fully_shard, on
    materialized (not meta) parameters; run the model under FP8 autocast
    with the same recipe.  Returns the names of the parameters converted
    (a tied weight once); weights it leaves in high precision are logged
    with the reason.  Tied weights stay tied: a weight shared by several FP8
    modules becomes one converted Parameter in all of them; one also held by
    a module without the FP8 path (an embedding tied to the output Linear)
    is left as it is, in high precision.
    Build the model on the device FSDP2 shards on: a parameter FSDP2 has to
    move (``param.data = param.to(device)``) loses the extension, and its
    weight is gathered in high precision; ``fp8_all_gather_params(model)``
    after fully_shard lists the weights that kept it."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"enable_fp8_all_gather: argument 'recipe' must be a seqfuse.common.recipe "
                        f"recipe, got {type(recipe).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"enable_fp8_all_gather: argument 'model' must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    kind = recipe_kind(recipe, "enable_fp8_all_gather")
    margin = 0 if kind == "block" else int(getattr(recipe, "margin", 0))
    fp8_dtype = _weight_dtype(recipe)

    def fp8_weights(m):
        """The names of m's weights with the FP8 all-gather path (none for other modules)."""
        names = _WEIGHTS.get(type(m).__name__) if getattr(type(m), "fp8_num_gemms", 0) else None
        return () if not names or getattr(m, "parameters_split", None) else names

    # every place each parameter sits (tied weights: several), so a converted weight replaces it in all
    # of them and stays tied; a weight also held where there is no FP8 all-gather path stays as it is
    holders = {}
    for mname, m in model.named_modules():
        fp8_names = fp8_weights(m)
        for pname, p in m._parameters.items():
            if p is not None:
                full = f"{mname}.{pname}" if mname else pname
                holders.setdefault(id(p), []).append((m, pname, full, pname in fp8_names))
    done, left = [], []
    for mname, m in model.named_modules():
        names = _WEIGHTS.get(type(m).__name__) if getattr(type(m), "fp8_num_gemms", 0) else None
        if not names:
            if getattr(type(m), "fp8_num_gemms", 0):
                left.append((mname, f"{type(m).__name__} has no FP8 all-gather path"))
            continue
        if getattr(m, "parameters_split", None):
            left.append((mname, "parameters_split weights are concatenated at each call"))
            continue
        for pname in names:
            p = m._parameters.get(pname)
            full = f"{mname}.{pname}" if mname else pname
            if p is None or isinstance(p, FP8ShardWeight):
                continue
            if type(p).__name__ == "DTensor" or hasattr(p, "_local_tensor"):
                raise ValueError(f"enable_fp8_all_gather: {full} is already sharded (a DTensor); "
                                 f"call enable_fp8_all_gather before fully_shard")
            if p.is_meta:
                raise ValueError(f"enable_fp8_all_gather: {full} is on the meta device; "
                                 f"materialize the parameters (reset_parameters) first")
            if p.dim() != 2 or p.dtype not in _HIGH:
                left.append((full, f"shape {tuple(p.shape)} dtype {p.dtype}: not a 2-D float weight"))
                continue
            places = holders[id(p)]
            others = [h[2] for h in places if not h[3]]
            if others:  # reported once, at its first FP8 holder
                if full == next(h[2] for h in places if h[3]):
                    left.append((full, f"tied to {', '.join(others)}, which has no FP8 all-gather path and "
                                       f"would read FP8-rounded values; the tie is kept"))
                continue
            cfg = _Config(kind, fp8_dtype, margin, " = ".join(h[2] for h in places))
            new = torch.nn.Parameter(FP8ShardWeight(p.detach(), cfg), requires_grad=p.requires_grad)
            for holder, hname, _, _ in places:  # every module holding it: tied weights stay tied
                holder._parameters[hname] = new
            done.append(full)
    for full, why in left:
        _log.warning("seqfuse FP8 all-gather: %s stays in high precision on the wire (%s)", full, why)
    return done


def fp8_all_gather_params(model):
    """Names of ``model``'s parameters that FSDP2 gathers in FP8."""
    out = []
    for name, p in model.named_parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p
        if isinstance(t, FP8ShardWeight):
            out.append(name)
    return out


def gathered_bytes(model):
    """Bytes one all-gather of every parameter of ``model`` moves into each
    rank (the full unsharded sizes): FP8-gathered weights at one byte per
    element (plus block scales), the rest at their dtype's size.  For
    benchmarks' tables."""
    total = 0
    for p in model.parameters():
        t = p._local_tensor if hasattr(p, "_local_tensor") else p
        n = p.numel()
        if isinstance(t, FP8ShardWeight):
            total += n
            if t._sf_cfg.kind == "block":
                # float32 block scales: ceil(N / 128) rows of ceil(K / 128) columns padded to a multiple of 4
                total += -(-p.shape[0] // 128) * (-(-(-(-p.shape[1] // 128)) // 4) * 4) * 4
        else:
            total += n * p.element_size()
    return total
