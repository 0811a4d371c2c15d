"""The host work of one micro-batch before the model sees it: reading the rows and padding them.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_collate.py --rows 4000 --micro 32 --repeats 5

Side by side, on the same SST-2 rows tokenized by the default model's tokenizer: the DataLoader's default
path (one `WindowedDataset[key]` per row, then `tokenizer.pad`) against finetune's (`__getitems__`: the
micro-batch in one read of the table, then `Collator.pad`). On a GPU this work is not hidden behind the model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from finetune.data.collate import Collator  # noqa: E402
from finetune.data.window import WindowedDataset  # noqa: E402
from finetune.model.sources import resolve_model_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--micro", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    data = Path(os.environ.get("FINETUNE_DATA_DIR", "../shared/data")) / "sst2" / "train.tsv"
    lines = data.read_text().splitlines()[1 : args.rows + 1]
    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm-l6"))
    enc = tok([line.split("\t")[0] for line in lines], truncation=True, max_length=128)
    table = WindowedDataset(datasets.Dataset.from_dict({**enc, "labels": [int(x.split("\t")[1]) for x in lines]}))
    collator = Collator(tok)
    batches = [
        [(b * args.micro + j, args.micro, 1.0) for j in range(args.micro)] for b in range(args.rows // args.micro)
    ]

    def default_path(keys: list) -> None:
        rows = [table[k] for k in keys]
        Collator.add_bookkeeping(
            dict(tok.pad([{k: r[k] for k in collator.MODEL_KEYS if k in r} for r in rows], return_tensors="pt")), rows
        )

    def ours(keys: list) -> None:
        collator(table.__getitems__(keys))

    times: dict[str, list[float]] = {"per row + tokenizer.pad": [], "finetune": []}
    for _ in range(args.repeats):  # alternating, so drift on a shared machine hits both
        for name, fn in (("per row + tokenizer.pad", default_path), ("finetune", ours)):
            start = time.perf_counter()
            for keys in batches:
                fn(keys)
            times[name].append(1000 * (time.perf_counter() - start) / len(batches))
    for name, values in times.items():
        print(
            f"{name}: {statistics.median(values):.2f} ms per micro-batch of {args.micro} (runs: "
            + ", ".join(f"{v:.2f}" for v in values)
            + ")"
        )
    ratios = [a / b for a, b in zip(times["per row + tokenizer.pad"], times["finetune"], strict=True)]
    print(f"finetune is {statistics.median(ratios):.2f}x faster (median of per-repeat ratios)")


if __name__ == "__main__":
    main()
