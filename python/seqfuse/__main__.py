"""python -m seqfuse: print what was built and what runs here, then run a
self-check of the CPU backend (and the CUDA backend where a GPU is usable)
against torch on fresh random inputs.  Exits non-zero if a check fails."""
import sys


def main():
    import platform

    import torch

    import seqfuse

    info = seqfuse.build_info()
    print(f"seqfuse {seqfuse.__version__}  (python {platform.python_version()}, torch {torch.__version__})")
    print(f"  built with CUDA : {info['cuda']}  archs={info['cuda_archs'] or '-'}  "
          f"runtime={info['cuda_runtime']}  cuBLASLt={info['cublaslt']}  NCCL={info['nccl']}")
    print(f"  CUDA usable now : {seqfuse.cuda_available()}  devices={seqfuse.device_info()}")
    exchange = "DLPack C exchange API" if seqfuse.ops.exchange_api_in_use() else "__dlpack__ capsules"
    print(f"  tensor exchange : {exchange}")

    failures = 0
    devices = ["cpu"] + (["cuda"] if seqfuse.cuda_available() and torch.cuda.is_available() else [])
    for device in devices:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for shape in ((1,), (1000, 37), (4097,)):
                x = (torch.randn(shape, device=device) * 3).to(dtype)
                got = seqfuse.ops.amax(x).item()
                want = x.float().abs().max().item()
                if got != want:
                    failures += 1
                    print(f"  FAIL amax {device} {dtype} {shape}: {got} != {want}")
        print(f"  self-check {device:4s}: {'ok' if failures == 0 else f'{failures} failure(s)'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
