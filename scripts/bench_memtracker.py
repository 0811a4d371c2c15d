"""The cost of the one MemTracker window every run samples for its memory report.

The default model (configs/sst2-minilm.yaml) trains plain optimizer windows (forward, fp32 loss,
backward, AdamW step, zero_grad) on real SST-2 rows, each followed by a window of the same rows
under the loop's own tracker (`memory._memtracker`), side by side in one process: the ratio tracked / plain and the
extra seconds, medians over --repeats pairs.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_memtracker.py --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FINETUNE_DATA_DIR", str(ROOT.parent / "shared" / "data"))

from finetune.config.files import load_config  # noqa: E402
from finetune.data.reading import load_raw_splits  # noqa: E402
from finetune.memory import monitor as mem  # noqa: E402
from finetune.model.load import build_model, build_tokenizer  # noqa: E402


def main() -> int:
    """Time plain and tracked windows in turn; print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of (plain, tracked) windows")
    parser.add_argument("--micro", type=int, default=32, help="rows per window (one micro-batch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "configs" / "sst2-minilm.yaml")
    tok = build_tokenizer(cfg)
    raw = load_raw_splits(cfg)
    model = build_model(cfg, raw.label_names, tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    texts = raw.train["text"][: args.micro * (args.repeats + 1)]
    batches = [
        tok(
            texts[i : i + args.micro],
            padding=True,
            truncation=True,
            max_length=cfg.data.max_length,
            return_tensors="pt",
        )
        for i in range(0, len(texts), args.micro)
    ]

    def window(batch: dict[str, torch.Tensor]) -> float:
        t0 = time.perf_counter()
        logits = model(**batch).logits.float()
        torch.nn.functional.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    window(batches[0])  # AdamW's state exists from here on, as in the loop's sampled window
    plain, tracked = [], []
    for i in range(args.repeats):
        plain.append(window(batches[1 + i]))  # the same rows plain and tracked: only the tracker differs
        tracker = mem._memtracker(model, optimizer)
        t0 = time.perf_counter()
        tracker.__enter__()
        window(batches[1 + i])
        tracker.__exit__(None, None, None)
        tracked.append(time.perf_counter() - t0)
    p, t = statistics.median(plain), statistics.median(tracked)
    print(
        f"| threads | micro | plain window s | MemTracker window s | ratio | extra s |\n|---|---|---|---|---|---|\n"
        f"| {args.threads} | {args.micro} | {p:.2f} | {t:.2f} | {t / p:.2f}x | {t - p:.2f} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
