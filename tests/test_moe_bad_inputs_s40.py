"""Bad inputs to the MoE public API (seqfuse.pytorch's permutation, router
and GroupedLinear) that were silently truncated or mis-read: each now
raises an exception naming the argument.  CPU only."""
import numpy as np
import pytest
import torch

import seqfuse.pytorch as te
from seqfuse.pytorch import router


def _routed(T=4, E=4, topk=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    probs, rmap = router.fused_topk_with_score_function(logits, topk)
    x = torch.randn(T, 8, generator=g)
    return x, probs, rmap


# ---- permutation ------------------------------------------------------------

@pytest.mark.parametrize("fn", ["moe_permute", "moe_permute_with_probs"])
def test_num_out_tokens_fraction_refused(fn):
    x, probs, rmap = _routed()
    args = (x, rmap) if fn == "moe_permute" else (x, probs, rmap)
    with pytest.raises(ValueError, match="num_out_tokens.*whole number"):
        getattr(te, fn)(*args, num_out_tokens=3.7)  # was: 3 rows, silently


@pytest.mark.parametrize("fn", ["moe_permute", "moe_permute_with_probs"])
def test_num_out_tokens_bool_refused(fn):
    x, probs, rmap = _routed()
    args = (x, rmap) if fn == "moe_permute" else (x, probs, rmap)
    with pytest.raises(TypeError, match="num_out_tokens.*bool"):
        getattr(te, fn)(*args, num_out_tokens=True)  # was: 1 row, silently


def test_num_out_tokens_valid_forms_unchanged():
    x, _, rmap = _routed()
    routed = int(rmap.sum())
    assert te.moe_permute(x, rmap)[0].shape[0] == routed
    assert te.moe_permute(x, rmap, num_out_tokens=-1)[0].shape[0] == routed
    assert te.moe_permute(x, rmap, num_out_tokens=3)[0].shape[0] == 3
    assert te.moe_permute(x, rmap, num_out_tokens=3.0)[0].shape[0] == 3
    assert te.moe_permute(x, rmap, num_out_tokens=np.int64(5))[0].shape[0] == 5


def test_pad_tokens_per_expert_float_refused():
    x, probs, rmap = _routed()
    tpe = rmap.sum(0).float() + 0.5  # .long() used to truncate it to the true counts and accept it
    with pytest.raises(TypeError, match="tokens_per_expert.*integer"):
        te.moe_permute_and_pad_with_probs(x, probs, rmap, tpe, 4)


def test_pad_tokens_per_expert_int_unchanged():
    x, probs, rmap = _routed()
    out, pprobs, ids, _, target = te.moe_permute_and_pad_with_probs(x, probs, rmap, rmap.sum(0), 4)
    assert out.shape[0] == int(target.sum())
    back = te.moe_unpermute(out, ids, merging_probs=probs)
    ref = te.moe_unpermute(*te.moe_permute(x, rmap), merging_probs=probs)
    torch.testing.assert_close(back, ref)


def test_unpermute_restore_shape_named():
    x, _, rmap = _routed()
    out, ids = te.moe_permute(x, rmap)
    with pytest.raises(ValueError, match="restore_shape"):
        te.moe_unpermute(out, ids, restore_shape=(5, 5))
    assert te.moe_unpermute(out, ids, restore_shape=(2, 2, 8)).shape == (2, 2, 8)


# ---- router -----------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk_scaling_factor_nonfinite_refused(bad):
    logits = torch.randn(4, 4)
    with pytest.raises(ValueError, match="scaling_factor.*finite"):
        router.fused_topk_with_score_function(logits, 2, scaling_factor=bad)  # was: NaN / inf probs


def test_aux_loss_total_num_tokens_fraction_refused():
    _, probs, rmap = _routed()
    with pytest.raises(ValueError, match="total_num_tokens.*whole number"):
        router.fused_moe_aux_loss(probs, rmap.sum(0), 4.7, 4, 2, 1e-2)  # was: read as 4


def test_aux_loss_total_num_tokens_bool_refused():
    _, probs, rmap = _routed()
    with pytest.raises(TypeError, match="total_num_tokens.*bool"):
        router.fused_moe_aux_loss(probs, rmap.sum(0), True, 4, 2, 1e-2)  # was: read as 1


def test_aux_loss_coeff_nonfinite_refused():
    _, probs, rmap = _routed()
    with pytest.raises(ValueError, match="coeff.*finite"):
        router.fused_moe_aux_loss(probs, rmap.sum(0), 4, 4, 2, float("nan"))


@pytest.mark.parametrize("coeff", [float("nan"), float("inf")])
def test_z_loss_coeff_nonfinite_refused(coeff):
    """moe_z_loss took any float: a NaN or infinite coefficient made the loss NaN / inf."""
    from seqfuse.ops import moe as moe_ops

    logits = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"moe_z_loss: argument 'coeff' must be a finite number"):
        moe_ops.moe_z_loss(logits, coeff)
    assert torch.isfinite(moe_ops.moe_z_loss(logits, 1e-3))


def test_aux_loss_valid_unchanged():
    _, probs, rmap = _routed()
    a = router.fused_moe_aux_loss(probs, rmap.sum(0), 4, 4, 2, 1e-2)
    b = router.fused_moe_aux_loss(probs, rmap.sum(0), 4.0, 4, 2, 1e-2)
    torch.testing.assert_close(a, b)


# ---- GroupedLinear m_splits --------------------------------------------------

def _grouped():
    torch.manual_seed(0)
    return te.GroupedLinear(3, 8, 4, bias=True, device="cpu")


@pytest.mark.parametrize("splits", [[True, True, 4], np.array([True, True, True]),
                                    torch.tensor([True, True, True])],
                         ids=["list", "numpy", "tensor"])
def test_m_splits_bools_refused(splits):
    g = _grouped()
    rows = 6 if isinstance(splits, list) else 3
    with pytest.raises(TypeError, match="m_splits"):
        g(torch.randn(rows, 8), splits)  # was: each True read as 1 row


def test_m_splits_valid_forms_unchanged():
    g = _grouped()
    x = torch.randn(6, 8)
    ref = g(x, [2, 2, 2])
    for splits in ([2.0, 2.0, 2.0], np.array([2, 2, 2]), torch.tensor([2, 2, 2]), (2, 2, 2)):
        torch.testing.assert_close(g(x, splits), ref)


@pytest.mark.parametrize("value", [True, np.bool_(True), torch.tensor(True)], ids=["bool", "numpy", "tensor"])
def test_as_int_refuses_bools_for_every_count(value):
    """ops' shared integer reading refuses a bool of any kind (it read True as 1 for every count argument:
    sizes, offsets, margins), so no caller needs its own bool guard."""
    from seqfuse.ops.args import as_int

    with pytest.raises(TypeError, match=r"op: argument 'n' must be an integer, got the bool"):
        as_int("op", "n", value)
    assert as_int("op", "n", np.int64(3)) == 3 and as_int("op", "n", 2.0) == 2
