"""FusedAdamW's step plan (the record of the last fully checked step that
later steps are compared with, instead of checking every parameter in full):
whatever changes between steps -- a gradient's dtype, shape, device, layout
or memory, a parameter's gradient missing or new, its .data swapped, a group
added or its parameter list edited, a state loaded, cleared or edited --
the step does exactly what a FusedAdamW without the plan does (every step
through the full path, as before the plan): the same parameters, moments,
masters, step counts and version counters bit for bit, or the same refusal
with the same message, which changes nothing."""
import copy
import re

import pytest
import torch

from seqfuse.optim import FusedAdamW

SPECS = [((4, 5), torch.bfloat16), ((5,), torch.float32), ((3, 3), torch.float16), ((4, 4), torch.bfloat16),
         ((0,), torch.bfloat16), ((6,), torch.bfloat16), ((2, 2), torch.float32)]


def _no_plan(self):
    return None


#: The reference: a FusedAdamW (by name too, which its messages carry) whose every step takes the full path.
FullPath = type("FusedAdamW", (FusedAdamW,), {"_planned": _no_plan})


def two_groups(ps):
    return [{"params": ps[:4]}, {"params": ps[4:], "weight_decay": 0.0, "lr": 3e-3}]


class Twin:
    """The same parameters (by value) under FusedAdamW and FullPath, given the
    same gradients; ``main=True`` sets them as main_grad (torch's .grad
    setter refuses some of the bad ones these tests need)."""

    def __init__(self, groups=two_groups, main=False, specs=SPECS, **kw):
        self.main, self.specs = main, specs
        self.ours, self.ref = self._params(specs), self._params(specs)
        kw.setdefault("lr", 1e-3)
        self.opt = FusedAdamW(groups(self.ours), use_main_grad=main, **kw)
        self.ref_opt = FullPath(groups(self.ref), use_main_grad=main, **kw)
        self.full_steps = 0  # steps of ours that took the full path
        checked = self.opt._checked

        def counted():
            self.full_steps += 1
            return checked()

        self.opt._checked = counted

    @staticmethod
    def _params(specs):
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype)) for shape, dtype in specs]

    def both(self, fn):
        """fn(params, optimizer) on each side: None, or the (type, message) of
        what it raised, the same on both sides."""
        out = []
        for ps, opt in ((self.ours, self.opt), (self.ref, self.ref_opt)):
            try:
                fn(ps, opt)
                out.append(None)
            except Exception as e:  # noqa: BLE001 - compared below
                out.append((type(e), str(e)))
        assert out[0] == out[1]
        return out[0]

    def step(self):
        return self.both(lambda ps, opt: opt.step())

    def grads(self, seed, which=None, change=None):
        """Fresh gradients for the parameters as built (parameters outside
        ``which`` get none); ``change(i, grad)`` may replace parameter i's."""
        g = torch.Generator().manual_seed(seed)
        for i, (p, q) in enumerate(zip(self.ours, self.ref)):
            grad = None
            if which is None or i in which:
                shape, dtype = self.specs[i] if i < len(self.specs) else (p.shape, p.dtype)
                grad = torch.randn(shape, generator=g).to(dtype)
                if change is not None:
                    grad = change(i, grad)
            for t in (p, q):
                copied = None if grad is None else _copy(grad)
                if self.main:
                    t.main_grad = copied
                else:
                    t.grad = copied

    def steps_alike(self, steps):
        """For each step number: fresh gradients, a step that is not refused,
        and both optimizers' parameters and states the same."""
        for s in steps:
            self.grads(s)
            assert self.step() is None
            self.assert_same()

    def assert_same(self):
        for i, (p, q) in enumerate(zip(self.ours, self.ref)):
            assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p.detach(), q.detach()), i
            assert p._version == q._version, i
            sp, sq = self.opt.state.get(p, {}), self.ref_opt.state.get(q, {})
            assert sp.keys() == sq.keys(), i
            for k, v in sp.items():
                if isinstance(v, torch.Tensor):
                    assert v.dtype == sq[k].dtype and torch.equal(v, sq[k]), (i, k)
                else:
                    assert type(v) is type(sq[k]) and v == sq[k], (i, k)

    def snapshot(self):
        return ([p.detach().clone() for p in self.ours],
                {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
                 for p, st in self.opt.state.items()})

    def assert_unchanged(self, snap):
        params, state = snap
        assert all(torch.equal(a, p.detach()) for a, p in zip(params, self.ours))
        now = self.snapshot()[1]
        assert now.keys() == state.keys()
        for key, st in state.items():
            assert now[key].keys() == st.keys()
            for k, v in st.items():
                assert torch.equal(v, now[key][k]) if isinstance(v, torch.Tensor) else v == now[key][k]

    def warm(self, steps=3):
        """A few good steps: the plan recorded, then used."""
        for s in range(steps):
            self.grads(s)
            assert self.step() is None
        self.assert_same()
        assert self.full_steps == 1


def _copy(t):
    """A copy keeping t's strides (clone makes a non-dense view contiguous)."""
    if t.layout != torch.strided or t.is_meta:
        return t.clone()
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)


@pytest.mark.parametrize("kw", [{}, {"master_weights": False},
                                {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}])
def test_steady_steps_take_the_plan_and_match_the_full_path(kw):
    t = Twin(**kw)
    for s in range(6):
        t.grads(s)
        assert t.step() is None
        t.assert_same()
    assert t.full_steps == 1  # the first step records the plan; the other five follow it
    assert [t.opt.state[p]["step"] for p in t.ours] == [6] * len(SPECS)


# (parameter, the gradient that replaces its own, the refusal)
BAD_GRADS = {
    "shape": (3, lambda g: torch.randn(7).to(g.dtype), ValueError, r"has shape \(7,\); it must have the parameter's"),
    "dtype": (0, lambda g: g.to(torch.float16), TypeError, r"has dtype float16; it must have the parameter's dtype"),
    "device": (3, lambda g: torch.empty(g.shape, dtype=g.dtype, device="meta"), ValueError,
               r"is on meta, the parameter on cpu"),
    "strided": (0, lambda g: torch.randn(4, 10).to(g.dtype)[:, ::2], ValueError, r"must be contiguous"),
    "transposed": (3, lambda g: g.t(), ValueError, r"must be contiguous"),
    "sparse": (1, lambda g: g.to_sparse(), ValueError, r"sparse gradients are not supported"),
}


@pytest.mark.parametrize("what", sorted(BAD_GRADS))
def test_a_gradient_changed_after_the_plan_is_refused_as_before(what):
    """A gradient that passed last step and is bad now: the same refusal (the
    full check's message, naming the parameter), nothing changed, and the
    next good step goes on as the full path's."""
    t = Twin(main=True)
    t.warm()
    index, bad, exc, message = BAD_GRADS[what]
    t.grads(10, change=lambda i, g: bad(g) if i == index else g)
    snap = t.snapshot()
    refused = t.step()
    assert refused is not None and refused[0] is exc and re.search(message, refused[1]), refused
    assert f"parameter {index % 4} of param group {index // 4}" in refused[1]
    t.assert_unchanged(snap)
    t.grads(11)
    assert t.step() is None
    t.assert_same()


def test_a_gradient_in_the_parameters_memory_is_refused():
    t = Twin(main=True)
    t.warm()
    t.grads(10)
    t.ours[3].main_grad, t.ref[3].main_grad = t.ours[3].detach(), t.ref[3].detach()
    snap = t.snapshot()
    refused = t.step()
    assert refused is not None and "is the parameter's own memory" in refused[1]
    t.assert_unchanged(snap)


def test_a_gradient_in_a_swapped_parameters_memory_is_refused():
    """The parameter's .data moved to new memory and the gradient put in it,
    in one step: refused (the plan's record of the old memory must not
    pass it)."""
    t = Twin(main=True)
    t.warm()
    t.grads(10)
    for p in (t.ours[0], t.ref[0]):
        p.data = p.data.clone()
        p.main_grad = p.detach()
    snap = t.snapshot()
    refused = t.step()
    assert refused is not None and "parameter 0 of param group 0" in refused[1] and "own memory" in refused[1]
    t.assert_unchanged(snap)


def test_a_float32_gradient_after_bf16_ones_changes_the_launch():
    """float32 gradients of 16-bit parameters are taken: the step after the
    dtype change launches them apart, as the full path does."""
    t = Twin(main=True)
    t.warm()
    for s in range(3, 7):
        t.grads(s, change=lambda i, g: g.float() if s % 2 and i != 4 else g)
        assert t.step() is None
        t.assert_same()


def test_parameters_without_a_gradient_in_some_steps():
    """A parameter left out of a step keeps its count (the plan does not
    take the full path for that) and, back, is stepped with its own count:
    the counts below are the steps each parameter had a gradient in."""
    t = Twin()
    which = [None, {0, 2}, {1, 3, 5}, None, {0}, set(), None, {4, 6}, None]
    for s, w in enumerate(which):
        t.grads(s, w)
        assert t.step() is None
        t.assert_same()
    counts = [sum(1 for w in which if w is None or i in w) for i in range(len(SPECS))]
    assert [t.opt.state[p]["step"] for p in t.ours] == counts
    assert t.full_steps == 1


def test_neighbours_of_one_kind_with_different_counts():
    """Parameters of one kind side by side whose counts differ (one missed a
    step) are launched apart, each with its own step, as the full path does."""
    specs = [((3,), torch.bfloat16)] * 4 + [((2,), torch.float32)] * 2
    t = Twin(groups=lambda ps: ps, specs=specs)
    which = [None, None, {0, 2, 4}, None, {1, 3, 5}, None, None]
    for s, w in enumerate(which):
        t.grads(s, w)
        assert t.step() is None
        t.assert_same()
    assert [t.opt.state[p]["step"] for p in t.ours] == [6, 6, 6, 6, 6, 6]
    t.grads(7, {0, 1})
    t.step()
    t.grads(8)
    assert t.step() is None
    t.assert_same()
    assert [t.opt.state[p]["step"] for p in t.ours] == [8, 8, 7, 7, 7, 7]
    assert t.full_steps == 1


def test_a_first_gradient_after_the_plan():
    """A parameter that had no gradient when the plan was recorded (no state
    yet) gets its state and first step as in the full path."""
    t = Twin()
    for s in range(3):
        t.grads(s, which={0, 1, 2})
        assert t.step() is None
    t.grads(3)
    assert t.step() is None
    t.assert_same()
    assert [t.opt.state[p]["step"] for p in t.ours] == [4, 4, 4, 1, 1, 1, 1]


def test_add_param_group_after_a_step():
    t = Twin()
    t.warm()
    extra = [torch.nn.Parameter(torch.full((3,), 0.5, dtype=torch.bfloat16)) for _ in range(2)]
    t.both(lambda ps, opt: opt.add_param_group({"params": [p := torch.nn.Parameter(extra[0].detach().clone())],
                                                "lr": 1e-2}) or ps.append(p))
    t.steps_alike(range(3, 6))
    assert t.opt.state[t.ours[-1]]["step"] == 3


def test_load_state_dict_after_a_step():
    """Loading a checkpoint after steps, then stepping, gives the state a
    fresh optimizer loaded with the same checkpoint gets from the same step."""
    t = Twin()
    t.warm()
    saved = copy.deepcopy(t.opt.state_dict())
    for s in range(3, 5):
        t.grads(s)
        t.step()
    for p, q in zip(t.ours, t.ref):  # back to the saved parameters
        q.data = p.data.clone()
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in t.ours]
    fresh = FusedAdamW(two_groups(fresh_params), lr=1e-3)
    fresh.load_state_dict(copy.deepcopy(saved))
    t.both(lambda ps, opt: opt.load_state_dict(copy.deepcopy(saved)))
    for s in range(5, 8):
        t.grads(s)
        g = torch.Generator().manual_seed(s)
        for p in fresh_params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        assert t.step() is None
        fresh.step()
        t.assert_same()
    for p, q in zip(t.ours, fresh_params):
        assert torch.equal(p.detach(), q.detach())
        for k, v in t.opt.state[p].items():
            assert torch.equal(v, fresh.state[q][k]) if isinstance(v, torch.Tensor) else v == fresh.state[q][k]


def test_data_swapped_between_steps():
    """New memory is stepped as the full path steps it; the same memory as
    another shape, layout or dtype, with a gradient that no longer matches,
    is refused as before."""
    t = Twin(main=True)
    t.warm()

    def swap(i, f):
        for ps in (t.ours, t.ref):
            ps[i].data = f(ps[i].data)

    swap(0, lambda d: d.clone() + 1)  # new memory
    t.grads(3)
    assert t.step() is None
    t.assert_same()
    for i, f, back, message in [
            (3, lambda d: d.t(), lambda d: d.t(), "must be contiguous"),
            (0, lambda d: d.view(20), lambda d: d.view(4, 5), "must have the parameter's shape"),
            (5, lambda d: d.view(torch.float16), lambda d: d.view(torch.bfloat16),
             r"must have the parameter's dtype \(float16\)")]:
        swap(i, f)  # the same memory (the address the plan recorded) seen another way
        t.grads(4)  # gradients for the parameters as they were
        snap = t.snapshot()
        refused = t.step()
        assert refused is not None and re.search(message, refused[1]), refused
        t.assert_unchanged(snap)
        swap(i, back)
        t.grads(5)
        assert t.step() is None
        t.assert_same()


@pytest.mark.parametrize("edit", ["clear", "pop", "replace", "count", "tensor_count", "new_state_mapping"])
def test_state_edited_between_steps(edit):
    t = Twin()
    t.warm()
    if edit == "clear":
        t.both(lambda ps, opt: opt.state[ps[0]].clear())
    elif edit == "pop":
        t.both(lambda ps, opt: opt.state.pop(ps[1]))
    elif edit == "replace":
        t.both(lambda ps, opt: opt.state.__setitem__(ps[2], {}))
    elif edit == "count":
        t.both(lambda ps, opt: opt.state[ps[3]].__setitem__("step", 10))
    elif edit == "tensor_count":
        t.both(lambda ps, opt: opt.state[ps[3]].__setitem__("step", torch.tensor(3)))
    else:
        t.both(lambda ps, opt: setattr(opt, "state", type(opt.state)(dict)))
    t.steps_alike(range(3, 6))


def test_a_master_given_to_a_float32_parameter_is_refused():
    t = Twin()
    t.warm()
    t.both(lambda ps, opt: opt.state[ps[1]].__setitem__("master_param", ps[1].detach().clone()))
    t.grads(3)
    snap = t.snapshot()
    refused = t.step()
    assert refused is not None and "parameter 1 of param group 0 (shape (5,)) is float32 but its state holds a " \
        "'master_param'" in refused[1]
    t.assert_unchanged(snap)


@pytest.mark.parametrize("edit", ["drop_master", "bf16_moments"])
def test_masters_and_moments_edited_between_steps(edit):
    """A bf16 parameter's master dropped, or its moments put in bfloat16 in a
    float32-moment group: launched as the full path launches them (apart
    from the others)."""
    t = Twin()
    t.warm()
    if edit == "drop_master":
        t.both(lambda ps, opt: opt.state[ps[0]].pop("master_param"))
    else:
        t.both(lambda ps, opt: opt.state[ps[3]].update(exp_avg=opt.state[ps[3]]["exp_avg"].bfloat16(),
                                                       exp_avg_sq=opt.state[ps[3]]["exp_avg_sq"].bfloat16()))
    t.steps_alike(range(3, 6))


def test_param_groups_edited_by_hand():
    t = Twin()
    t.warm()
    edits = [lambda ps, opt: opt.param_groups[0]["params"].pop(1),
             lambda ps, opt: opt.param_groups[0]["params"].insert(0, ps[1]),
             lambda ps, opt: opt.param_groups.__setitem__(1, dict(opt.param_groups[1], lr=5e-3)),
             lambda ps, opt: opt.param_groups[0].__setitem__("lr", 7e-4),
             lambda ps, opt: opt.param_groups[0].__setitem__("lr", torch.tensor(2e-3)),
             lambda ps, opt: opt.param_groups[1]["params"].append(ps[0]),  # in two groups: stepped twice
             lambda ps, opt: opt.param_groups[1]["params"].pop()]
    for s, edit in enumerate(edits):
        t.both(edit)
        for k in range(2):
            t.grads(10 * s + k)
            assert t.step() is None
            t.assert_same()


def test_a_bad_group_value_after_the_plan_is_refused_as_before():
    t = Twin()
    t.warm()
    t.both(lambda ps, opt: opt.param_groups[1].__setitem__("lr", -1.0))
    t.grads(3)
    snap = t.snapshot()
    refused = t.step()
    assert refused == (ValueError, "FusedAdamW: param_groups[1]['lr'] must be >= 0, got -1.0")
    t.assert_unchanged(snap)


def test_main_grad_appearing_and_going():
    t = Twin()
    t.both(lambda ps, opt: [g.__setitem__("use_main_grad", True) for g in opt.param_groups])
    for s in range(6):
        t.grads(s)
        for i, (p, q) in enumerate(zip(t.ours, t.ref)):
            if (i + s) % 3 == 0:
                mg = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * s + i))
                p.main_grad, q.main_grad = mg.clone(), mg.clone()
            else:
                p.main_grad = q.main_grad = None
        assert t.step() is None
        t.assert_same()


def _dtensor_body(rank, world):
    """FusedAdamW against FullPath on Shard(0) DTensor parameters of a
    2-rank mesh (one too small to give rank 1 anything): 7 steps, with
    FSDP2's swap of a parameter's local tensor (reset_sharded_param) before
    step 3 and a gradient of other placements at step 5 (refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    specs = [((8, 4), torch.bfloat16), ((6,), torch.float32), ((1,), torch.bfloat16), ((5, 3), torch.bfloat16)]

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g).to(d), mesh, [Shard(0)]))
                for s, d in specs]

    ours, ref = params(), params()
    opt, ref_opt = FusedAdamW(ours, lr=1e-2), FullPath(ref, lr=1e-2)
    full = []
    checked = opt._checked
    opt._checked = lambda: full.append(1) or checked()
    out = {"refusals": [], "empty_local": ours[2].to_local().numel() == 0}
    for s in range(7):
        g = torch.Generator().manual_seed(s)
        for i, (p, q) in enumerate(zip(ours, ref)):
            x = torch.randn(p.shape, generator=g).to(p.dtype)
            # (the (1,) parameter: on rank 0 a replicated gradient's local shape is the shard's)
            placements = [Replicate()] if (s, i) == (5, 2) else p.placements
            p.grad = distribute_tensor(x.clone(), mesh, placements)
            q.grad = distribute_tensor(x.clone(), mesh, placements)
        if s == 3:
            for p in (ours[0], ref[0]):
                p._local_tensor = p._local_tensor.clone()
        got = []
        for o in (opt, ref_opt):
            try:
                o.step()
                got.append(None)
            except Exception as e:  # noqa: BLE001 - compared in the test
                got.append((type(e).__name__, str(e)))
        out["refusals"].append(got)
    same = True
    for p, q in zip(ours, ref):
        same &= torch.equal(p.to_local(), q.to_local()) and p._version == q._version
        for k, v in opt.state[p].items():
            w = ref_opt.state[q][k]
            same &= (type(v) is type(w) and torch.equal(v.to_local(), w.to_local())) if isinstance(v, torch.Tensor) \
                else v == w
    out["same"], out["full_steps"] = bool(same), len(full)
    out["steps"] = [opt.state[p]["step"] for p in ours]
    return out


def test_dtensor_parameters_follow_the_plan(tmp_path):
    import torch.distributed as dist

    from helpers import run_ranks

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    for rank, r in enumerate(run_ranks(_dtensor_body, (), 2, tmp_path, "FusedAdamW DTensor workers", store="tcp")):
        assert r["same"]
        assert r["empty_local"] == (rank == 1)  # the (1,) parameter leaves rank 1 nothing
        refusals = r["refusals"]
        assert all(a == b for a, b in refusals), refusals
        assert [a is None for a, _ in refusals] == [True] * 5 + [False, True]
        assert "placements" in refusals[5][0][1] and "parameter 2 of param group 0" in refusals[5][0][1]
        # the full path: the first step, the one after the swap, the refused one and the one after it
        assert r["full_steps"] == 4, r["full_steps"]
        assert r["steps"] == [6, 6, 6, 6]
