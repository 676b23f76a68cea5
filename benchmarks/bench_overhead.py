"""Host overhead of one seqfuse._C call taking three torch tensors, beside the
cheapest torch op, in microseconds per call.

Rows: the probe (imports three tensors, launches nothing) through the DLPack
C exchange API and through __dlpack__ capsules; seqfuse.ops.amax with its
kernel launch; torch.add on tiny tensors; reading data_ptr/shape/stride of
three tensors in Python.  Run on the GPU machine for the figure in
benchmarks/results/PERFORMANCE_HISTORY.md; on a CPU-only machine it measures CPU tensors.
"""
import torch

import seqfuse
from seqfuse import _C

from harness import Table, host_time_us


def main():
    device = "cuda" if seqfuse.cuda_available() and torch.cuda.is_available() else "cpu"
    a = torch.randn(16, device=device)
    b = torch.randn(16, device=device)
    c = torch.randn(16, device=device)
    out = torch.empty((), device=device)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else None
    table = Table("overhead", ["call", "device", "us_per_call"])
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")

    if fast:
        _C.set_exchange_api(True)
        table.add(call="_C.probe(a,b,c) via C exchange API", device=device,
                  us_per_call=host_time_us(lambda: _C.probe(a, b, c)))
        table.add(call="ops.amax(x) (launch, exchange API)", device=device,
                  us_per_call=host_time_us(lambda: seqfuse.ops.amax(a, out=out)))
    _C.set_exchange_api(False)
    table.add(call="_C.probe(a,b,c) via __dlpack__ capsules", device=device,
              us_per_call=host_time_us(lambda: _C.probe(a, b, c, stream)))
    table.add(call="_C.amax(x,out) (launch, capsules)", device=device,
              us_per_call=host_time_us(lambda: _C.amax(a, out, stream)))
    _C.set_exchange_api(True)
    table.add(call="torch.add(a, b)", device=device,
              us_per_call=host_time_us(lambda: torch.add(a, b)))
    table.add(call="torch.add(a, b, out=c)", device=device,
              us_per_call=host_time_us(lambda: torch.add(a, b, out=c)))
    table.add(call="data_ptr+shape+stride of 3 tensors", device=device,
              us_per_call=host_time_us(lambda: [(t.data_ptr(), t.shape, t.stride()) for t in (a, b, c)]))
    if device == "cuda":
        torch.cuda.synchronize()
    table.save({"exchange_api_available": fast})


if __name__ == "__main__":
    main()
