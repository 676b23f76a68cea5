"""What a training step costs and how the recipe reports it.

FLOPs: the useful work of one MLM training step over the REAL tokens of a
batch (padding is not work the model needed, so padded layouts do not get
credit for it): forward + backward = 3 x forward, forward per token =
2 x (matmul parameters of the layers and the LM head) plus attention,
4 x hidden per layer per attended position (QK^T and PV, 2 FLOPs each), so
a sequence of length s adds 4 * h * s^2 per layer.  MFU divides the rate by
the bf16 peak of every GPU in the job: 794 TFLOP/s measured on the H200 (the
project's ceiling, benchmarks/harness.py) and 989 TFLOP/s datasheet, also
for FP8 runs (so FP8's MFU is comparable to bf16's).

MetricLogger: the console (a tqdm bar on rank 0 where tqdm is installed),
TensorBoard (torch.utils.tensorboard where tensorboard is installed,
otherwise a logged line saying it is off) and an optional JSON-lines file.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("esm2")

H200_BF16_MEASURED_TFLOPS = 794.0
H200_BF16_DATASHEET_TFLOPS = 989.0


def matmul_params(hidden: int, ffn: int, layers: int, vocab: int = 33) -> int:
    """Weights that a token multiplies through: QKV + out (4 h^2), FC1 + FC2
    (2 h f) per layer, LM head dense (h^2) and decoder (h V)."""
    return layers * (4 * hidden * hidden + 2 * hidden * ffn) + hidden * hidden + hidden * vocab


def train_flops(seq_lengths, hidden: int, ffn: int, layers: int, vocab: int = 33) -> float:
    """FLOPs of forward + backward over sequences of these (real) lengths."""
    tokens = float(sum(seq_lengths))
    sq = float(sum(int(s) * int(s) for s in seq_lengths))
    fwd = 2.0 * matmul_params(hidden, ffn, layers, vocab) * tokens + 4.0 * hidden * layers * sq
    return 3.0 * fwd


def batch_seq_lengths(batch) -> list:
    """Real sequence lengths of a collated batch (packed or padded)."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return lens[: int(batch["num_sequences"])]  # drop the FP8 padding segment
    return batch["attention_mask"].sum(-1).tolist()


class MetricLogger:
    def __init__(self, cfg, rank: int, total_steps: int, start_step: int):
        self.rank = rank
        self.bar = None
        self.tb = None
        self.jsonl = None
        if rank != 0:
            return
        if cfg.logging.progress_bar:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total_steps, initial=start_step, desc=cfg.run_name, dynamic_ncols=True)
            except ImportError:
                log.info("progress bar: off (tqdm is not installed)")
        if cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
                log.info("TensorBoard: writing to %s", cfg.logging.tensorboard_dir)
            except ImportError as e:
                log.warning("TensorBoard: off (%s); metrics go to the console%s", e,
                            " and the JSON-lines file" if cfg.logging.metrics_jsonl else "")
        else:
            log.info("TensorBoard: off (logging.tensorboard_dir is null)")
        if cfg.logging.metrics_jsonl:
            d = os.path.dirname(os.path.abspath(cfg.logging.metrics_jsonl))
            os.makedirs(d, exist_ok=True)
            self.jsonl = open(cfg.logging.metrics_jsonl, "a")

    def advance(self, n: int = 1):
        if self.bar is not None:
            self.bar.update(n)

    def log(self, step: int, metrics: dict):
        if self.rank != 0:
            return
        text = " ".join(_fmt(k, v) for k, v in metrics.items())
        if self.bar is not None:
            if "loss" in metrics:
                self.bar.set_postfix_str(f"loss={metrics['loss']:.4f}", refresh=False)
            self.bar.write(f"step {step}: {text}")
        else:
            log.info("step %d: %s", step, text)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()


def _fmt(k, v):
    if isinstance(v, float):
        if k.endswith("tokens_per_s"):
            return f"{k}={v:,.0f}"
        return f"{k}={v:.4g}"
    return f"{k}={v}"
