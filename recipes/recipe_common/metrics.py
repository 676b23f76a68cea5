"""How the recipes report a run (shared by recipes/esm2 and recipes/llama3).

MFU divides a recipe's useful FLOPs rate (each recipe counts its model's:
esm2_recipe/metrics.py, llama3_recipe/trainer.py's causal_lm_train_flops) by the bf16 peak of every
GPU in the job: 794 TFLOP/s measured on the H200 (the project's ceiling,
benchmarks/harness.py) and 989 TFLOP/s datasheet, also for FP8 runs (so
FP8's MFU is comparable to bf16's).

MetricLogger: the console (a tqdm bar on rank 0 where tqdm is installed),
TensorBoard (torch.utils.tensorboard where tensorboard is installed,
otherwise a logged line saying it is off) and an optional JSON-lines file.
``batch_seq_lengths``: the real sequence lengths of a collated batch.
"""
from __future__ import annotations

import json
import logging
import os

log = logging.getLogger("recipe.metrics")

H200_BF16_MEASURED_TFLOPS = 794.0
H200_BF16_DATASHEET_TFLOPS = 989.0


def batch_seq_lengths(batch) -> list:
    """Real sequence lengths of a collated batch (packed or padded)."""
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"].tolist()
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return lens[: int(batch["num_sequences"])]  # drop the FP8 padding segment
    return batch["attention_mask"].sum(-1).tolist()


class MetricLogger:
    def __init__(self, cfg, rank: int, total_steps: int, start_step: int, logger=None):
        self.logger = logger or log  # the recipe's logger
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
                self.logger.info("progress bar: off (tqdm is not installed)")
        if cfg.logging.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
                self.logger.info("TensorBoard: writing to %s", cfg.logging.tensorboard_dir)
            except ImportError as e:
                self.logger.warning("TensorBoard: off (%s); metrics go to the console%s", e,
                            " and the JSON-lines file" if cfg.logging.metrics_jsonl else "")
        else:
            self.logger.info("TensorBoard: off (logging.tensorboard_dir is null)")
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
            self.logger.info("step %d: %s", step, text)
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
