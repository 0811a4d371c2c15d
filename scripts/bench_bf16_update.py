"""How much of an AdamW update survives in bf16 weights: plain rounding vs Kahan vs stochastic rounding.

On the real default model (all-MiniLM-L6-v2 + 2-class head) with a real SST-2 gradient:
1. one step from the same state: the share of matrix entries (parameters with ndim >= 2; also
   without the word embeddings, whose rows for tokens absent from the batch only decay) whose
   stored bf16 value did not change, and whose effective value (bf16 + Kahan compensation) did
   not change, next to the fp32 reference (which changes every entry with a gradient or decay);
2. `--steps` steps with the same gradient: the share of the fp32 reference's update each variant
   applied (projection of its total update on the reference's) and its relative error.
The fp32 reference starts from the same bf16-rounded weights, so only update rounding differs.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_bf16_update.py [--lr 5e-5 2e-5] [--steps 10]

Prints a markdown table and writes JSON to --out (default runs/bench_bf16_update.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from finetune.config.files import load_config
from finetune.data.build import build_data
from finetune.data.collate import Collator
from finetune.model.load import build_model, build_tokenizer
from finetune.model.precision import Bf16AdamW, effective_weight, fp32_cross_entropy

ROOT = Path(__file__).resolve().parent.parent


def real_gradient(batch_size: int, seed: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The default model (fp32) and its gradient on `batch_size` SST-2 training sentences."""
    cfg = load_config(
        ROOT / "configs" / "sst2-minilm.yaml",
        [
            f"data.max_train_samples={batch_size}",
            "data.max_eval_samples=8",
            f"run.seed={seed}",
            "run.output_dir=/tmp/unused",
        ],
    )
    tokenizer = build_tokenizer(cfg)
    data = build_data(cfg, tokenizer)
    torch.manual_seed(seed)
    model = build_model(cfg, data.label_names, tokenizer)
    model.eval()  # no dropout: one deterministic gradient
    feats = [data.train[i] for i in range(batch_size)]
    batch = Collator(tokenizer)(feats)
    labels = batch.pop("labels")
    model_inputs = {k: v for k, v in batch.items() if k in Collator.MODEL_KEYS}
    fp32_cross_entropy(model(**model_inputs).logits, labels).mean().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return model, grads


def groups_for(params: dict[str, nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """The app's grouping: decay on matrices only."""
    return [
        {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
    ]


def run(model: nn.Module, grads: dict[str, torch.Tensor], lr: float, steps: int, weight_decay: float) -> dict[str, Any]:
    start = {n: p.detach().bfloat16() for n, p in model.named_parameters()}  # the bf16-true starting point
    variants: dict[str, tuple[dict[str, nn.Parameter], torch.optim.Optimizer]] = {}

    def make(name: str, dtype: torch.dtype, factory: Any) -> None:
        params = {n: nn.Parameter(w.to(dtype, copy=True)) for n, w in start.items()}  # own storage per variant
        variants[name] = (params, factory(groups_for(params, weight_decay)))

    make("fp32 reference (torch AdamW)", torch.float32, lambda g: torch.optim.AdamW(g, lr=lr))
    make("bf16 torch.optim.AdamW", torch.bfloat16, lambda g: torch.optim.AdamW(g, lr=lr))
    for update in ("plain", "kahan", "stochastic"):
        make(f"bf16 Bf16AdamW update={update}", torch.bfloat16, lambda g, u=update: Bf16AdamW(g, lr=lr, update=u))

    matrices = [n for n, w in start.items() if w.ndim >= 2]
    n_entries = sum(start[n].numel() for n in matrices)
    dense = [n for n in matrices if "word_embeddings" not in n]
    n_dense = sum(start[n].numel() for n in dense)
    out: dict[str, Any] = {"lr": lr, "steps": steps, "matrix_entries": n_entries, "variants": {}}
    ref_name = "fp32 reference (torch AdamW)"
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        for name, (params, opt) in variants.items():
            for n, p in params.items():
                p.grad = grads[n].to(p.dtype)
            opt.step()
            if step == 1:
                same = {n: params[n].detach().float() == start[n].float() for n in matrices}
                eff = sum(int((effective_weight(opt, params[n]).detach() == start[n].float()).sum()) for n in matrices)
                out["variants"][name] = {
                    "unchanged_stored_1step": sum(int(same[n].sum()) for n in matrices) / n_entries,
                    "unchanged_effective_1step": eff / n_entries,
                    # word-embedding rows of tokens absent from the batch get no gradient (decay only)
                    "unchanged_stored_1step_without_word_embeddings": sum(int(same[n].sum()) for n in dense) / n_dense,
                }
        if step == 1:
            print(f"  step 1 done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ref_params = variants[ref_name][0]
    d = {n: ref_params[n].detach().float() - start[n].float() for n in matrices}
    dd = sum(float((d[n] * d[n]).sum()) for n in matrices)
    for name, (params, opt) in variants.items():
        e = {n: effective_weight(opt, params[n]).detach() - start[n].float() for n in matrices}
        kept = sum(float((e[n] * d[n]).sum()) for n in matrices) / dd
        err = sum(float(((e[n] - d[n]) ** 2).sum()) for n in matrices) ** 0.5 / dd**0.5
        out["variants"][name].update({f"update_kept_{steps}steps": kept, f"relative_error_{steps}steps": err})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[5e-5, 2e-5])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_bf16_update.json")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, grads = real_gradient(args.batch_size, args.seed)
    results = []
    for lr in args.lr:
        torch.manual_seed(args.seed)  # stochastic rounding draws
        res = run(model, grads, lr, args.steps, args.weight_decay)
        results.append(res)
        print(
            f"\nlr {lr:g}, {res['matrix_entries']:,} matrix entries, "
            f"same SST-2 gradient (batch {args.batch_size}) every step"
        )
        print(
            "| variant | unchanged after 1 step (stored) | same, without word embeddings "
            f"| unchanged after 1 step (effective) | update kept after {args.steps} steps "
            f"| relative error after {args.steps} steps |"
        )
        print("|---|---|---|---|---|---|")
        for name, v in res["variants"].items():
            print(
                f"| {name} | {v['unchanged_stored_1step']:.1%} "
                f"| {v['unchanged_stored_1step_without_word_embeddings']:.1%} | {v['unchanged_effective_1step']:.1%} | "
                f"{v[f'update_kept_{args.steps}steps']:.3f} | {v[f'relative_error_{args.steps}steps']:.3f} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
