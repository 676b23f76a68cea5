"""Bad input never crashes and never escapes as the wrong kind of error.

For every functional op, a valid call is taken and then one argument at a
time is replaced by something wrong: another dtype, a 0-d or flattened or
extra-dimensional tensor, an empty, expanded, non-contiguous or offset view,
NaNs, a numpy array, a list, None, a string, a number where a tensor
belongs, a tensor that requires grad, float8, a longer or shorter last
dimension, and (on the GPU) the same tensor on the CPU; scalar arguments get
NaN, inf, huge values, negatives and strings.  Each mutated call must
either run or raise TypeError, ValueError or NotImplementedError - never an
AttributeError, IndexError, OverflowError or a crash - and where the broken
argument is a number, the message must name it.  (Whether a mutation is
accepted is not asserted: a NaN input or an expanded view is legal for
many ops.)
"""
import inspect

import numpy as np
import pytest
import torch

import seqfuse.ops as ops
from helpers import needs_fp8

EXPECTED = (TypeError, ValueError, NotImplementedError)


def _cases(device):
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    def ra(*shape):  # attention inputs: the CUDA kernel takes 16-bit floats, the CPU reference float32
        return r(*shape).to(torch.bfloat16) if device == "cuda" else r(*shape)

    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    t, h, d = 8, 2, 16
    return {
        "amax": (ops.amax, [r(4, 5)], {}),
        "gemm": (ops.gemm, [r(4, 8), r(8, 3)], {"alpha": 1.0}),
        "layernorm_forward": (ops.layernorm_forward, [r(4, 8), r(8), r(8)], {"eps": 1e-5}),
        "rmsnorm_forward": (ops.rmsnorm_forward, [r(4, 8), r(8)], {"eps": 1e-5}),
        "act_forward": (ops.act_forward, [r(4, 8), "gelu"], {}),
        "act_forward_swiglu": (ops.act_forward, [r(4, 8), "swiglu"], {}),
        "bias_dropout_add": (ops.bias_dropout_add, [r(4, 8), r(8), r(4, 8), 0.1], {"seed": 1, "offset": 0}),
        "cross_entropy_forward": (ops.cross_entropy_forward,
                                  [r(4, 10), torch.tensor([1, 2, -100, 3], device=device)],
                                  {"ignore_index": -100, "label_smoothing": 0.1}),
        "rope_forward": (ops.rope_forward, [r(5, 2, 3, 8), r(5, 1, 1, 8)], {}),
        "rope_thd": (ops.rope_forward, [r(t, 3, 8), r(t, 1, 1, 8)], {"tensor_format": "thd", "cu_seqlens": cu}),
        "attention_forward": (ops.attention_forward, [ra(2, 5, h, d), ra(2, 5, h, d), ra(2, 5, h, d)],
                          {"softmax_scale": 0.25, "window_size": (2, 0)}),
        "attention_dropout": (ops.attention_forward, [ra(2, 5, h, d), ra(2, 5, h, d), ra(2, 5, h, d)],
                              {"dropout_p": 0.2, "rng_state": (3, 4)}),
        "attention_thd": (ops.attention_forward, [ra(t, h, d), ra(t, h, d), ra(t, h, d)],
                          {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu,
                           "max_seqlen_q": 5, "max_seqlen_kv": 5}),
        "multi_tensor_l2norm": (ops.multi_tensor_l2norm, [[r(3), r(4, 2)]], {}),
        "multi_tensor_scale": (ops.multi_tensor_scale, [[r(3), r(4, 2)], 0.5], {}),
        "quantize_block_fp8": (ops.quantize_block_fp8, [r(4, 128)], {}),
        "cast_fp8": (ops.cast_fp8, [r(4, 8), torch.ones(1, device=device), torch.zeros(1, device=device),
                                    torch.float8_e4m3fn], {}),
    }


def _tensor_mutations(v):
    float_v = v.is_floating_point()
    flat = v.reshape(-1)
    out = [("float64", v.double()), ("int32", v.to(torch.int32) if float_v else v.float()),
           ("bool", v.bool()), ("uint8", v.to(torch.uint8)), ("0-d", flat[0].clone() if v.numel() else v.sum()),
           ("extra dim", v.unsqueeze(0)), ("flattened", flat), ("empty", v[:0]),
           ("noncontiguous", v.transpose(0, -1) if v.dim() > 1 else v[::2]),
           ("numpy", v.detach().float().cpu().numpy() if float_v else v.cpu().numpy()),
           ("list", v.tolist()), ("None", None), ("str", "x"), ("float", 1.5), ("negative int", -3)]
    if float_v:
        out += [("nan", torch.full_like(v, float("nan"))), ("requires grad", v.clone().requires_grad_(True)),
                ("float8", v.to(torch.float8_e4m3fn))]
    if v.numel():
        out += [("expanded", flat[:1].expand(v.shape)),
                ("offset view", torch.cat([flat, flat[:1]])[1:].reshape(v.shape))]
    if v.dim():
        out += [("longer last dim", torch.cat([v, v], dim=-1)), ("shorter last dim", v[..., :-1])]
    if v.is_cuda:
        out += [("on the CPU", v.cpu())]
    return out


def _mutations(v):
    if isinstance(v, torch.Tensor):
        return _tensor_mutations(v)
    if isinstance(v, list):
        return [("empty list", []), ("[None]", [None]), ("mixed dtypes", [v[0], v[0].double()]),
                ("not a list", v[0]), ("same tensor twice", [v[0], v[0]])]
    if isinstance(v, str):
        return [("unknown name", "nope"), ("None", None), ("int", 3), ("upper case", v.upper())]
    if isinstance(v, tuple):
        return [("int", 3), ("one entry", v[:1]), ("strings", ("a", "b")), ("below -1", (-5, 0))]
    if isinstance(v, torch.dtype):
        return [("float32", torch.float32), ("str", "e4m3")]
    if isinstance(v, (int, float)):
        return [("negative", -v - 1), ("nan", float("nan")), ("inf", float("inf")), ("1e30", 1e30),
                ("str", "a"), ("None", None), ("2**63", 2 ** 63), ("1.5", 1.5)]
    return []


def _run_all(device):
    wrong_kind, unnamed, ran = [], [], 0
    for case, (fn, args, kwargs) in _cases(device).items():
        fn(*args, **kwargs)  # the valid call runs
        params = list(inspect.signature(fn).parameters)
        slots = [(i, params[i], args[i]) for i in range(len(args))] + [(k, k, v) for k, v in kwargs.items()]
        for key, pname, value in slots:
            for mname, bad in _mutations(value):
                a2, k2 = list(args), dict(kwargs)
                if isinstance(key, int):
                    a2[key] = bad
                else:
                    k2[key] = bad
                ran += 1
                try:
                    fn(*a2, **k2)
                    if device == "cuda":
                        ops.check_pending_errors()  # a bad label the loss kernel recorded (deferred check)
                except EXPECTED as e:
                    scalar = isinstance(value, (int, float)) and not isinstance(value, bool)
                    if scalar and pname not in str(e):
                        unnamed.append(f"{case}: {pname}={mname}: {type(e).__name__}: {e}")
                except Exception as e:  # noqa: BLE001 - the point of the test
                    wrong_kind.append(f"{case}: {pname}={mname}: {type(e).__name__}: {e}")
                if device == "cuda":
                    torch.cuda.synchronize()  # an illegal access would surface here
    return ran, wrong_kind, unnamed


def _check(device):
    ran, wrong_kind, unnamed = _run_all(device)
    assert ran > 500
    assert not wrong_kind, f"{len(wrong_kind)} of {ran} bad calls raised the wrong kind:\n" + "\n".join(wrong_kind)
    assert not unnamed, "errors not naming the numeric argument:\n" + "\n".join(unnamed)


@needs_fp8
def test_bad_inputs_cpu():
    _check("cpu")


@needs_fp8
@pytest.mark.cuda
def test_bad_inputs_cuda():
    _check("cuda")


def _modules():
    import seqfuse.pytorch as te

    torch.manual_seed(0)
    x = torch.randn(3, 8)
    return {
        "Linear": (te.Linear(8, 4, device="cpu"), x),
        "LayerNorm": (te.LayerNorm(8, device="cpu"), x),
        "RMSNorm": (te.RMSNorm(8, device="cpu"), x),
        "LayerNormLinear": (te.LayerNormLinear(8, 4, device="cpu"), x),
        "LayerNormMLP": (te.LayerNormMLP(8, 16, device="cpu"), x),
        "TransformerLayer": (te.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                                 device="cpu"), torch.randn(5, 2, 32)),
    }


def _module_input_mutations(x):
    return [(m, b) for m, b in _tensor_mutations(x)
            if m not in ("nan", "expanded", "offset view", "noncontiguous", "empty")] + [("0-d", x.reshape(-1)[0])]


def test_bad_module_inputs_cpu():
    """Each module's forward (and backward, where the input requires grad)
    on a wrong input raises TypeError / ValueError / NotImplementedError."""
    wrong_kind = []
    for name, (module, x) in _modules().items():
        module(x)  # the valid call runs
        for mname, bad in _module_input_mutations(x):
            try:
                y = module(bad)
                if isinstance(bad, torch.Tensor) and bad.requires_grad:
                    y.float().sum().backward()
            except EXPECTED:
                pass
            except Exception as e:  # noqa: BLE001 - the point of the test
                wrong_kind.append(f"{name}({mname}): {type(e).__name__}: {e}")
    assert not wrong_kind, "\n".join(wrong_kind)
    import seqfuse.pytorch as te

    q = torch.randn(2, 5, 2, 16)
    dpa = te.DotProductAttention(2, 16, qkv_format="bshd")
    for mname, bad in _module_input_mutations(q):
        for args in ((bad, q, q), (q, bad, q), (q, q, bad)):
            try:
                dpa(*args)
            except EXPECTED:
                pass
            except Exception as e:  # noqa: BLE001
                wrong_kind.append(f"DotProductAttention({mname}): {type(e).__name__}: {e}")
    assert not wrong_kind, "\n".join(wrong_kind)


def test_scalar_conversions_name_the_argument():
    from seqfuse.ops._call import as_float, as_int

    assert as_float("op", "p", np.float32(0.5)) == 0.5 and as_float("op", "p", torch.tensor(2.0)) == 2.0
    assert as_int("op", "n", 5.0) == 5 and as_int("op", "n", np.int64(7)) == 7
    with pytest.raises(TypeError, match="op: argument 'p' must be a real number"):
        as_float("op", "p", "a")
    with pytest.raises(ValueError, match="op: argument 'n' must be a whole number"):
        as_int("op", "n", 1.5)
    with pytest.raises(ValueError, match="op: argument 'n' must be a whole number"):
        as_int("op", "n", float("inf"))
    with pytest.raises(ValueError, match=r"op: argument 'n' must be in \[0, 2\*\*63 - 1\]"):
        as_int("op", "n", -1, 0)
    with pytest.raises(ValueError, match="op: argument 'n' must be in"):
        as_int("op", "n", 2 ** 63)
    with pytest.raises(TypeError, match="op: argument 'n' must be an integer"):
        as_int("op", "n", None)
