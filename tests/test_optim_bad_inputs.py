"""FusedAdamW, te.optimizers (FusedAdam, FusedSGD, the multi-tensor entries)
and clip_grad_norm_ on inputs they cannot honour: each is refused with an
exception naming the argument (group, key, parameter) and the rule it broke,
before anything changes, where the old code dropped a setting, reinterpreted
a tensor or failed half-way; torch.optim is the reference for what is
accepted."""
import re

import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.optim import FusedAdamW, clip_grad_norm_


def _param(*shape, dtype=torch.float32, value=1.0):
    return torch.nn.Parameter(torch.full(shape, value, dtype=dtype))


def _torch_checkpoint(cls=torch.optim.AdamW, shape=(3,), dtype=torch.float32, **kw):
    """(param, optimizer, state_dict) after one step of a torch optimizer."""
    p = _param(*shape, dtype=dtype)
    p.grad = torch.ones(shape, dtype=dtype)
    opt = cls([p], lr=0.1, **kw)
    opt.step()
    return p, opt, opt.state_dict()


def _snapshot(opt):
    """Everything a refused call must leave alone: group keys and values, state."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
             for p, st in opt.state.items()}
    return groups, state


def _same(a, b):
    (ga, sa), (gb, sb) = a, b
    assert ga == gb
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


# ---- 1. loading a torch / TE checkpoint keeps seqfuse's group keys --------------------------------

def test_torch_checkpoint_keeps_use_main_grad():
    """torch's loader replaces each group by the saved one: use_main_grad
    vanished and main_grad was ignored (the parameter never moved).  Now the
    step reads main_grad and matches torch's step on the same gradient."""
    p, topt, sd = _torch_checkpoint()
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1, use_main_grad=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["use_main_grad"] is True
    q.main_grad = torch.ones(3)
    p.grad = torch.ones(3)
    opt.step()
    topt.step()
    assert not torch.equal(q.detach(), torch.ones(3))
    torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    assert opt.state[q]["step"] == 2


def test_fused_adam_checkpoint_keeps_this_optimizers_use_main_grad():
    """te.optimizers.FusedAdam saves use_main_grad=False; loaded into
    FusedAdamW(use_main_grad=True) the constructor's value stays (it says
    where this model's gradients are), so main_grad is read."""
    p = _param(3)
    p.grad = torch.ones(3)
    src = te.optimizers.FusedAdam([p], lr=0.1)
    src.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1, use_main_grad=True)
    opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["use_main_grad"] is True
    q.main_grad = torch.ones(3)
    before = q.detach().clone()
    opt.step()
    assert not torch.equal(before, q.detach())


def test_torch_checkpoint_keeps_master_weights_for_bf16_params():
    """A torch AdamW checkpoint of bf16 parameters (no fp32 masters): the
    group keeps master_weights=True and each bf16 parameter gets its fp32
    master from its value; a parameter without saved state steps too (it
    raised KeyError('master_weights'))."""
    p, _, sd = _torch_checkpoint(dtype=torch.bfloat16)
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1, master_weights=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["master_weights"] is True
    assert torch.equal(opt.state[q]["master_param"], q.detach().float())
    q.grad = torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[q]["master_param"].dtype == torch.float32 and opt.state[q]["step"] == 2

    a, b = _param(3), _param(3)
    a.grad = torch.ones(3)
    t = torch.optim.AdamW([a, b], lr=0.1)
    t.step()  # b has no grad: no saved state
    x, y = _param(3), _param(3, dtype=torch.bfloat16)
    opt = FusedAdamW([x, y], lr=0.1)
    opt.load_state_dict(t.state_dict())
    x.grad, y.grad = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[y]["step"] == 1 and "master_param" in opt.state[y]


@pytest.mark.parametrize("cls,kw,key", [(torch.optim.AdamW, dict(maximize=True), "maximize"),
                                        (torch.optim.AdamW, dict(amsgrad=True), "amsgrad"),
                                        (torch.optim.AdamW, dict(maximize=True, amsgrad=True), "amsgrad")])
def test_load_refuses_torch_checkpoints_the_kernel_would_ignore(cls, kw, key):
    """maximize / amsgrad groups (the update descended, without AMSGrad) are
    refused with a ValueError naming the group and key, before anything
    changes."""
    _, _, sd = _torch_checkpoint(cls, **kw)
    q = _param(3)
    q.grad = torch.ones(3)
    opt = FusedAdamW([q], lr=0.1)
    opt.step()
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=rf"state dict's param_groups\[0\]\['{key}'\]=.* is not supported"):
        opt.load_state_dict(sd)
    _same(before, _snapshot(opt))


def test_load_refuses_torch_adams_l2_weight_decay():
    """torch.optim.Adam(weight_decay=0.5) is L2 regularisation: it continued
    as decoupled AdamW decay; refused (decoupled_weight_decay=False named).
    With weight_decay=0 it is AdamW's update: loaded and stepped like torch."""
    _, _, sd = _torch_checkpoint(torch.optim.Adam, weight_decay=0.5)
    opt = FusedAdamW([_param(3)], lr=0.1)
    before = _snapshot(opt)
    with pytest.raises(ValueError, match=r"state dict's param_groups\[0\]\['decoupled_weight_decay'\]=False with "
                                         r"weight_decay=0.5 > 0 is not supported"):
        opt.load_state_dict(sd)
    _same(before, _snapshot(opt))

    p, topt, sd = _torch_checkpoint(torch.optim.Adam)
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1)
    opt.load_state_dict(sd)
    p.grad, q.grad = torch.ones(3), torch.ones(3)
    topt.step()
    opt.step()
    torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-6, atol=1e-7)


# ---- 1b. a checkpoint's moment dtype is never changed silently -----------------------------------

def _fused_checkpoint(moments, dtype=torch.bfloat16, n=64):
    """(the parameter's value, state_dict) after two steps of FusedAdamW with
    moments in ``moments``; random gradients, so float32 moments are not
    bfloat16 numbers and a rounding shows."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype))
    opt = FusedAdamW([p], lr=0.01, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    for _ in range(2):
        p.grad = torch.randn(n, generator=gen).to(dtype)
        opt.step()
    return p.detach().clone(), opt.state_dict()


def _moments(dtype):
    return dict(exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)


@pytest.mark.parametrize("saved,built", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_load_refuses_another_moment_dtype(saved, built):
    """A FusedAdamW checkpoint saved with one moment dtype, loaded into an
    optimizer built with the other: the old loader converted the moments to
    the constructor's dtype (float32 -> bfloat16 rounded them; bfloat16 ->
    float32 resumed a bf16 run in another precision) with only a log line.
    Now refused, naming both dtypes and the two fixes, before anything
    changes; each fix the message names works."""
    value, sd = _fused_checkpoint(saved)
    if saved == torch.float32:  # the conversion would have lost something
        assert not torch.equal(sd["state"][0]["exp_avg"], sd["state"][0]["exp_avg"].bfloat16().float())
    q = torch.nn.Parameter(value.clone())
    q.grad = torch.ones_like(q)
    opt = FusedAdamW([q], lr=0.01, **_moments(built))
    opt.step()  # state of its own, which a refused load must leave alone
    before = _snapshot(opt)
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(sd)
    msg = str(err.value)
    assert (f"FusedAdamW.load_state_dict: the state dict's param_groups[0] was saved with moment_dtype={saved}, "
            f"but this optimizer's param_groups[0] keeps its moments in {built}") in msg
    assert f"build the optimizer with exp_avg_dtype=exp_avg_sq_dtype={saved}" in msg
    assert f"set state_dict['param_groups'][0]['moment_dtype'] = {built} before loading" in msg
    assert ("rounded to torch.bfloat16" in msg) == (built == torch.bfloat16)
    _same(before, _snapshot(opt))
    assert opt.param_groups[0]["moment_dtype"] == built and opt.param_groups[0]["lr"] == 0.01

    # fix 1: built with the saved dtype, the checkpoint loads exactly
    same = FusedAdamW([q], lr=0.5, **_moments(saved))
    same.load_state_dict(sd)
    assert same.param_groups[0]["moment_dtype"] == saved
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        x, y = same.state[q][key], sd["state"][0][key]
        assert x.dtype == y.dtype and torch.equal(x, y), key
    assert same.state[q]["step"] == 2

    # fix 2: the state dict says the new dtype: converted on purpose
    sd["param_groups"][0]["moment_dtype"] = built
    conv = FusedAdamW([q], lr=0.5, **_moments(built))
    conv.load_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq"):
        x = conv.state[q][key]
        assert x.dtype == built and torch.equal(x, sd["state"][0][key].to(built)), key


def test_moment_dtype_checked_per_group():
    """Group 0 matches, group 1 does not: group 1 is named, nothing loads."""
    a, b = _param(4), _param(4)
    a.grad, b.grad = torch.full((4,), 0.3), torch.full((4,), 0.7)
    src = FusedAdamW([{"params": [a]}, {"params": [b], "moment_dtype": torch.bfloat16}], lr=0.1)
    src.step()
    x, y = _param(4), _param(4)
    opt = FusedAdamW([{"params": [x]}, {"params": [y]}], lr=0.1)
    with pytest.raises(ValueError, match=r"param_groups\[1\] was saved with moment_dtype=torch.bfloat16, but this "
                                         r"optimizer's param_groups\[1\] keeps its moments in torch.float32"):
        opt.load_state_dict(src.state_dict())
    assert not opt.state
    good = FusedAdamW([{"params": [x]}, {"params": [y], "moment_dtype": torch.bfloat16}], lr=0.1)
    good.load_state_dict(src.state_dict())
    assert torch.equal(good.state[y]["exp_avg"], src.state[b]["exp_avg"])
    assert good.state[y]["exp_avg"].dtype == torch.bfloat16


def test_torch_checkpoint_of_fp32_moments_into_bf16_moments_is_refused():
    """torch.optim.AdamW on float32 parameters keeps float32 moments (and
    no 'moment_dtype' key): loading them into bf16 moments would round them
    (the old loader did, with a log line).  Refused, naming the key, the
    dtypes and the fixes; the second fix loads them rounded, on purpose."""
    p, _, sd = _torch_checkpoint()
    assert not torch.equal(sd["state"][0]["exp_avg"], sd["state"][0]["exp_avg"].bfloat16().float())
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1, **_moments(torch.bfloat16))
    with pytest.raises(ValueError, match=r"param_groups\[0\] has no 'moment_dtype' \(a torch.optim or Transformer "
                                         r"Engine checkpoint\) and the state of its parameter 0 holds 'exp_avg' in "
                                         r"torch.float32, but this optimizer's param_groups\[0\] keeps its moments "
                                         r"in torch.bfloat16: converting would round the saved values"):
        opt.load_state_dict(sd)
    assert not opt.state and opt.param_groups[0]["moment_dtype"] == torch.bfloat16
    sd["param_groups"][0]["moment_dtype"] = torch.bfloat16
    opt.load_state_dict(sd)
    assert torch.equal(opt.state[q]["exp_avg"], sd["state"][0]["exp_avg"].bfloat16())
    # into float32 moments (the default) it loads exactly
    same = FusedAdamW([q], lr=0.1)
    _, _, sd = _torch_checkpoint()
    same.load_state_dict(sd)
    assert torch.equal(same.state[q]["exp_avg_sq"], sd["state"][0]["exp_avg_sq"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_checkpoint_of_16_bit_moments_widens_exactly(dtype, caplog):
    """torch.optim.AdamW on bfloat16 / float16 parameters keeps moments in
    the parameter's dtype: into a float32-moment FusedAdamW they widen
    exactly (nothing saved is lost), and a log line names the conversion.
    float16 moments into bfloat16 ones would round: refused, pointing at
    float32 (FusedAdamW keeps no float16 moments)."""
    p, _, sd = _torch_checkpoint(dtype=dtype)
    assert sd["state"][0]["exp_avg"].dtype == dtype
    q = torch.nn.Parameter(p.detach().clone())
    opt = FusedAdamW([q], lr=0.1)
    with caplog.at_level("WARNING", logger="seqfuse"):
        opt.load_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq"):
        x = opt.state[q][key]
        assert x.dtype == torch.float32 and torch.equal(x, sd["state"][0][key].float()), key
    assert f"saved exp_avg in {dtype} converted to this optimizer's torch.float32" in caplog.text
    if dtype == torch.float16:
        opt = FusedAdamW([q], lr=0.1, **_moments(torch.bfloat16))
        with pytest.raises(ValueError, match=r"holds 'exp_avg' in torch.float16, but this optimizer's "
                                             r"param_groups\[0\] keeps its moments in torch.bfloat16: converting "
                                             r"would round the saved values.  To keep the saved values exactly, "
                                             r"build the optimizer with exp_avg_dtype=exp_avg_sq_dtype=torch.float32"):
            opt.load_state_dict(sd)
        assert not opt.state


def _dcp_moment_worker(rank, init_file, out_dir):
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from seqfuse.distributed import end_process_group

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        m = torch.nn.Linear(8, 8)
        opt = FusedAdamW(m.parameters(), lr=0.1)
        m(torch.randn(2, 8)).sum().backward()
        opt.step()
        ckpt = os.path.join(out_dir, "dcp")
        dcp.save({"optim": get_optimizer_state_dict(m, opt)}, checkpoint_id=ckpt)
        m2 = torch.nn.Linear(8, 8)
        opt2 = FusedAdamW(m2.parameters(), lr=0.1, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        sd = {"optim": get_optimizer_state_dict(m2, opt2)}  # a template in bf16: DCP reads into it
        dcp.load(sd, checkpoint_id=ckpt)
        try:
            set_optimizer_state_dict(m2, opt2, sd["optim"])
            result = "loaded"
        except ValueError as e:
            result = str(e)
        torch.save({"result": result}, os.path.join(out_dir, "result.pt"))
    finally:
        end_process_group(True)


def test_dcp_load_into_another_moment_dtype_is_refused(tmp_path):
    """torch.distributed.checkpoint reads a float32-moment checkpoint into
    the bf16 template of an optimizer built with bf16 moments (rounding it
    on the way) and hands the file's param_groups to load_state_dict: the
    saved moment_dtype there is refused as in a plain load (it loaded)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_dcp_moment_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=1, join=True)
    result = torch.load(tmp_path / "result.pt")["result"]
    assert re.search(r"param_groups\[0\] was saved with moment_dtype=torch.float32, but this optimizer's "
                     r"param_groups\[0\] keeps its moments in torch.bfloat16", result), result


# ---- 2. flags the constructor refuses are refused per group and at step -----------------------------

@pytest.mark.parametrize("extra,key", [({"maximize": True}, "maximize"), ({"amsgrad": True}, "amsgrad"),
                                       ({"decoupled_weight_decay": False, "weight_decay": 0.1},
                                        "decoupled_weight_decay")])
def test_group_flags_the_kernel_would_ignore(extra, key):
    p, q = _param(3), _param(4)
    with pytest.raises(NotImplementedError, match=rf"param_groups\[0\]\['{key}'\]=.* is not supported"):
        FusedAdamW([dict(params=[p], **extra)])
    opt = FusedAdamW([p])
    with pytest.raises(NotImplementedError, match=rf"param_groups\[1\]\['{key}'\]=.* is not supported"):
        opt.add_param_group(dict(params=[q], **extra))
    assert len(opt.param_groups) == 1
    # set after construction: refused at the step, the parameter unchanged
    opt.param_groups[0].update(extra)
    p.grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match=rf"param_groups\[0\]\['{key}'\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3)) and p not in opt.state


def test_fused_adam_l2_mode_with_group_weight_decay():
    """te.optimizers.FusedAdam(adam_w_mode=False) refuses weight_decay > 0 in
    a group, an added group or one set later (it ran decoupled decay)."""
    p, q = _param(3), _param(3)
    with pytest.raises(NotImplementedError, match=r"'adam_w_mode'\]=False with weight_decay=0.5"):
        te.optimizers.FusedAdam([{"params": [p], "weight_decay": 0.5}], adam_w_mode=False)
    opt = te.optimizers.FusedAdam([p], adam_w_mode=False)
    assert opt.param_groups[0]["adam_w_mode"] is False
    with pytest.raises(NotImplementedError, match=r"param_groups\[1\]\['adam_w_mode'\]=False with weight_decay"):
        opt.add_param_group({"params": [q], "weight_decay": 0.1})
    opt.param_groups[0]["weight_decay"] = 0.1
    p.grad = torch.ones(3)
    with pytest.raises(NotImplementedError, match=r"param_groups\[0\]\['adam_w_mode'\]=False with weight_decay"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3))
    # L2 mode without decay is Adam: runs
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    assert not torch.equal(p.detach(), torch.ones(3))


# ---- 3. state and gradients of another shape (same numel) ---------------------------------------

@pytest.mark.parametrize("shape", [(3, 2), (6,)])
def test_load_refuses_state_of_another_shape(shape):
    """State saved for a (2, 3) parameter loaded into a (3, 2) or (6,) one:
    torch raises a size mismatch at its step; seqfuse stepped on the
    reinterpreted moments.  Now refused at load."""
    p = _param(2, 3)
    p.grad = torch.ones(2, 3)
    src = FusedAdamW([p])
    src.step()
    q = _param(*shape)
    opt = FusedAdamW([q])
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0: 'exp_avg' has shape \(2, 3\), but its "
                                         r"parameter has shape " + re.escape(str(shape))):
        opt.load_state_dict(src.state_dict())
    assert q not in opt.state


def test_load_refuses_a_transposed_master():
    p = _param(2, 3, dtype=torch.bfloat16)
    p.grad = torch.ones(2, 3, dtype=torch.bfloat16)
    src = FusedAdamW([p])
    src.step()
    sd = src.state_dict()
    sd["state"][0]["master_param"] = sd["state"][0]["master_param"].t().contiguous()
    opt = FusedAdamW([_param(2, 3, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match=r"'master_param' has shape \(3, 2\), but its parameter has shape \(2, 3\)"):
        opt.load_state_dict(sd)
    assert not opt.state


def test_load_refuses_state_without_moments():
    p = _param(3)
    p.grad = torch.ones(3)
    src = FusedAdamW([p])
    src.step()
    sd = src.state_dict()
    del sd["state"][0]["exp_avg_sq"]
    opt = FusedAdamW([_param(3)])
    with pytest.raises(ValueError, match=r"state of parameter 0 of param group 0 has no 'exp_avg_sq'"):
        opt.load_state_dict(sd)


def test_main_grad_of_another_shape():
    p = _param(2, 3)
    p.main_grad = torch.ones(3, 2)
    opt = FusedAdamW([p], use_main_grad=True)
    with pytest.raises(ValueError, match=r"the main_grad of parameter 0 of param group 0 \(shape \(2, 3\)\) has "
                                         r"shape \(3, 2\); it must have the parameter's shape"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 3))


# ---- 4. a refused step changes nothing -------------------------------------------------------------

def test_refused_step_changes_nothing_then_resumes_exactly():
    """A bad main_grad in the second group (after a good group, and a bf16
    parameter in another launch of its own group) is refused before any
    update: no parameter, moment or step count changes, so the next good
    step matches an optimizer that never saw the bad one."""
    def build():
        a = _param(4, value=0.5)
        b = _param(3, dtype=torch.bfloat16, value=0.25)
        c = _param(2, 3, value=2.0)
        return [a, b, c], FusedAdamW([{"params": [a]}, {"params": [b, c]}], lr=0.1, use_main_grad=True)

    ps, opt = build()
    ref_ps, ref = build()
    for x in (ps, ref_ps):
        for t in x:
            t.main_grad = torch.full(t.shape, 0.3)
    opt.step()
    ref.step()
    before = _snapshot(opt)
    params_before = [t.detach().clone() for t in ps]
    ps[2].main_grad = torch.ones(3, 2)  # wrong shape
    with pytest.raises(ValueError, match=r"main_grad of parameter 1 of param group 1"):
        opt.step()
    _same(before, _snapshot(opt))
    assert all(torch.equal(t.detach(), u) for t, u in zip(ps, params_before))
    assert all(opt.state[t]["step"] == 1 for t in ps)
    for x in (ps, ref_ps):
        for t in x:
            t.main_grad = torch.full(t.shape, -0.2)
    opt.step()
    ref.step()
    for t, u in zip(ps, ref_ps):
        assert torch.equal(t.detach(), u.detach())
        assert opt.state[t]["step"] == ref.state[u]["step"] == 2


def test_refused_step_creates_no_state():
    p = _param(3)
    p.main_grad = torch.ones(4)
    opt = FusedAdamW([p], use_main_grad=True)
    with pytest.raises(ValueError, match="must have the parameter's shape"):
        opt.step()
    assert p not in opt.state


# ---- 5. clear messages -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_param_dtypes_the_optimizer_does_not_take(dtype):
    p = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    p.grad = torch.ones(3, dtype=dtype)
    opt = FusedAdamW([p])
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=rf"FusedAdamW: parameter 0 of param group 0 \(shape \(3,\)\) has dtype "
                                        rf"{name}; FusedAdamW takes float32, bfloat16 or float16 parameters"):
        opt.step()
    assert p not in opt.state  # no state (nor complex-to-real master) created first


def test_grad_dtype_the_optimizer_does_not_take():
    p = _param(2, 3, dtype=torch.bfloat16)
    p.main_grad = torch.ones(2, 3, dtype=torch.float64)
    opt = FusedAdamW([p], use_main_grad=True)
    with pytest.raises(TypeError, match=r"the main_grad of parameter 0 .* has dtype float64; it must have the "
                                        r"parameter's dtype \(bfloat16\) or float32"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_clip_grad_dtypes(dtype):
    p, q = _param(3), torch.nn.Parameter(torch.ones(2, dtype=dtype))
    p.grad, q.grad = torch.ones(3), torch.ones(2, dtype=dtype)
    name = str(dtype).replace("torch.", "")
    with pytest.raises(TypeError, match=rf"clip_grad_norm_: the grad of parameter 1 \(shape \(2,\)\) has dtype "
                                        rf"{name}; seqfuse's clip_grad_norm_ takes float32, bfloat16 or float16"):
        clip_grad_norm_([p, q], 1.0)


@pytest.mark.parametrize("max_norm", [-1.0, float("nan"), torch.tensor(-2.0)])
def test_clip_refuses_negative_or_nan_max_norm(max_norm):
    """torch flips every gradient's sign (negative) or makes them NaN: refused."""
    p = _param(3)
    p.grad = torch.full((3,), 5.0)
    with pytest.raises(ValueError, match=r"clip_grad_norm_: argument 'max_norm' must be >= 0"):
        clip_grad_norm_([p], max_norm)
    assert torch.equal(p.grad, torch.full((3,), 5.0))
    assert clip_grad_norm_([p], float("inf")).item() == pytest.approx(75 ** 0.5)  # inf: no clipping
    assert torch.equal(p.grad, torch.full((3,), 5.0))


@pytest.mark.parametrize("betas", [(0.9, 0.99, 0.5), (0.9,), 0.9])
def test_betas_must_be_a_pair(betas):
    p = _param(3)
    with pytest.raises(ValueError, match=r"FusedAdamW: argument 'betas' must be a pair \(beta1, beta2\)"):
        FusedAdamW([p], betas=betas)
    opt = FusedAdamW([p])
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['betas'\] must be a pair"):
        opt.add_param_group({"params": [_param(2)], "betas": betas})


def test_fused_sgd_without_lr():
    p = _param(3)
    with pytest.raises(ValueError, match="FusedSGD: argument 'lr' is required"):
        te.optimizers.FusedSGD([p])
    opt = te.optimizers.FusedSGD([{"params": [p], "lr": 0.5}])  # every group names its lr: as TE
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.full((3,), 0.5))
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        opt.add_param_group({"params": [_param(2)]})


def test_multi_tensor_applier_without_lists():
    flag = torch.zeros(1, dtype=torch.int32)
    opt = te.optimizers
    with pytest.raises(ValueError, match="multi_tensor_applier: argument 'tensor_lists' must be a non-empty list"):
        opt.multi_tensor_applier(opt.multi_tensor_scale, flag, [], 1.0)
    with pytest.raises(ValueError, match="argument 'tensor_lists' must be a non-empty list"):
        opt.MultiTensorApply(1024)(opt.multi_tensor_l2norm, flag, [])


def test_multi_tensor_adam_step_zero():
    """step 0 with bias correction divides by 1 - beta^0 = 0: NaN parameters.
    Refused; without bias correction the step number is unused and 0 runs."""
    opt = te.optimizers
    flag = torch.zeros(1, dtype=torch.int32)
    g, p, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="multi_tensor_adam: argument 'step' must be >= 1"):
        opt.multi_tensor_applier(opt.multi_tensor_adam, flag, [[g], [p], [m], [v]], 1e-3, 0.9, 0.999, 1e-8, 0, 1,
                                 1, 0.0)
    assert torch.equal(p, torch.ones(4))
    opt.multi_tensor_applier(opt.multi_tensor_adam, flag, [[g], [p], [m], [v]], 1e-3, 0.9, 0.999, 1e-8, 0, 1, 0,
                             0.0)
    assert torch.isfinite(p).all() and not torch.equal(p, torch.ones(4))
