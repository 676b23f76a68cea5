"""Long DNA windows for the context-parallel recipe's GPU run
(benchmarks/cp/gpu_cp_recipe.sh): genuine 16,384-base (or longer) windows
made from the Llama 3 recipe's prepared data, for a GPU machine that cannot
run prepare_data.py (no apt, no network).

recipes/llama3/data/full (prepare_data.py, default options) holds 8,192-base
windows at stride 8,192 on both strands; on the + strand consecutive windows
of one record are adjacent stretches of the genome, so joining ``k`` of them
(start of each = end of the previous) gives a real window of k x 8,192
bases.  Written: benchmarks/cp/data/{train,validation}.parquet (git-ignored;
carry the folder ``benchmarks/cp/data``), the recipe's columns and the source
file's provenance metadata with this rule added; the train / validation
split stays the recipe's (by whole genome).  Windows are taken round-robin
over the genomes, so every genome with a long enough record is in.

  python3 benchmarks/cp/make_cp_data.py                 # 16,384 bases: 48 train / 8 validation windows
  python3 benchmarks/cp/make_cp_data.py --window 32768
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FULL = os.path.join(ROOT, "recipes", "llama3", "data", "full")
STRIDE = 8192


def joined_windows(table, window):
    """Rows of ``window`` bases joined from adjacent + strand windows, per genome."""
    rows = table.to_pylist()
    plus = sorted((r for r in rows if r["strand"] == "+" and r["end"] - r["start"] == STRIDE),
                  key=lambda r: (r["genome"], r["record_id"], r["start"]))
    k = window // STRIDE
    by_genome, run = {}, []
    for r in plus:
        if run and (r["genome"], r["record_id"], r["start"]) != (run[-1]["genome"], run[-1]["record_id"],
                                                                  run[-1]["end"]):
            run = []
        run.append(r)
        if len(run) == k:
            seq = "".join(x["sequence"] for x in run)
            by_genome.setdefault(r["genome"], []).append(dict(
                run[0], id=f"{r['genome']}/{r['record_id']}:{run[0]['start']}-{r['end']}+", sequence=seq,
                end=r["end"]))
            run = []
    return by_genome


def pick(by_genome, n):
    genomes, out, i = sorted(by_genome), [], 0
    while len(out) < n and any(i < len(by_genome[g]) for g in genomes):
        for g in genomes:
            if i < len(by_genome[g]) and len(out) < n:
                ws = by_genome[g]  # a prime stride spreads the picks along the genome
                out.append(ws[(i * 7919) % len(ws)])
        i += 1
    return list({r["id"]: r for r in out}.values())  # (a repeat pick is dropped)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", default=FULL, help="the recipe's prepared data folder")
    p.add_argument("--out", default=os.path.join(HERE, "data"))
    p.add_argument("--window", type=int, default=16384, help="bases per window, a multiple of 8192")
    p.add_argument("--train", type=int, default=48)
    p.add_argument("--validation", type=int, default=8)
    args = p.parse_args(argv)
    if args.window % STRIDE or args.window < STRIDE:
        raise SystemExit(f"--window must be a multiple of {STRIDE}, got {args.window}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(args.out, exist_ok=True)
    for split, n in (("train", args.train), ("validation", args.validation)):
        src = os.path.join(args.source, f"{split}.parquet")
        if not os.path.isfile(src):
            raise SystemExit(f"{src} is missing: run recipes/llama3/prepare_data.py first (needs apt)")
        table = pq.read_table(src)
        rows = pick(joined_windows(table, args.window), n)
        if not rows:
            raise SystemExit(f"{split}: no record has {args.window // STRIDE} adjacent + strand windows")
        meta = dict(table.schema.metadata or {})
        info = json.loads(meta.get(b"seqfuse.dataset", b"{}"))
        info["cp_benchmark_subset"] = {
            "made_by": "benchmarks/cp/make_cp_data.py", "from": os.path.relpath(src, ROOT),
            "rule": f"{len(rows)} windows of {args.window} bases, each {args.window // STRIDE} adjacent + strand "
                    f"{STRIDE}-base windows of one record joined, round-robin over genomes"}
        meta[b"seqfuse.dataset"] = json.dumps(info).encode()
        schema = table.schema.remove_metadata().with_metadata(meta)
        out = pa.Table.from_pylist(rows, schema=schema)
        pq.write_table(out, os.path.join(args.out, f"{split}.parquet"), compression="zstd")
        print(f"{split}: {len(rows)} windows of {args.window} bases from {len({r['genome'] for r in rows})} "
              f"genomes -> {os.path.join(args.out, split + '.parquet')}")


if __name__ == "__main__":
    main()
