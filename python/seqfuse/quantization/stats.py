"""Opt-in per-layer FP8 statistics for debugging a run: every N steps, for
each tensor a ScalingState covers, the amax, the scale, and the fraction of
the values cast that step that underflowed to zero or saturated.

    seqfuse.quantization.enable_stats(every=100, path="fp8_stats.jsonl")

One JSON object per line: {"step", "layer", "index", "fp8_dtype", "amax",
"scale", "underflow", "saturated", "numel"}.  "layer" is the state's name
(``name_states(model)`` names every state after its module path).  Logging
steps synchronize the host (they read values back); other steps cost one
attribute check per cast.
"""
import json
import logging

import torch

from .state import STATES, ScalingState

_log = logging.getLogger("seqfuse.fp8_stats")

_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0 ** -9, torch.float8_e5m2: 2.0 ** -16}
_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


class _Config:
    every = 0          # 0: off
    path = None
    step = 0
    pending = {}       # (id(state), index) -> partial record
    records = []       # everything written (kept for tests and notebooks)


_cfg = _Config()


def enable_stats(every=100, path=None):
    """Log statistics every ``every`` steps (a step ends at the outermost
    autocast exit), appending JSON lines to ``path`` (or to the
    "seqfuse.fp8_stats" logger at INFO when path is None)."""
    if int(every) < 1:
        raise ValueError(f"enable_stats: argument 'every' must be >= 1, got {every}")
    _cfg.every, _cfg.path, _cfg.step = int(every), path, 0
    _cfg.pending, _cfg.records = {}, []


def disable_stats():
    _cfg.every = 0


def stats_records():
    """The records logged so far (since enable_stats)."""
    return list(_cfg.records)


def enabled():
    """True while statistics are on (enable_stats), whether or not this step records."""
    return _cfg.every > 0


def recording():
    """True when this step's casts should be measured."""
    return _cfg.every > 0 and _cfg.step % _cfg.every == 0


def name_states(model):
    """Name every ScalingState in ``model`` after its module path."""
    for name, m in model.named_modules():
        if isinstance(m, ScalingState):
            m.name = name or "root"


def record_cast(state, index, x, scale, fp8_dtype):
    """Measure one cast of ``x`` with ``scale`` (called by quantize_with_state
    on recording steps)."""
    with torch.no_grad():
        y = (x.float() * scale.float()).abs()
        nz = x != 0
        under = (nz & (y <= _MIN_SUBNORMAL[fp8_dtype] / 2)).sum().item()
        sat = (y > _MAX[fp8_dtype]).sum().item()
    rec = _cfg.pending.setdefault((id(state), index), {
        "layer": state.name or f"state{id(state):x}", "index": index,
        "fp8_dtype": str(fp8_dtype).replace("torch.", ""),
        "underflow_count": 0, "saturated_count": 0, "numel": 0})
    rec["underflow_count"] += under
    rec["saturated_count"] += sat
    rec["numel"] += x.numel()


def before_update(chunk):
    """Read amax (row 0, after the all-reduce) and scale of every recorded
    tensor of this chunk before the update rolls them away."""
    if not recording() or not _cfg.pending:
        return
    for state in list(STATES):
        ref = getattr(state, "_chunk_ref", None)
        if ref is None or ref() is not chunk:
            continue
        amax = state.amax.detach().cpu().tolist()
        scale = state.scale.detach().cpu().tolist()
        for i in range(state.num_tensors):
            rec = _cfg.pending.get((id(state), i))
            if rec is not None:
                rec["amax"], rec["scale"] = amax[i], scale[i]


def end_step():
    if _cfg.every <= 0:
        return
    if recording() and _cfg.pending:
        lines = []
        for rec in _cfg.pending.values():
            n = max(rec["numel"], 1)
            out = {"step": _cfg.step, "layer": rec["layer"], "index": rec["index"],
                   "fp8_dtype": rec["fp8_dtype"], "amax": rec.get("amax"),
                   "scale": rec.get("scale"), "underflow": rec["underflow_count"] / n,
                   "saturated": rec["saturated_count"] / n, "numel": rec["numel"]}
            _cfg.records.append(out)
            lines.append(json.dumps(out))
        if _cfg.path:
            with open(_cfg.path, "a") as f:
                f.write("\n".join(lines) + "\n")
        else:
            for line in lines:
                _log.info(line)
    _cfg.pending = {}
    _cfg.step += 1
