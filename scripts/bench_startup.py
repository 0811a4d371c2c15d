"""Launch-to-first-step time: how long a run takes from the command to its first optimizer step.

Start-up is paid by every short run and every sweep trial. For each launch path (`python
finetune/train.py` and `accelerate launch finetune/train.py`) the script starts the default-model
SST-2 config with one optimizer step, reads the progress bar on stderr as it comes, and notes the
moment the bar shows step 1. It also times `import finetune.train` in a fresh interpreter, and, with
--compare-ref REF, the same import at another git revision (a worktree), side by side in one run.

    .venv/bin/python scripts/bench_startup.py --repeats 3 [--compare-ref REV]

Prints a markdown table (medians) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
OVERRIDES = ["data.max_train_samples=256", "data.max_eval_samples=32", "train.max_steps=1", "run.overwrite=true"]


def first_step_seconds(cmd: list[str], env: dict[str, str]) -> float:
    """Seconds from starting `cmd` to the progress bar's first completed step (the run then ends)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    seen, buf = None, b""
    while seen is None and proc.poll() is None:
        for _ in sel.select(timeout=0.05):
            chunk = os.read(proc.stderr.fileno(), 65536)
            buf += chunk
            if b" 1/1 [" in buf:
                seen = time.perf_counter() - start
    proc.communicate(timeout=600)
    if proc.returncode != 0 or seen is None:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {buf.decode(errors='replace')[-2000:]}")
    return seen


def import_seconds(root: Path) -> float:
    code = "import time; t = time.perf_counter(); import finetune.train; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([PY, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "sst2-minilm.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare-ref", default=None, help="git revision whose `import finetune.train` is timed too")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_startup.json"))
    args = ap.parse_args()
    out_dir = Path(tempfile.mkdtemp(prefix="bench_startup_"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("FINETUNE_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    run = ["--config", args.config, f"run.output_dir={out_dir / 'run'}", *OVERRIDES]
    accelerate = str(Path(PY).parent / "accelerate")
    paths = {
        "python finetune/train.py": [PY, "finetune/train.py", *run],
        "accelerate launch finetune/train.py": [
            accelerate,
            "launch",
            "--num_processes",
            "1",
            "--cpu",
            "finetune/train.py",
            *run,
        ],
    }
    ref_root = None
    if args.compare_ref:
        ref_root = out_dir / "ref"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(ref_root), args.compare_ref],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    results: dict[str, list[float]] = {name: [] for name in paths}
    results["import finetune.train"] = []
    if ref_root is not None:
        results[f"import finetune.train @ {args.compare_ref}"] = []
    try:
        for _ in range(args.repeats):  # alternate, so drifting machine load hits every variant alike
            for name, cmd in paths.items():
                results[name].append(first_step_seconds(cmd, env))
            results["import finetune.train"].append(import_seconds(ROOT))
            if ref_root is not None:
                results[f"import finetune.train @ {args.compare_ref}"].append(import_seconds(ref_root))
    finally:
        if ref_root is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_root)], cwd=ROOT, capture_output=True)
    print(f"| what | median s ({args.repeats} runs) | runs |\n|---|---|---|")
    for name, values in results.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
