"""Fault injection: SIGKILL a real default-model (all-MiniLM-L6-v2) run at random moments, during
optimizer steps and during checkpoint saves, resume it each time with checkpoint.resume=auto, and
compare the final weights with an uninterrupted run.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/chaos_resume.py --kills 20 --out runs/chaos

A resume counts as succeeded when the next launch gets back to training: it logs
"resumed from <checkpoint>" (or, when the kill came before the first checkpoint, starts again
from step 0) and is not refused or crashed. SIGKILL gives the process no chance to clean up, so
this exercises the atomic save (temporary directory + manifest + rename) and the fallback to the
newest complete checkpoint. Sized small (a few hundred SST-2 rows, max_length 32) so it finishes in
roughly 10-15 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from finetune.core.fileio import read_jsonl  # noqa: E402
from finetune.training import checkpoint as ckpt  # noqa: E402

OVERRIDES = [
    "data.max_train_samples={rows}",
    "data.max_eval_samples=64",
    "data.max_length=32",
    "train.epochs=2",
    "train.micro_batch_size=8",
    "train.gradient_accumulation_steps=2",
    "train.log_every_steps=1",
    "train.eval_every_steps=null",
    "checkpoint.every_steps={every}",
    "checkpoint.keep_last=2",
]


def launch(
    config: str, overrides: list[str], out_dir: Path, log: Path, resume: bool, threads: int
) -> subprocess.Popen[bytes]:
    """One training process (`python finetune/train.py`), its output to `log`."""
    cmd = [
        sys.executable,
        str(ROOT / "finetune" / "train.py"),
        "--config",
        config,
        *overrides,
        f"run.output_dir={out_dir}",
    ]
    cmd.append("checkpoint.resume=auto" if resume else "run.overwrite=true")
    # one intra-op thread: on a shared 2-core machine OpenMP threads that spin-wait for a descheduled
    # sibling make a step several times slower; the reference and the chaos runs use the same setting
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
    }
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_training(proc: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> str | None:
    """Wait until the process has passed its resume point; return how it started (None if it exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        m = re.search(r"resumed from (\S+) at step (\d+)", text)
        if m:
            return f"resumed from step {int(m.group(2))}"
        if re.search(r"train:\s+\d+%", text):  # the progress bar is up without a resume line
            return "started from step 0"
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def saving(run: Path) -> bool:
    """A checkpoint is being written (its temporary directory exists)."""
    root = run / "checkpoints"
    return root.is_dir() and any(p.name.startswith(ckpt.TMP_PREFIX) for p in root.iterdir())


def last_logged_step(run: Path) -> int:
    """The last optimizer step in metrics.jsonl (a loss is logged at every step)."""
    try:
        rows = read_jsonl(run / "metrics.jsonl")  # the run is writing it: its last line may be torn
    except OSError:
        return 0
    steps = [r.get("step", 0) for r in rows]
    return max(steps, default=0)


def newest_complete(run: Path) -> int:
    """Step of the newest checkpoint with a manifest (cheap check, no hashing)."""
    found = [int(p.name.split("_")[1]) for p in ckpt.list_checkpoints(run) if (p / ckpt.MANIFEST).is_file()]
    return max(found, default=0)


def max_abs_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two safetensors files with the same keys."""
    from safetensors.torch import load_file

    wa, wb = load_file(a), load_file(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def main() -> int:
    """Reference run, then the SIGKILL/resume loop; writes chaos.json; 0 when every resume worked
    and the weights match."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "sst2-minilm.yaml"))
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--rows", type=int, default=320, help="SST-2 training rows (320: 40 optimizer steps)")
    parser.add_argument("--every", type=int, default=2, help="checkpoint.every_steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the training processes")
    parser.add_argument("--out", default=str(ROOT / "runs" / "chaos"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    overrides = [o.format(rows=args.rows, every=args.every) for o in OVERRIDES]
    t0 = time.monotonic()

    # The uninterrupted run, timed: its training time sets the range of the random kill delays.
    ref_log = out / "reference.log"
    proc = launch(args.config, overrides, out / "reference", ref_log, resume=False, threads=args.threads)
    wait_training(proc, ref_log)
    t_train = time.monotonic()
    if proc.wait() != 0:
        print(ref_log.read_text()[-3000:], file=sys.stderr)
        return 1
    train_s = time.monotonic() - t_train
    total_steps = max(r["step"] for r in read_jsonl(out / "reference" / "metrics.jsonl"))
    step_s = train_s / total_steps
    print(
        f"reference: {time.monotonic() - t0:.0f} s ({total_steps} steps, {step_s:.1f} s per step with saves)",
        flush=True,
    )

    run = out / "chaos"
    events = []
    launches = 0
    for k in range(args.kills):
        log = out / f"launch_{launches:02d}.log"
        proc = launch(args.config, overrides, run, log, resume=launches > 0, threads=args.threads)
        launches += 1
        started = wait_training(proc, log)
        if events:
            events[-1]["next_launch"] = started or f"failed (exit {proc.poll()})"
        if started is None:
            break
        m = re.search(r"from step (\d+)", started)
        resumed_at = int(m.group(1)) if m else 0
        mode = "save" if k % 2 else "step"  # alternate: kills inside a save, kills inside a step
        if mode == "step":
            # a random moment of a random one of the next 3 optimizer steps
            target = resumed_at + rng.randint(1, 3)
            while last_logged_step(run) < target - 1 and proc.poll() is None:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, step_s))
        else:
            # inside the save that follows the first new complete checkpoint (so the run advances)
            while newest_complete(run) <= resumed_at and proc.poll() is None:
                time.sleep(0.01)
            while not saving(run) and proc.poll() is None:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.1))
        if proc.poll() is not None:  # finished before the kill: the run is over
            events.append({"kill": k + 1, "mode": mode, "killed": False, "exit": proc.returncode})
            break
        in_save = saving(run)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        complete = [p.name for p in ckpt.list_checkpoints(run) if ckpt.verify_checkpoint(p) is None]
        events.append(
            {"kill": k + 1, "mode": mode, "during_save": in_save, "killed": True, "complete_checkpoints": complete}
        )
        print(f"kill {k + 1:2d} ({mode}, during save: {in_save}): complete checkpoints {complete}", flush=True)

    # Let the last launch finish.
    log = out / f"launch_{launches:02d}.log"
    proc = launch(args.config, overrides, run, log, resume=True, threads=args.threads)
    started = wait_training(proc, log)
    if events:
        events[-1]["next_launch"] = started or "failed"
    rc = proc.wait()
    kills = [e for e in events if e.get("killed")]
    ok = [e for e in kills if str(e.get("next_launch", "")).startswith(("resumed", "started"))]
    diff = (
        max_abs_diff(out / "reference" / "final" / "model.safetensors", run / "final" / "model.safetensors")
        if rc == 0
        else None
    )
    ref_losses = read_jsonl(out / "reference" / "metrics.jsonl")
    got_losses = read_jsonl(run / "metrics.jsonl") if rc == 0 else []
    same_losses = [r.get("loss") for r in ref_losses] == [r.get("loss") for r in got_losses]
    summary = {
        "kills": len(kills),
        "kills_during_save": sum(1 for e in kills if e["during_save"]),
        "resumes_succeeded": len(ok),
        "final_exit_code": rc,
        "final_max_abs_diff": diff,
        "weights_identical": diff == 0.0,
        "logged_losses_identical": same_losses,
        "wall_s": round(time.monotonic() - t0),
        "reference_s_per_step": round(step_s, 2),
        "command": " ".join(sys.argv),
        "events": events,
    }
    (out / "chaos.json").write_text(json.dumps(summary, indent=2))
    print(
        f"{summary['kills']} SIGKILLs ({summary['kills_during_save']} during a checkpoint save), "
        f"{summary['resumes_succeeded']}/{summary['kills']} resumes succeeded; final run exit {rc}; "
        f"final weights vs uninterrupted run: max |diff| = {diff} ({'identical' if diff == 0.0 else 'DIFFERENT'}); "
        f"logged losses identical: {same_losses}; {summary['wall_s']} s"
    )
    return 0 if rc == 0 and diff == 0.0 and len(ok) == len(kills) else 1


if __name__ == "__main__":
    sys.exit(main())
