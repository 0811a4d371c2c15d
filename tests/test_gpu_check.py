"""scripts/gpu_check.py --dry-run: the GPU check's own code on the CPU with tiny shapes, in-process."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from conftest import load_script as conftest_load_script

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread")


def load_script() -> ModuleType:
    """scripts/gpu_check.py as a module (registered first: its dataclasses look their module up)."""
    return conftest_load_script("gpu_check")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, ModuleType]:
    gpu_check = load_script()
    out = tmp_path_factory.mktemp("gpu_check")
    assert gpu_check.main(["--dry-run", "--out", str(out), "--profile", "bf16"]) == 0
    result = json.loads((out / "gpu_check.json").read_text())
    for row in result["profile"]:  # the profile's tables lie beside the JSON; keep their text with the row
        row["text"] = (out / row["file"]).read_text() if "file" in row else None
    return result, (out / "gpu_check.md").read_text(), gpu_check


def positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_precision_rows_one_per_mode_with_consistent_numbers(dry_run: tuple[dict[str, Any], str, ModuleType]) -> None:
    result, md, gpu_check = dry_run
    assert result["dry_run"] and result["environment"]["device"] == "cpu"
    minilm = [r for r in result["precision"] if r["model"] == "minilm"]
    assert [r["mode"] for r in minilm] == list(gpu_check.ALL_MODES)
    for r in minilm:
        if r["mode"] == "fp16":
            assert "CPU" in r["skipped"]  # Accelerate would silently train fp32: refused, recorded
            continue
        assert "error" not in r, r
        assert positive(r["samples_per_s"]) and positive(r["first_interval_s"]) and r["steps"] == 4
        assert positive(r["samples_per_s_untracked"])
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s_untracked"] * r["mean_tokens"])
        # the memory report samples step 2 (and the heaviest window) under MemTracker, a compiled run none
        assert (2 in r["memtracker_steps"]) == (r["mode"] != "bf16 compile")
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / gpu_check.PEAK_BF16_FLOPS)
        assert 0 < r["mfu"] < 1
        assert math.isfinite(r["last_loss"]) and isinstance(r["loss_within_noise"], bool)
        # graphs are counted for the compiled run only, from its own compile (dynamo's counters reset)
        assert (r["compile_graphs"] or 0) >= (1 if r["mode"] == "bf16 compile" else 0)
        assert (r["compile_graphs"] is None) == (r["mode"] != "bf16 compile")
    fp32 = next(r for r in minilm if r["mode"] == "fp32")
    assert fp32["loss_delta_vs_fp32"] == 0.0 and fp32["loss_within_noise"]
    decoder = [r for r in result["precision"] if r["model"] == "qwen2.5-0.5b"]
    assert len(decoder) == 1 and positive(decoder[0]["samples_per_s"])  # a pad-less decoder tokenizer trains
    # the markdown's precision table: one row per (model, mode)
    table = md.split("### Precision")[1].split("###")[0]
    for r in result["precision"]:
        assert table.count(f"| {r['model']} | {r['mode']} |") == 1


@pytest.mark.slow
def test_planner_rows_hold_the_plan_and_the_measurement(dry_run: tuple[dict[str, Any], str, ModuleType]) -> None:
    result, md, _ = dry_run
    rows = result["memory"]
    assert {r["model"] for r in rows} == {"minilm", "qwen2.5-0.5b"}
    assert any("LoRA" in r["rung"] for r in rows) and any("bf16-true" in r["rung"] for r in rows)
    for r in rows:
        assert positive(r["planned_mib"]) and positive(r["measured_mib"]), r
        # on a CPU the fake-tensor plan and MemTracker on real tensors run the same kernels
        assert r["plan_over_measured"] == pytest.approx(1.0, abs=0.02) and r["within_10pct"]
        assert sum(r["planned_categories_mib"].values()) == pytest.approx(r["planned_mib"], rel=1e-6)
        assert "CPU" in r["expandable_skipped"]
    table = md.split("### Memory")[1].split("###")[0]
    assert sum(line.startswith("| minilm |") or line.startswith("| qwen") for line in table.splitlines()) == len(rows)


@pytest.mark.slow
def test_trainer_side_by_side_and_oom_backoff(dry_run: tuple[dict[str, Any], str, ModuleType]) -> None:
    result, md, _ = dry_run
    ours, *trainers = result["trainer"]
    assert ours["contestant"] == "finetune" and positive(ours["samples_per_s"])
    assert [t["contestant"] for t in trainers] == ["Trainer, defaults", "Trainer, group_by_length"]
    for t in trainers:
        assert positive(t["samples_per_s"]), t
        assert t["finetune_over_this"] == pytest.approx(ours["samples_per_s"] / t["samples_per_s"])
    ft, tr = result["oom"]
    assert ft["contestant"] == "finetune" and tr["contestant"].startswith("Trainer")
    # finetune halves the micro-batch and doubles accumulation; Trainer halves its batch
    assert (ft["micro_after"], ft["accumulation_after"], ft["effective_batch_kept"]) == (4, 2, True)
    assert (tr["micro_after"], tr["effective_after"], tr["effective_batch_kept"]) == (4, 4, False)
    assert "| minilm | finetune |" in md and "8 -> 8 | yes |" in md and "8 -> 4 | no |" in md


def test_steady_rate_leaves_the_first_interval_out() -> None:
    gpu_check = load_script()
    rows = [{"step": 2, "samples_per_s": 1.0}, {"step": 4, "samples_per_s": 8.0}, {"step": 5, "samples_per_s": 2.0}]
    rate, first = gpu_check.steady_rate(rows, per_step=4)
    assert first == pytest.approx(8.0)  # 2 steps x 4 samples at 1 sample/s
    assert rate == pytest.approx((8 + 4) / (1.0 + 2.0))  # 8 samples in 1 s, then 4 in 2 s
    assert gpu_check.steady_rate(rows, 4, frozenset({5}))[0] == pytest.approx(8.0)  # step 5's interval left out
    assert gpu_check.steady_rate(rows, 4, frozenset({3, 5}))[0] is None


def test_memory_child_measures_the_rungs_it_is_given(tmp_path: Path) -> None:
    """The expandable-segments child (a subprocess on a GPU) reads the parent's files and writes its rows."""
    gpu_check = load_script()
    w = gpu_check.workload(gpu_check.shapes(True)["minilm"], tmp_path / "minilm")
    result = tmp_path / "child.json"
    assert gpu_check.main(["--dry-run", "--memory-child", "minilm", str(w.work), "0", str(result)]) == 0
    (row,) = json.loads(result.read_text())
    assert row["rung"] == "fp32, micro 32" and positive(row["measured_mib"]) and "error" not in row


@pytest.mark.slow
def test_profile_counts_host_syncs_and_writes_the_top_operations(
    dry_run: tuple[dict[str, Any], str, ModuleType],
) -> None:
    result, md, _ = dry_run
    assert [(r["model"], r["mode"]) for r in result["profile"]] == [("minilm", "bf16"), ("qwen2.5-0.5b", "bf16")]
    for r in result["profile"]:
        assert "error" not in r and "skipped" not in r, r
        # 4 steps: 3 of warm-up, one profiled; its log row reads the loss back at least once
        assert r["steps_profiled"] == 1 and r["host_reads_per_step"] >= 1 and r["cuda_sync_warnings_per_step"] is None
        assert "Top operations by self CPU time" in r["text"] and "aten::" in r["text"]
        assert f"| {r['model']} | bf16 | 1 | {r['host_reads_per_step']:.2f} |" in md


def test_selected_sections_and_models_share_the_whole_budget() -> None:
    gpu_check = load_script()
    (only,) = gpu_check.planned_pairs(["memory"], ["qwen2.5-0.5b"])
    assert only[:2] == ("memory", "qwen2.5-0.5b") and gpu_check.pair_cap(only[2], only[2], 130.0) == 130.0
    pairs = gpu_check.planned_pairs(["precision", "memory", "profile"], ["minilm", "qwen2.5-0.5b"])
    assert [p[:2] for p in pairs][:3] == [("precision", "minilm"), ("precision", "qwen2.5-0.5b"), ("profile", "minilm")]
    shares = [p[2] for p in pairs]
    caps, left = [], 600.0
    for i, share in enumerate(shares):  # every pair uses its whole cap: the caps add up to the budget
        caps.append(gpu_check.pair_cap(share, sum(shares[i:]), left))
        left -= caps[-1]
    assert sum(caps) == pytest.approx(600.0) and caps[0] / caps[-1] == pytest.approx(shares[0] / shares[-1])
    # a pair that finishes early hands its time on: the next one gets its share of all that is left
    assert gpu_check.pair_cap(shares[1], sum(shares[1:]), 600.0) == pytest.approx(600.0 * shares[1] / sum(shares[1:]))


def test_modes_pick_precision_rows_and_skipped_rows_come_first() -> None:
    gpu_check = load_script()
    assert gpu_check.chosen_modes(gpu_check.ALL_MODES, ["bf16-compile", "fp32"]) == ("fp32", "bf16 compile")
    assert gpu_check.chosen_modes(gpu_check.ALL_MODES, None) == gpu_check.ALL_MODES
    # the first GPU run skipped fp16 and bf16-true on MiniLM, fp32, fp16 and compile on Qwen for time
    assert gpu_check.ALL_MODES[:2] == ("fp16", "bf16-true")
    assert set(gpu_check.QWEN_MODES[:3]) == {"fp16", "fp32", "bf16 compile"}
