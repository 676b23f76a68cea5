"""Cut the Llama 3 benchmark's genome windows out of the recipe's full
training file, for a GPU machine that cannot run prepare_data.py (no apt, no
network) and should not be sent the whole 38 MB file.

Input: recipes/llama3/data/full/train.parquet (recipes/llama3/prepare_data.py,
default options: 8,192-base windows, stride 8,192, both strands, the
train / validation split by whole genome).  Output: BENCH_DATA
(benchmarks/llama3/data/train_8192.parquet, git-ignored; carry the folder
benchmarks/llama3/data): ``--windows`` windows of exactly ``--window`` bases
(the few shorter end-of-record windows are left out), taken round-robin over
the training genomes and evenly spaced along each genome's windows in file
order, both strands, so every training genome and species is in it.  Same
columns as the recipe's file; the source file's provenance metadata
(packages, versions, licences) is kept and the selection rule added.

  python3 benchmarks/llama3/make_bench_data.py            # 96 windows, ~0.25 MB
"""
import argparse
import json
import os

from llama3_common import BENCH_DATA, FULL_DATA, ROOT, load_windows


def select(rows, window, n):
    """``n`` windows of exactly ``window`` bases, round-robin over genomes
    (sorted by name), evenly spaced within each genome's windows."""
    by_genome = {}
    for r in rows:
        if r["end"] - r["start"] == window and len(r["sequence"]) == window:
            by_genome.setdefault(r["genome"], []).append(r)
    if not by_genome:
        raise ValueError(f"select: no window of exactly {window} bases")
    genomes = sorted(by_genome)
    counts = {g: 0 for g in genomes}
    left = min(n, sum(len(v) for v in by_genome.values()))
    while left:  # share n out over the genomes, no genome giving more than it has
        for g in genomes:
            if left and counts[g] < len(by_genome[g]):
                counts[g] += 1
                left -= 1
    out = []
    for g in genomes:
        ws, k = by_genome[g], counts[g]
        out += [ws[(i * len(ws)) // k] for i in range(k)]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=FULL_DATA, help="the recipe's full train.parquet")
    p.add_argument("--out", default=BENCH_DATA)
    p.add_argument("--window", type=int, default=8192)
    p.add_argument("--windows", type=int, default=96)
    args = p.parse_args(argv)
    if not os.path.isfile(args.source):
        raise SystemExit(f"{args.source} is missing: run recipes/llama3/prepare_data.py first (needs apt)")
    import pyarrow.parquet as pq

    from seqfuse.data.parquet import read_metadata, write_rows

    rows = load_windows(args.source)
    chosen = select(rows, args.window, args.windows)
    schema = pq.read_schema(args.source).remove_metadata()
    full = {c: None for c in schema.names}
    src_meta = read_metadata(args.source)
    src = json.loads(src_meta.get("seqfuse.dataset", "{}"))
    src["benchmark_subset"] = {
        "made_by": "benchmarks/llama3/make_bench_data.py",
        "from": os.path.relpath(os.path.abspath(args.source), ROOT),
        "rule": f"{len(chosen)} windows of exactly {args.window} bases, round-robin over the training genomes, "
                "evenly spaced within each genome's windows (file order), both strands as in the source",
        "genomes": sorted({r["genome"] for r in chosen}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    table = pq.read_table(args.source)
    ids = {r["id"] for r in chosen}
    keep = [i for i, x in enumerate(table.column("id").to_pylist()) if x in ids]
    sub = table.take(keep).to_pylist()
    n = write_rows(({c: r[c] for c in full} for r in sub), args.out, schema,
                   metadata={"seqfuse.dataset": json.dumps(src)}, caller="make_bench_data")
    print(f"{args.out}: {n} windows of {args.window} bases from {len(src['benchmark_subset']['genomes'])} genomes, "
          f"{os.path.getsize(args.out) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
