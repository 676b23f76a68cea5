"""Tolerances and checks shared by the tests (device METHOD.md): the one
error-bound policy for float kernels (below, at REL_TOL), the skip conditions
of tests that need float8 DLPack or CPU FSDP2, small references (norms,
rotary embedding, activations), stand-ins (an RNG tracker, recorded kernel
entries), claims several Hugging Face tests make (same logits and losses as
transformers, conversions refusing bad state dicts), and the multi-process
scaffolding of the distributed tests (run_ranks: a process group of N
workers, each computing its results, collected by the test)."""
import contextlib
import copy
import functools
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from seqfuse.ops._call import FP8_DLPACK

#: Marks a test that passes float8 tensors to seqfuse (every FP8 recipe,
#: quantizer and FP8 GEMM does): torch releases that cannot export float8
#: through DLPack (2.6 and older) skip it with the reason instead of failing
#: on the ops' NotImplementedError.  seqfuse.ops._call.FP8_DLPACK decides.
needs_fp8 = pytest.mark.skipif(
    not FP8_DLPACK,
    reason=f"torch {torch.__version__} cannot export float8 tensors through DLPack "
           "(seqfuse's FP8 ops need a torch that can)")

#: Marks a test that runs FSDP2 (fully_shard) on CPU tensors over gloo: torch
#: 2.6's FSDP2 records events on a CPU stream, which that torch's
#: torch.cpu.Stream cannot do.
needs_cpu_fsdp2 = pytest.mark.skipif(
    not hasattr(torch.cpu.Stream, "record_event"),
    reason=f"torch {torch.__version__}'s FSDP2 cannot run on CPU tensors "
           "(torch.cpu.Stream has no record_event)")

# ---- the error-bound policy for float kernels ----------------------------------
# Errors are relative, ||out - ref|| / ||ref|| (rel_error), against a float64
# reference (or a float32 one where float64 is out of reach).  The rule is
# flash-attention's: a kernel's error is at most twice torch's own error for
# the same computation in the same dtype.  A test that has torch's result at
# hand asserts that rule (torch_bound); every other test asserts the dtype
# table REL_TOL, which is that bound written down once per dtype for one
# output computed in that dtype.  Two derived bounds, never separate tables:
#   - pair_tol: two results that each carry REL_TOL of error (the CUDA kernel
#     against the CPU backend, two kernels, seqfuse against torch in the same
#     dtype) may differ by twice it;
#   - BACKWARD_FACTOR: attention's gradients pass through two more matmuls and the
#     softmax's backward than its output, and get three times the table.
# A test may assert tighter than these; one that needs looser says why where
# it passes a factor (TF32 GEMMs, say).  The C check programs
# (csrc/core/check_util.h check_tol, csrc/attn/check_attn*.cu) compare CUDA
# against the CPU backend: their table is pair_tol's.

#: Relative-error bounds by the dtype of the computation's inputs.
REL_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}

#: attention gradients (dq, dk, dv): this many times REL_TOL
BACKWARD_FACTOR = 3

#: flash-attention's rule: at most this many times torch's own error
TORCH_FACTOR = 2.0


def rel_tol(dtype, factor=1.0):
    """REL_TOL of dtype, times factor."""
    return REL_TOL[dtype] * factor


def pair_tol(dtype, factor=1.0):
    """Bound on the error between two results that each hold rel_tol(dtype,
    factor) against the exact one: twice it."""
    return REL_TOL[dtype] * factor * 2


def torch_bound(torch_error, factor=TORCH_FACTOR, floor=0.0):
    """Bound on a kernel's error from torch's own error for the same
    computation in the same dtype (both against one float64/float32
    reference): factor times it, at least floor (torch's error can be near
    zero on tiny problems)."""
    return max(factor * torch_error, floor)

POISON = float("nan")


def act_reference(name, x):
    """The activation ``name`` of seqfuse's LayerNormMLP (Transformer Engine's
    names; its "gelu" is the tanh approximation) in plain torch."""
    if name == "gelu":
        return F.gelu(x, approximate="tanh")
    if name == "gelu_erf":
        return F.gelu(x)
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    if name == "swiglu":
        a, g = x.chunk(2, dim=-1)
        return F.silu(a) * g
    if name == "geglu":
        a, g = x.chunk(2, dim=-1)
        return F.gelu(a, approximate="tanh") * g
    raise ValueError(name)


def norm_reference(x, w, b, eps, kind, zero_centered_gamma=False):
    """LayerNorm or RMSNorm (``kind``, Transformer Engine's names) of x over its
    last dimension in plain torch; with ``zero_centered_gamma`` the weight is
    stored as gamma - 1 (TE's zero_centered_gamma)."""
    w = w + 1 if zero_centered_gamma else w
    if kind == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def rope_reference(t, angles):
    """Rotary embedding of t [b, s, h, d] by angles [s, d], the half-split
    pairing (rotate_half: element i turns with element i + d/2)."""
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    d = t.shape[-1]
    return t * cos + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * sin


def seeded_rng_tracker(seed):
    """A stand-in for Megatron's RNG state tracker as TE's
    ``get_rng_state_tracker`` argument takes it (a callable returning the
    tracker): a class whose ``fork(name)`` appends name to the class list
    ``calls`` and runs its block with the CPU generator seeded ``seed``, the
    caller's generator state restored afterwards."""

    class Tracker:
        calls = []

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            Tracker.calls.append(name)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                yield

    return Tracker


def rel_error(out, ref):
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    assert not torch.isnan(out).any(), "output holds NaN (an unwritten element?)"
    denom = ref.norm()
    if denom == 0:
        return out.norm().item()
    return ((out - ref).norm() / denom).item()


def check_same_logits_and_losses(hf, sf, b, losses=("loss",), tol=1e-5):
    """The batch ``b`` through transformers' model ``hf`` and seqfuse's
    ``sf`` holding the same weights: the logits at the real tokens
    (attention_mask 1) and each scalar output named in ``losses`` agree
    within ``tol`` (relative); then both models' losses are backpropagated,
    for the caller to compare the gradients.  Returns (hf's output, seqfuse's)."""
    exp, out = hf(**b), sf(**b)
    real = b["attention_mask"].bool()
    assert rel_error(out.logits[real], exp.logits[real]) <= tol
    for name in losses:
        e, o = getattr(exp, name).item(), getattr(out, name).item()
        assert abs(o - e) <= tol * e, (name, o, e)
    exp.loss.backward()
    out.loss.backward()
    return exp, out


def assert_close_rel(out, ref, dtype, factor=1.0):
    err = rel_error(out, ref)
    tol = REL_TOL[dtype] * factor
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e} for {dtype}"


def poisoned_like(t):
    """An output buffer filled with NaN (or 0xFF bytes for integer and fp8
    types) so an element the kernel forgot to write cannot pass."""
    out = torch.empty_like(t)
    if out.dtype.is_floating_point and out.element_size() >= 2:
        out.fill_(POISON)
    else:
        out.view(torch.uint8).fill_(0xFF)
    return out


def block_dequantized_ref(x, fp8_dtype=torch.float8_e4m3fn, columnwise=False):
    """float64 values of x [M, K] after 1x128 block FP8 quantization, in plain
    torch: blocks of 128 along K (row-wise), or along M with M zero-padded to
    a multiple of 128 (column-wise, seqfuse's rowcol layout).  Scale per
    block fp8_max / amax (1 for an all-zero block), saturating cast."""
    fmax = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[fp8_dtype]
    xf = x.detach().float().cpu()
    if columnwise:
        m = xf.shape[0]
        xf = torch.nn.functional.pad(xf, (0, 0, 0, (-m) % 128)).t().contiguous()
    rows, k = xf.shape
    blocks = xf.view(rows, k // 128, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), torch.tensor(fmax) / amax)
    q = (blocks * s).clamp(-fmax, fmax).to(fp8_dtype).float() * (1 / s)
    q = q.view(rows, k).double()
    return q.t()[: x.shape[0]] if columnwise else q


def block128_dequantized_ref(w):
    """float64 values of w [N, K] after 128x128 block E4M3 quantization."""
    wf = w.detach().float().cpu()
    n, k = wf.shape
    blocks = wf.view(n // 128, 128, k // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), torch.tensor(448.0) / amax)
    q = (blocks * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * (1 / s)
    return q.view(n, k).double()


def fp8_steps(a, b):
    """Distance in representable steps between two float8 tensors of the
    same format (elementwise, int32): the sign-magnitude codes are mapped to
    signed ordinals, so +0 and -0 are equal and the codes either side of zero
    are one step apart.  Comparing raw codes would call a sign-of-zero flip
    128 steps."""
    def ordinal(t):
        c = t.view(torch.uint8).int()
        mag = c & 0x7F
        return torch.where(c >= 0x80, -mag, mag)
    return (ordinal(a) - ordinal(b.to(a.device))).abs()


def seqfuse_attention_only(monkeypatch):
    """Pins ops.attention to seqfuse's own kernels for one test (the kernel
    tests check those; on an H200 the default sends padding-free bshd/sbhd
    calls to cuDNN): the backend choice and its cache are put back after."""
    from seqfuse.ops.attn import _routing as routing

    monkeypatch.setattr(routing, "_backend", "seqfuse")
    monkeypatch.setattr(routing, "_choices", {})



def fresh_routing(monkeypatch, backend="auto", ragged_on=False):
    """Gives one test the attention routing state of a fresh process, put back
    after: backend ``backend``, the opt-in cuDNN ragged route on only when
    ``ragged_on`` (whatever SEQFUSE_ATTN_CUDNN_RAGGED says), and empty choice,
    failure, log and capability caches (so no earlier test's choice leaks in)."""
    from seqfuse.ops import _call
    from seqfuse.ops.attn import _routing as routing

    monkeypatch.setattr(routing, "_backend", backend)
    monkeypatch.setattr(routing, "_ragged_on", ragged_on)
    monkeypatch.setattr(routing, "_choices", {})
    monkeypatch.setattr(routing, "_cudnn_picked", {})
    monkeypatch.setattr(routing, "_route_failed", {})
    monkeypatch.setattr(routing, "_logged", set())
    monkeypatch.setattr(_call, "_capabilities", {})


def record_calls(monkeypatch, module, name, standin_for):
    """Replace ``module.name`` (a kernel entry a route calls) for the test by
    the stand-in ``standin_for(calls)`` makes, and return ``calls``: the list
    the stand-in records each call's arguments in."""
    calls = []
    monkeypatch.setattr(module, name, standin_for(calls))
    return calls


def grads_of(fn, tensors, dout):
    """``fn(*tensors)`` run on detached copies and its backward from ``dout``:
    (the output, the input gradients)."""
    xs = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*xs)
    out.backward(dout)
    return out.detach(), [x.grad for x in xs]


def check_strict_from_pretrained(model_cls, path, extra_key, extra_tensor, missing_key):
    """``model_cls.from_pretrained(path)``, ``path`` a directory a seqfuse
    model was saved to (save_pretrained, one model.safetensors), is strict:
    with ``extra_key`` (holding ``extra_tensor``) added to the weights a
    ValueError names it, with ``missing_key`` taken out a KeyError names it."""
    import re

    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    sd = load_file(weights)
    save_file({**sd, extra_key: extra_tensor}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(extra_key)):
        model_cls.from_pretrained(path)
    del sd[missing_key]
    save_file(sd, weights, metadata={"format": "pt"})
    with pytest.raises(KeyError, match=re.escape(missing_key)):
        model_cls.from_pretrained(path)


def check_conversion_refused(convert, state_dict, config, error, match, drop=(), put=None):
    """A weight conversion (``convert(state_dict, config)``, a family's
    hf_to_seqfuse_state_dict or its inverse) of a copy of ``state_dict``
    with the keys ``drop`` removed and the entries of ``put`` set raises
    ``error`` whose message matches ``match`` (the key and the rule)."""
    sd = dict(state_dict)
    for key in drop:
        del sd[key]
    sd.update(put or {})
    with pytest.raises(error, match=match):
        convert(sd, config)


@functools.lru_cache(maxsize=None)
def setup_rules():
    """setup.py as a module (setuptools runs it as __main__; imported, it
    builds nothing): its build rules and toolkit lookup, for the tests."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.py")
    spec = importlib.util.spec_from_file_location("seqfuse_setup_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cuda_toolkit():
    """The CUDA toolkit's root by setup.py's own rule, or None: for tests
    that compile small programs."""
    return setup_rules().cuda_toolkit()


def free_port():
    """A TCP port free on 127.0.0.1 now (for a gloo process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_seed():
    """The seed of a randomised multi-process test: SEQFUSE_TEST_SEED when
    set, else a fresh one; printed, so a failure can be replayed."""
    seed = int(os.environ.get("SEQFUSE_TEST_SEED", torch.randint(0, 2**31 - 1, ()).item()))
    print(f"seed={seed}")
    return seed


def _rank_main(rank, world, backend, init_method, out_dir, body, args):
    """One worker of run_ranks: join the process group, save
    ``body(rank, world, *args)`` as <out_dir>/rank<rank>.pt, leave the group
    (with a barrier only when the body succeeded: a failed rank must not
    wait for the others, nor they for it)."""
    import torch.distributed as dist

    from seqfuse.distributed import end_process_group

    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # N workers on a few cores
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, **kw)
    ok = False
    try:
        results = body(rank, world, *args)
        if backend == "nccl":
            torch.cuda.synchronize()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        ok = True
    finally:
        end_process_group(ok)


def run_ranks(body, args, world, out_dir, what, backend="gloo", store="file", timeout=240,
              preload=("torch", "seqfuse")):
    """Run ``body(rank, world, *args)`` in ``world`` processes joined in one
    process group (``backend`` "gloo" on the CPU, or "nccl" with rank r on
    GPU r) and return their results, a list in rank order.

    ``body`` must be a module-level function of the test module (the workers
    import it by name) and return something torch.save can write; the
    assertions run in the test, on the returned results.  The rendezvous is
    a file in ``out_dir`` (``store="file"``) or a TCP port on 127.0.0.1
    (``store="tcp"``: much faster when the body makes many groups, e.g.
    device meshes).  gloo workers are forked from a forkserver that imported
    ``preload`` once (spawn re-imports torch per process, ~10 s each on the
    CI machine; a plain fork after many tests can inherit a held lock);
    NCCL workers are spawned (CUDA cannot be forked).  Past ``timeout``
    seconds the workers are killed and the test fails naming ``what``."""
    import multiprocessing

    if backend not in ("gloo", "nccl") or store not in ("file", "tcp"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl' and store 'file' or 'tcp', "
                         f"got {backend!r}, {store!r}")
    out_dir = str(out_dir)
    init = f"tcp://127.0.0.1:{free_port()}" if store == "tcp" else f"file://{os.path.join(out_dir, 'init')}"
    if backend == "gloo":
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    start = "forkserver" if backend == "gloo" else "spawn"
    run_workers(_rank_main, (world, backend, init, out_dir, body, args), world, start, what, timeout=timeout)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def raised(fn):
    """(exception class name, message) of fn(), or ("none", "") if it
    returned: what a run_ranks worker records of a call that must fail, for
    the test to check with check_raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
        return type(e).__name__, str(e)
    return "none", ""


def check_raised(rank_results, which, expected):
    """Every rank's ``results["bad"][which]`` (a ``raised`` record) is the
    exception class named ``expected[which][0]`` with a message containing
    ``expected[which][1]``."""
    kind, word = expected[which]
    for res in rank_results:
        got_kind, msg = res["bad"][which]
        assert got_kind == kind and word in msg, (which, got_kind, msg)


def run_workers(fn, args, nprocs, start_method, what, timeout=180):
    """torch.multiprocessing.start_processes(fn, args, nprocs) joined with a
    deadline: past ``timeout`` seconds the workers are killed and the test
    fails naming ``what`` (a hung rendezvous must not hang the suite)."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method=start_method)
    deadline = time.time() + timeout
    while not ctx.join(timeout=2):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish within {timeout} s")


@pytest.fixture(params=["exchange", "capsule"])
def dlpack_path(request):
    """Run a test through both DLPack import paths of seqfuse._C (a test
    module imports this fixture under the name it uses)."""
    from seqfuse import _C

    if request.param == "exchange" and not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip("this torch offers no DLPack C exchange API")
    previous = _C.set_exchange_api(request.param == "exchange")
    yield request.param
    _C.set_exchange_api(previous)


def grouped_and_per_expert_fp8_step(gl, lins, splits, recipe, first=None):
    """One FP8 forward and backward of GroupedLinear ``gl`` (its forward's
    is_first_microbatch ``first``) and of the per-expert Linears ``lins`` on
    the same input rows and output gradient (expert g takes rows
    ``splits``' run g): (y, dx) of each, as ((y, dx), (y_ref, dx_ref))."""
    from seqfuse.quantization import fp8_autocast

    offs = [0]
    for m in splits:
        offs.append(offs[-1] + m)
    x = torch.randn(offs[-1], gl.in_features, requires_grad=True)
    dy = torch.randn(offs[-1], gl.out_features)
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        y = gl(x, splits, first)
    y.backward(dy)
    xr = x.detach().clone().requires_grad_()
    with fp8_autocast(enabled=True, fp8_recipe=recipe):
        ref = torch.cat([lins[g](xr[offs[g]:offs[g + 1]]) for g, m in enumerate(splits) if m])
    ref.backward(dy)
    return (y.detach(), x.grad), (ref.detach(), xr.grad)


@contextlib.contextmanager
def no_host_sync():
    """Inside the block any CUDA call that synchronizes with the host raises
    (torch's sync debug mode "error"); the device is synchronized first, so
    earlier work does not count."""
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def assert_same_training(eager, graphed, loss_tol=1e-2, grad_tol=5e-2):
    """Two training runs of the same model and batches, ``eager`` and
    ``graphed`` each (losses, last step's gradients by name), that ran the
    same kernels in the same order: losses within ``loss_tol`` relative,
    every gradient within ``grad_tol`` (the backward's atomics may add in
    another order), and the loss went down (the optimizer's updates were
    seen by both)."""
    (le, ge), (lg, gg) = eager, graphed
    for a, b in zip(le, lg):
        assert abs(a - b) <= loss_tol * abs(a), (le, lg)
    assert ge.keys() == gg.keys()
    for n in ge:
        err = (ge[n].float() - gg[n].float()).norm() / ge[n].float().norm().clamp_min(1e-12)
        assert err <= grad_tol, (n, float(err))
    assert le[-1] < le[0]


def train_steps(model, opt, batches, recipe=None):
    """One optimizer step per batch (a dict of the model's keyword
    arguments, labels included) under seqfuse's autocast with ``recipe``
    (None: off).  Returns (the losses, the last step's gradients by
    parameter name)."""
    from seqfuse.quantization import autocast

    losses, grads = [], None
    for kw in batches:
        with autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(**kw).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def grouped_mlp_pair(hidden, ffn, experts, shape=(2, 333)):
    """Two bfloat16 CUDA GroupedMLPs (top-2) with the same weights, one on
    the device-split route and one reading the routing counts to the host,
    an output gradient of ``shape`` + [hidden] and two leaf copies of one
    input: (dev, host, x for dev, x for host, gradient)."""
    from seqfuse.modules import GroupedMLP

    dev = GroupedMLP(hidden, ffn, experts, 2, params_dtype=torch.bfloat16, device="cuda")
    host = GroupedMLP(hidden, ffn, experts, 2, params_dtype=torch.bfloat16, device="cuda", device_splits=False)
    host.load_state_dict(dev.state_dict())
    x = torch.randn(*shape, hidden, device="cuda").bfloat16()
    g = torch.randn(*shape, hidden, device="cuda").bfloat16()
    return dev, host, x.clone().requires_grad_(), x.clone().requires_grad_(), g



def assert_replays_only_plain_calls(model, replays, caplog, packed_ids):
    """A model whose layers were graphed for [2, 8] input_ids (stand-ins
    counted by ``replays()``) replays them for a plain and an all-ones-mask
    training call of that shape only: a padded, a hidden-states, an
    other-shape and a packed call (``packed_ids``, two sequences of 8) run
    eagerly and each says why."""
    ids = torch.randint(4, 16, (2, 8))
    model(input_ids=ids)
    model(input_ids=ids, attention_mask=torch.ones(2, 8, dtype=torch.long))
    replayed = replays()
    assert replayed > 0
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    with caplog.at_level(logging.WARNING):
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, output_hidden_states=True)
        model(input_ids=ids[:, :4])
        model(input_ids=packed_ids(ids), cu_seqlens=torch.tensor([0, 8, 16], dtype=torch.int32), max_seqlen=8)
    assert replays() == replayed
    said = " | ".join(r.getMessage() for r in caplog.records)
    for reason in ("padded call (attention_mask has zeros)", "output_hidden_states",
                   "input_ids (2, 4), graphed for (2, 8)", "packed (thd) call"):
        assert reason in said


def saved_activation_bytes(model, call):
    """Bytes of the distinct storages, parameters left out, that ``call()``
    (a training forward of ``model``) keeps for its backward, counted by
    saved-tensor hooks: what the autograd graph holds from the forward to
    the backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return sum(seen.values())


def train_alongside(model, ref, inputs, lr, loss_tol, check_grads, steps=3):
    """``steps`` AdamW steps of an accelerate()d ``model`` and its untouched
    ``ref`` on the same ``inputs`` (keyword arguments with labels): each
    step's losses within ``loss_tol`` relative, and ``check_grads(model,
    ref)`` after the first backward (the accelerate tests' shared loop).
    The optimizers are built here, after accelerate() (its fused weights)."""
    opt_a = torch.optim.AdamW(model.parameters(), lr=lr)
    opt_b = torch.optim.AdamW(ref.parameters(), lr=lr)
    for step in range(steps):
        out, exp = model(**inputs), ref(**inputs)
        assert abs(out.loss.item() - exp.loss.item()) <= loss_tol * exp.loss.item(), (step, out.loss, exp.loss)
        out.loss.backward()
        exp.loss.backward()
        if step == 0:
            check_grads(model, ref)
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(), opt_b.zero_grad()
    return out


def hf_fp8_grads_close(model, ref, tol=0.25):
    """An accelerate()d model's gradients under transformers' names within
    ``tol`` (E5M2 gradients) of its untouched reference's."""
    from seqfuse.hf.fuse_layers import hf_named_tensors

    grads = hf_named_tensors(model)
    for n, q in ref.named_parameters():
        if q.grad is not None and q.grad.norm() > 1e-6:
            assert rel_error(grads[n], q.grad) <= tol, (n, rel_error(grads[n], q.grad))


def hf_grads_close(model, ref, tol):
    """An accelerate()d model's gradients under transformers' names against
    its untouched reference's: the same ones present, each within ``tol``
    relative (a gradient that is 0 in exact arithmetic: both near 0)."""
    from seqfuse.hf.fuse_layers import hf_named_tensors

    grads = hf_named_tensors(model)
    scale = max(q.grad.double().norm().item() for q in ref.parameters() if q.grad is not None)
    for n, q in ref.named_parameters():
        g = grads[n]
        assert (g is None) == (q.grad is None), n
        if q.grad is None:
            continue
        if q.grad.double().norm().item() <= 1e-9 * scale:
            assert g.double().norm().item() <= 1e-6 * scale, n
        else:
            assert rel_error(g, q.grad) <= tol, (n, rel_error(g, q.grad))


def check_bf16_within_twice_plain(ref32, model, ids, mask, labels):
    """A bf16 accelerate()d ``model`` (made from ``ref32`` cast to bf16)
    against the float32 ``ref32``, bounded by twice plain transformers' bf16
    error against the same float32 model (at least bf16's REL_TOL): logits
    on the real tokens, the loss and every gradient."""
    from seqfuse.hf.fuse_layers import hf_named_tensors

    ref16 = copy.deepcopy(ref32).to(torch.bfloat16)
    real = mask.bool()
    with torch.no_grad():
        want = ref32(ids, attention_mask=mask).logits[real]
        e_plain = rel_error(ref16(ids, attention_mask=mask).logits[real].float(), want)
        e_sf = rel_error(model(ids, attention_mask=mask).logits[real].float(), want)
    assert e_sf <= torch_bound(e_plain, floor=rel_tol(torch.bfloat16)), (e_sf, e_plain)
    outs = [m(ids, attention_mask=mask, labels=labels) for m in (ref32, ref16, model)]
    l32, l16, lsf = (o.loss.float() for o in outs)
    assert abs(lsf - l32) <= torch_bound(abs(l16 - l32).item(), floor=rel_tol(torch.bfloat16) * l32.item())
    for o in outs:
        o.loss.backward()
    g_sf = hf_named_tensors(model)
    g16 = dict((n, p.grad) for n, p in ref16.named_parameters())
    for n, p in ref32.named_parameters():
        if p.grad is None or p.grad.norm() == 0:
            continue
        e_plain = rel_error(g16[n].float(), p.grad)
        e = rel_error(g_sf[n].float(), p.grad)
        assert e <= torch_bound(e_plain, floor=rel_tol(torch.bfloat16, 3)), (n, e, e_plain)


def nudge_biases_and_norms(model, norm_marker):
    """Move ``model``'s biases and the weights of parameters whose names
    contain ``norm_marker`` off their 0 / 1 initialisation (0.1 x normal), so
    that a mix-up between them shows in a comparison.  Returns the model."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or norm_marker in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


def padded_lm_batch(vocab, seed=1, b=2, s=13, low=1):
    """(ids in [low, vocab), attention mask with row 1 right-padded by 4,
    labels with -100 at the padding) from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, vocab, (b, s), generator=g)
    mask = torch.ones_like(ids)
    mask[1, s - 4:] = 0  # right padding in row 1
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
