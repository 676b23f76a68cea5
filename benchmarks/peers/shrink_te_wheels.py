"""Fit the Transformer Engine peer's carried wheels (../shared/peers/prepare_te.py's
output, default .te/) under the GPU machine's 64 MiB a call, beside this
repository's tracked files (about 20 MiB in session 41).

prepare_te.py leaves about 46 MiB; its largest optional part is
nvidia-cudnn-frontend's Python subpackages for features Transformer Engine's
PyTorch extension does not import (cudnn.sdpa, gemm, linear_attention, ...:
the package loads them lazily on first attribute access).  This drops them
from that wheel and its RECORD, keeping the C++ headers (include/, which
TE's extension build reads) and the core module: 11.6 -> 3.3 MB.  Used in
session 41 for `bash benchmarks/gpu_peers.sh te_modules` (TE built and
imported, its FusedAttention selected).

    python3 benchmarks/peers/shrink_te_wheels.py [.te]
"""
import os
import sys
import zipfile

OPTIONAL = ("sdpa", "gemm", "linear_attention", "gated_attention_block", "deepseek_sparse_attention", "moe_ep",
            "block_sparse_attention", "flex_attention", "hstu")


def shrink(path):
    drop = tuple(f"cudnn/{name}/" for name in OPTIONAL)
    tmp = path + ".new"
    with zipfile.ZipFile(path) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        for info in zi.infolist():
            if info.filename.startswith(drop):
                continue
            data = zi.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = ("\n".join(line for line in data.decode().splitlines() if not line.startswith(drop))
                        + "\n").encode()
            zo.writestr(info, data)
    os.replace(tmp, path)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else ".te"
    wheels = [f for f in os.listdir(out) if f.startswith("nvidia_cudnn_frontend") and f.endswith(".whl")]
    if not wheels:
        sys.exit(f"no nvidia_cudnn_frontend wheel in {out}")
    for name in wheels:
        path = os.path.join(out, name)
        before = os.path.getsize(path)
        shrink(path)
        print(f"{name}: {before / 2**20:.1f} -> {os.path.getsize(path) / 2**20:.1f} MiB")
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"{out}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
