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

The logger, the peak figures and batch_seq_lengths are shared with the
other recipes (recipes/recipe_common/metrics.py) and re-exported here.
"""
from recipe_common.metrics import (H200_BF16_DATASHEET_TFLOPS, H200_BF16_MEASURED_TFLOPS,  # noqa: F401
                                   MetricLogger, batch_seq_lengths)


def matmul_params(hidden: int, ffn: int, layers: int, vocab: int = 33) -> int:
    """Weights that a token multiplies through: QKV + out (4 h^2), FC1 + FC2
    (2 h f) per layer, LM head dense (h^2) and decoder (h V)."""
    return layers * (4 * hidden * hidden + 2 * hidden * ffn) + hidden * hidden + hidden * vocab


def train_flops(seq_lengths, hidden: int, ffn: int, layers: int, vocab: int = 33) -> float:
    """FLOPs of forward + backward over sequences of these (real) lengths."""
    tokens = float(sum(seq_lengths))
    sq = float(sum(int(s) * int(s) for s in seq_lengths))
    forward = 2.0 * matmul_params(hidden, ffn, layers, vocab) * tokens + 4.0 * hidden * layers * sq
    return 3.0 * forward
