"""Host synchronisations, counted: every read of a tensor's value on the host (`item`, `tolist`, `bool`,
`float`, `int`, `cpu`, `numpy`) makes the CPU wait for the device on CUDA. The loop promises none per
optimizer step outside its log, evaluation and checkpoint steps; tests, `bench_vs_trainer.py --profile`
and `gpu_check.py --profile` count them with `HostSyncCounter`, which works on CPU where the
CUDA sync debug mode (`torch.cuda.set_sync_debug_mode`) does not exist.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
_TORCH_DIR = str(Path(torch.__file__).parent)


class HostSyncCounter:
    """Counts host reads of tensor values while active (a context manager; not thread-safe, not nested).

    `count` is the total; `sites` counts them by the first caller outside torch itself ("file:line (function)"), so a
    report names the line of the program, or of Accelerate or transformers, that asked for the value.
    Reads of tensors with one element that live on the CPU and were made there (an optimizer's `step`
    counter) are counted too: on CUDA they do not wait for the device, so a count on CPU is an upper bound.
    """

    def __init__(self) -> None:
        self.count = 0
        self.sites: Counter[str] = Counter()
        self._saved: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            self.sites[_caller()] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def __enter__(self) -> HostSyncCounter:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name, _MISSING)
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for name, saved in self._saved.items():
            if saved is _MISSING:
                delattr(torch.Tensor, name)  # inherited from the C base class: remove the patch
            else:
                setattr(torch.Tensor, name, saved)
        self._saved.clear()

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        """The `n` call sites with the most reads."""
        return self.sites.most_common(n)


_MISSING: Any = object()


def _caller() -> str:
    """The first frame outside torch's own package and this module, as "file:line (function)"."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_qualname})"
