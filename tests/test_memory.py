"""memory/monitor.py: exact tensor sums, the MemTracker sample (frozen parameters included), and the
report in every checkpoint of a real tiny run, checked against the checkpoint's own tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ROOT, write_tiny_config
from safetensors.torch import load_file

from finetune.cli import main as cli_main
from finetune.config.files import load_config
from finetune.memory import monitor as mem
from finetune.train import main as train_main
from finetune.training import checkpoint as ckpt

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _nbytes(tensors: object) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 64)
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        self.head = torch.nn.Linear(64, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(ids)).mean(1))


def _window(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: int = 2) -> None:
    for _ in range(micro_batches):
        model(torch.randint(0, 50, (32, 48))).logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("freeze_embeddings", [False, True])
def test_monitor_sums_tensors_and_samples_a_step(freeze_embeddings: bool) -> None:
    torch.manual_seed(0)
    model = Net()
    if freeze_embeddings:  # MemTracker alone raises on frozen parameters (docs/MEMORY.md, memory.PeakTracker)
        model.embed.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    monitor = mem.MemoryMonitor(torch.device("cpu"), model, optimizer, {"precision": "fp32"})
    monitor.begin_sample(0)  # before the first step: not sampled (no optimizer state yet)
    _window(model, optimizer)
    monitor.end_sample()
    assert monitor.sample is None
    monitor.begin_sample(1)
    _window(model, optimizer)  # two forwards in one tracked window
    monitor.end_sample()
    rep = monitor.report(2)
    assert rep["parameters_bytes"] == _nbytes(model.parameters())
    assert rep["gradients_bytes"] == _nbytes(trainable)  # read from the .grad tensors after step 1
    opt_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert rep["optimizer_state_bytes"] == _nbytes(opt_tensors) > 2 * _nbytes(trainable)
    assert rep["breakdown_method"].startswith("MemTracker on optimizer step 2")
    peak = rep["memtracker_peak"]
    assert peak["Parameter"] == rep["parameters_bytes"]
    assert rep["peak_bytes"] == peak["Total"] >= rep["parameters_bytes"] + rep["optimizer_state_bytes"]
    assert rep["activations_bytes"] > 0  # 2 x 32 x 48 x 256 floats of activations at the backward peak
    split = mem.at_peak(rep)
    assert split is not None and sum(split.values()) == rep["peak_bytes"]  # the categories add up to the peak
    assert split["parameters"] == rep["parameters_bytes"] + rep["buffers_bytes"]
    assert split["gradients"] <= rep["gradients_bytes"]  # those alive at the peak, of all of them
    assert rep["cpu"]["peak_rss_bytes"] > 0 and rep["cuda"] is None
    for key in mem.REPORT_KEYS:
        assert isinstance(rep[key], int)


def test_report_without_a_sample_says_so() -> None:
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rep = mem.MemoryMonitor(torch.device("cpu"), model, optimizer, {}).report(0)
    assert rep["peak_bytes"] is None and rep["breakdown_method"].startswith("none")
    assert rep["gradients_bytes"] == _nbytes(model.parameters()) and "no optimizer step" in rep["gradients_source"]
    assert rep["optimizer_state_bytes"] == 0
    assert "| parameters |" in mem.format_markdown(rep)


@pytest.mark.slow
def test_every_checkpoint_has_a_memory_report(
    tmp_path: Path, data_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_tiny_config(
        tmp_path,
        {
            "data.max_train_samples": 96,
            "data.max_eval_samples": 32,
            "train.log_every_steps": 1,
            "checkpoint.every_steps": 1,
            "checkpoint.keep_last": 5,
            "log.plots": True,
        },
    )
    assert train_main(["--config", str(cfg)]) == 0
    run = tmp_path / "run"
    checkpoints = ckpt.list_checkpoints(run)
    assert [p.name for p in checkpoints] == ["step_00000001", "step_00000002", "step_00000003"]
    for path in checkpoints:
        assert ckpt.verify_checkpoint(path) is None
        rep = json.loads((path / "memory.json").read_text())
        assert (path / "memory.md").is_file()
        for key in mem.REPORT_KEYS:
            assert key in rep
        assert rep["config"]["micro_batch_size"] == 16 and rep["config"]["gradient_accumulation_steps"] == 2
        weights = load_file(path / "model.safetensors")
        assert rep["parameters_bytes"] == _nbytes(weights.values())
        assert rep["gradients_bytes"] == _nbytes(weights.values())  # everything trainable, fp32 grads
        optim = torch.load(path / "optimizer.bin", weights_only=True)
        assert rep["optimizer_state_bytes"] == _nbytes(
            v for s in optim["state"].values() for v in s.values() if isinstance(v, torch.Tensor)
        )
    # step 1 is before the sampled step; the sample of step 2 is in step 2's report
    assert json.loads((checkpoints[0] / "memory.json").read_text())["peak_bytes"] is None
    second = json.loads((checkpoints[1] / "memory.json").read_text())
    assert second["breakdown_method"].startswith("MemTracker on optimizer step 2") and second["peak_bytes"] > 0
    # step 3's window has the longer rows (length-grouped windows): sampled as well, the higher peak kept
    last = json.loads((checkpoints[-1] / "memory.json").read_text())
    kept = last["breakdown_method"].split(" (")[0].removeprefix("MemTracker on optimizer step ")
    assert {int(kept), last["other_sample"]["step"]} == {2, 3}
    assert last["peak_bytes"] >= last["other_sample"]["peak_bytes"] and second["peak_bytes"] in (
        last["peak_bytes"],
        last["other_sample"]["peak_bytes"],
    )
    # what was measured: the sampled window's two micro-batches of 16 rows, padded per batch
    assert [b[0] for b in last["sampled_batches"]] == [16, 16]
    assert all(1 < b[1] <= load_config(cfg).data.max_length for b in last["sampled_batches"])
    assert "micro-batches (rows x tokens): 16 x" in (checkpoints[-1] / "memory.md").read_text()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_memory_bytes"] > 0 for r in rows if "loss" in r)
    assert (run / "memory.png").is_file()
    capsys.readouterr()
    assert cli_main(["report", str(run)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].split()[:3] == ["step", "peak", "params"]
    assert [line.split()[0] for line in table[3:-1]] == ["1", "2", "3", "final"]  # the run's final summary last
    # the final row's params to temps split its peak: they add up to it (to the printed 0.1 MiB)
    peak, *split = (float(x.replace(",", "")) for x in table[-2].split()[1:7])
    assert abs(sum(split) - peak) <= 0.3 and peak > 0


def test_a_compiled_model_is_not_sampled() -> None:
    model = Net()
    model.compile(backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = mem.MemoryMonitor(torch.device("cpu"), model, optimizer, {})
    _window(model, optimizer)
    monitor.begin_sample(1)
    _window(model, optimizer)
    monitor.end_sample()
    rep = monitor.report(2)
    assert rep["peak_bytes"] is None and "compiled" in rep["breakdown_method"]
    assert rep["gradients_bytes"] == _nbytes(model.parameters())


def test_cuda_report_from_the_allocator_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the CUDA branch runs on stubbed torch.cuda counters (arithmetic and keys)."""
    peaks = iter([(900, 1200), (700, 1000)])  # (peak allocated, peak reserved) per read
    current: dict[str, tuple[int, int]] = {}

    def max_alloc(device: object = None) -> int:
        current["peak"] = next(peaks)
        return current["peak"][0]

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", max_alloc)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: current["peak"][1])
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 300)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: 512)
    monkeypatch.setattr(cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 3, "num_ooms": 1})
    monkeypatch.setattr(cuda, "memory_summary", lambda device=None, abbreviated=False: "summary text")
    model = torch.nn.Linear(4, 4)  # 80 bytes of parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = mem.MemoryMonitor(torch.device("cuda", 0), model, optimizer, {"precision": "bf16"})
    assert monitor.interval_peak() == 900
    rep = monitor.report(5)  # reads the second interval (700 / 1000): the max since the checkpoint wins
    cu = rep["cuda"]
    assert (cu["peak_allocated_bytes"], cu["peak_reserved_bytes"]) == (900, 1200)
    assert (cu["allocated_bytes"], cu["reserved_bytes"], cu["fragmentation_bytes"]) == (300, 512, 212)
    assert (cu["alloc_retries"], cu["ooms"]) == (3, 1)
    # no MemTracker sample: measured peak minus parameters, gradients and optimizer state
    assert rep["peak_bytes"] == 900 and rep["activations_bytes"] == 900 - 80 - 80 - 0
    assert rep["breakdown_method"].startswith("measured CUDA peak")
    assert "summary text" in mem.format_markdown(rep)


@pytest.mark.slow
def test_no_memtracker_around_the_final_evaluation(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one optimizer step: the sample must not start after it and wrap the final evaluation and export
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    import finetune.train as train_mod

    real_evaluate, modes = train_mod.collect_outputs, []

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        modes.append(_get_current_dispatch_mode())
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(train_mod, "collect_outputs", evaluate)
    cfg = write_tiny_config(tmp_path, {"data.max_train_samples": 32, "data.max_eval_samples": 16, "train.max_steps": 1})
    assert train_main(["--config", str(cfg)]) == 0
    assert modes == [None]


@pytest.mark.slow
def test_memory_png_shows_the_breakdown_beside_the_plan(tmp_path: Path, data_dir: Path) -> None:
    # train.micro_batch_size=auto plans the micro-batch: memory.json keeps the plan, memory.png draws both
    import matplotlib.pyplot as plt

    cfg = write_tiny_config(
        tmp_path,
        {
            "data.max_train_samples": 64,
            "data.max_eval_samples": 16,
            "train.max_steps": 2,
            "train.micro_batch_size": "auto",
            "train.batch_size": 32,
            "train.gradient_accumulation_steps": ...,
            "memory.budget_gb": 4,
            "checkpoint.every_steps": 1,
        },
    )
    assert train_main(["--config", str(cfg)]) == 0
    report = mem.latest_report(tmp_path / "run")
    assert report is not None and report["config"]["planned_bytes"]["parameters"] > 0
    drawn: list[list[str]] = []
    real_bar = plt.Axes.bar

    def bar(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(list(x))
        return real_bar(self, x, *args, **kwargs)

    plt.Axes.bar = bar  # type: ignore[method-assign]
    try:
        mem.plot_memory(tmp_path / "run" / "metrics.jsonl", tmp_path / "m.png", report=report)
    finally:
        plt.Axes.bar = real_bar  # type: ignore[method-assign]
    assert drawn and all(x[0].startswith("measured") and x[1] == "planned" for x in drawn) and len(drawn) == 5
    assert (tmp_path / "m.png").stat().st_size > 0


def test_trackers_get_the_whole_config_as_dotted_scalars() -> None:
    from finetune.config.files import flat_config, load_config

    flat = flat_config(load_config(ROOT / "configs" / "goemotions-minilm.yaml"))
    assert flat["model.problem_type"] == "multi_label_classification" and flat["train.learning_rate"] == 1e-4
    assert flat["data.column_names"] == '["text", "labels", "id"]' and flat["data.truncation"] == "null"
    assert all(isinstance(v, (bool, int, float, str)) for v in flat.values())


def test_breakdown_off_samples_nothing_and_says_so() -> None:
    """memory.breakdown=false: no MemTracker window (the loop runs at full speed), memory.json says why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    monitor = mem.MemoryMonitor(torch.device("cpu"), model, optimizer, {}, breakdown=False)
    monitor.begin_sample(1)
    assert monitor._tracker is None
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    monitor.end_sample()
    rep = monitor.report(2)
    assert rep["memtracker_peak"] is None and rep["breakdown_method"].endswith("not sampled: memory.breakdown is false")


# A heaviest window in miniature, in a fresh process (glibc's threshold is per process and stays set): earlier
# windows have raised the mmap threshold (a freed 8 MiB mapping), then the window's 4 MiB temporaries are freed
# between small blocks that stay live, and larger ones follow. With glibc's defaults the freed 4 MiB chunks stay
# resident under the larger ones; under lean_heap each is its own mapping, unmapped when freed.
_HEAVY_WINDOW = """
import json, re
from pathlib import Path
import torch
from finetune.memory import monitor as memory

MIB = 1 << 20
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

def window():
    start, live, temps = rss(), [], []
    for _ in range(20):
        temps.append(torch.ones(4 * MIB, dtype=torch.uint8))
        live.append(torch.ones(MIB // 4, dtype=torch.uint8))
    temps.clear()
    temps = [torch.ones(6 * MIB, dtype=torch.uint8) for _ in range(20)]
    return (rss() - start) / MIB

raised = torch.ones(8 * MIB, dtype=torch.uint8)
del raised
with memory.lean_heap(LEAN):
    print(json.dumps(window()))
"""


def test_lean_heap_returns_a_window_s_freed_blocks_to_the_system() -> None:
    import subprocess
    import sys

    if mem._glibc() is None:
        pytest.skip("lean_heap acts on glibc only (this C library is another)")
    # each in a fresh process: a heap left with free chunks by an earlier window serves later requests from them
    # (glibc maps a block only when no free chunk fits), so one process measuring both windows was layout-dependent
    grown = {
        name: json.loads(
            subprocess.run(
                [sys.executable, "-c", f"LEAN = {lean}\n" + _HEAVY_WINDOW],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            ).stdout
        )
        for name, lean in (("default", False), ("lean", True))
    }
    in_use = 20 * 6 + 20 / 4  # MiB of tensors alive at the window's end
    assert grown["lean"] < in_use + 20  # the freed 4 MiB blocks were unmapped
    assert grown["default"] > in_use + 60  # and glibc's defaults keep them resident: what the switch removes


@pytest.mark.slow
def test_lean_heap_wraps_each_epoch_s_heaviest_window_only(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the windows as the loop ran them (the micro-batch shapes it noted), and which ran lean
    import contextlib

    windows: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def lean_heap(active: bool) -> Any:
        windows.append({"active": active, "shapes": []})
        yield

    monkeypatch.setattr(mem, "lean_heap", lean_heap)
    monkeypatch.setattr(mem.MemoryMonitor, "note_batch", lambda self, shape: windows[-1]["shapes"].append(shape))
    updates = {"data.max_train_samples": 64, "data.max_eval_samples": 16, "train.epochs": 2}
    cfg = write_tiny_config(tmp_path, updates | {"train.micro_batch_size": 8, "train.gradient_accumulation_steps": 2})
    assert train_main(["--config", str(cfg)]) == 0
    ran = [w for w in windows if w["shapes"]]  # an epoch's last call finds no batch left
    assert len(ran) == 8
    for epoch in (ran[:4], ran[4:]):
        padded = [max(s[0] * s[1] for s in w["shapes"]) for w in epoch]  # rows x longest row, per micro-batch
        heaviest = padded.index(max(padded))  # the earliest on a tie
        assert [w["active"] for w in epoch] == [i == heaviest for i in range(4)], padded

    cfg = write_tiny_config(tmp_path, updates | {"memory.lean_heaviest_window": False}, name="off.yaml")
    windows.clear()
    assert train_main(["--config", str(cfg), "run.overwrite=true"]) == 0
    assert windows and not any(w["active"] for w in windows)
