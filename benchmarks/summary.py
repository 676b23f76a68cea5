"""Print every result file in benchmarks/results/ as a compact table (the
last thing the GPU check prints)."""
import glob
import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def fmt(v):
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main():
    for path in sorted(glob.glob(os.path.join(HERE, "*.json"))):
        with open(path) as f:
            doc = json.load(f)
        env = doc.get("environment", {})
        print(f"\n[{doc.get('name')}] {env.get('gpu', 'cpu')} torch {env.get('torch')} {doc.get('date', '')}")
        for row in doc.get("rows", []):
            print("  " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items()))


if __name__ == "__main__":
    main()
