"""What first-token pooling costs on a mean-pooling sentence encoder: the shipped config with mean pooling patched in.

all-MiniLM-L6-v2 and all-mpnet-base-v2 were trained as sentence encoders with mean pooling;
`BertForSequenceClassification` reads the CLS token through a dense + tanh pooler that training never
shaped, and `MPNetForSequenceClassification`'s head (dense + tanh + projection, all new) reads `<s>`. This
runs the real training loop in-process with the pooling patched to the masked mean of the last hidden
states, to measure the difference: BERT's pooler is replaced by the mean (no dense, no tanh); MPNet's head
keeps its layers and reads the mean instead of `<s>`. The patch is for measurement only: a final/ trained this
way does not load with mean pooling in `transformers.pipeline` (BERT has no such option without remote
code), so the app keeps the CLS pooler. `--identity` keeps the stock pooler and sets the app's own
`model.pooler_init=identity` (its dense layer starts at the identity: a weights-only change final/ keeps).

    .venv/bin/python scripts/bench_pooling.py --config configs/mrpc-minilm.yaml [--mean | --identity] [overrides ...]

Prints final/'s eval.json headline.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers.models.bert.modeling_bert as bert
import transformers.models.mpnet.modeling_mpnet as mpnet

from finetune.train import main as train_main

_MASK: dict[str, torch.Tensor | None] = {"mask": None}


def _masked_mean(hidden_states: torch.Tensor) -> torch.Tensor:
    mask = _MASK["mask"]
    if mask is None:
        return hidden_states.mean(1)
    m = mask.unsqueeze(-1).to(hidden_states.dtype)
    return (hidden_states * m).sum(1) / m.sum(1).clamp(min=1.0)


def _keep_mask(forward: Any) -> Any:
    def model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _MASK["mask"] = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        return forward(self, *args, **kwargs)

    return model_forward


def patch_mean_pooling() -> None:
    bert.BertModel.forward = _keep_mask(bert.BertModel.forward)
    bert.BertPooler.forward = lambda self, hidden_states: _masked_mean(hidden_states)
    mpnet.MPNetModel.forward = _keep_mask(mpnet.MPNetModel.forward)
    head = mpnet.MPNetClassificationHead.forward

    def mpnet_head(self: Any, features: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        # the head reads position 0; give it the mean there and keep its dense, tanh and projection
        return head(self, _masked_mean(features).unsqueeze(1), **kwargs)

    mpnet.MPNetClassificationHead.forward = mpnet_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--mean", action="store_true", help="mean pooling instead of the first token")
    parser.add_argument("--identity", action="store_true", help="CLS pooler with its dense layer set to the identity")
    parser.add_argument("--out", default="/tmp/bench_pooling")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.mean and args.identity:
        parser.error("--mean and --identity exclude each other")
    if args.mean:
        patch_mean_pooling()
    pooling = "mean" if args.mean else "identity" if args.identity else "cls"
    out = Path(args.out) / pooling
    start = time.perf_counter()
    code = train_main(
        ["--config", args.config, f"run.output_dir={out}", "run.overwrite=true", "log.plots=false", *args.overrides]
        + (["model.pooler_init=identity"] if args.identity else [])
    )
    final = json.loads((out / "eval.json").read_text())
    keep = {k: v for k, v in final.items() if isinstance(v, float)}
    print(json.dumps({"pooling": pooling, "wall_s": time.perf_counter() - start, **keep}))
    sys.exit(code)


if __name__ == "__main__":
    main()
