"""Experiment trackers (`log.trackers`): reached before the run directory is written, started after it,
and dropped with one line when one fails in the middle of a run.

Accelerate's `init_trackers` builds and starts every tracker at once and its `log` calls each in turn:
a tracker server that is down ended the run with the server client's traceback (MLflow: 120 lines after
its retries), and one that failed mid-run ended training with it. Here each tracker is started by
name, so a failure names it, and each runs inside `GuardedTracker`, which reports its first error
once and stops calling it: training, checkpoints and metrics.jsonl do not depend on a tracker.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

from finetune.core.errors import UserError

logger = logging.getLogger("finetune")

REACH_TIMEOUT_S = 5.0  # a tracker server on the network answers a TCP connect well within this


def _mlflow_uri() -> str | None:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        try:
            import mlflow

            uri = mlflow.get_tracking_uri()  # its default: a local store
        except ImportError:
            return None
    return uri


def _offline(variable: str, *modes: str) -> bool:
    return os.environ.get(variable, "").lower() in modes


# tracker -> (the variable that makes it log locally, its values that do, the server's variable, its default)
_SERVERS: dict[str, tuple[str, tuple[str, ...], str, str | None]] = {
    "wandb": ("WANDB_MODE", ("offline", "disabled", "dryrun"), "WANDB_BASE_URL", "https://api.wandb.ai"),
    "comet_ml": ("COMET_OFFLINE", ("1", "true"), "COMET_URL_OVERRIDE", "https://www.comet.com"),
    "clearml": ("CLEARML_OFFLINE_MODE", ("1", "true"), "CLEARML_API_HOST", None),
    "swanlab": ("SWANLAB_MODE", ("local", "offline", "disabled"), "SWANLAB_API_HOST", "https://api.swanlab.cn"),
}


def tracker_uri(name: str) -> str | None:
    """The server a tracker talks to, from its own environment variables; None when it logs locally."""
    if name == "mlflow":
        return _mlflow_uri()
    if name in _SERVERS:
        offline, modes, variable, default = _SERVERS[name]
        return None if _offline(offline, *modes) else os.environ.get(variable, default)
    if name == "aim":
        repo = os.environ.get("AIM_REPO", "")
        return repo if repo.startswith("aim://") else None
    return None  # tensorboard, dvclive and trackio (without a Space) write files


def _address(uri: str) -> tuple[str, int] | None:
    """(host, port) of a network URI; None for a local store (a path, file:, sqlite:, databricks...)."""
    parts = urlsplit(uri)
    default = {"http": 80, "https": 443, "aim": 53800}.get(parts.scheme)
    if default is None or not parts.hostname:
        return None
    try:
        return parts.hostname, parts.port or default
    except ValueError:  # a port that is no number: the connect below names the URI
        return parts.hostname, default


def reach_trackers(trackers: list[str], timeout_s: float = REACH_TIMEOUT_S) -> None:
    """Open (and close) a connection to the server of each tracker that logs over the network.

    Called before the run directory is written, so an unreachable server costs one line and nothing else.

    Raises:
        UserError: a tracker's server does not accept a connection within `timeout_s`.
    """
    for name in trackers:
        uri = tracker_uri(name)
        address = _address(uri) if uri else None
        if address is None:
            continue
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise UserError(
                f"log.trackers: {name} cannot be reached at {uri} ({reason}); start its server, point it elsewhere "
                f"(its own environment variable, e.g. MLFLOW_TRACKING_URI) or remove {name} from log.trackers; "
                "nothing was written"
            ) from None


class GuardedTracker(GeneralTracker):
    """One of Accelerate's trackers whose first error is reported once; after it the tracker is dropped."""

    requires_logging_directory = False

    def __init__(self, inner: GeneralTracker) -> None:
        self.inner = inner
        self.name = inner.name
        self.main_process_only = getattr(inner, "main_process_only", True)
        self.failed = False
        super().__init__()

    @property
    def tracker(self) -> Any:
        return self.inner.tracker

    def _call(self, what: str, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.inner, what)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any tracker error: the run goes on without it
            self.failed = True
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            step = kwargs.get("step")
            at = f" at step {step}" if step is not None else ""
            logger.warning(
                f"warning: log.trackers: {self.name} failed{at} ({type(exc).__name__}: {first}); it is dropped for "
                "the rest of the run; training, checkpoints and metrics.jsonl go on"
            )

    def store_init_configuration(self, values: dict) -> None:
        self._call("store_init_configuration", values)

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        self._call("log", values, step=step, **kwargs)

    def finish(self) -> None:
        self._call("finish")


def start_trackers(accelerator: Accelerator, config: dict[str, Any], init_kwargs: dict[str, dict[str, Any]]) -> None:
    """Start each tracker of the accelerator's `log_with` (main process), log `config`, guard it.

    Raises:
        UserError: a tracker cannot be started (its server refused the run, bad credentials, ...).
    """
    if not accelerator.is_main_process:
        return
    for name in [str(t) for t in accelerator.log_with]:
        cls = LOGGER_TYPE_TO_CLASS[name]
        try:
            args = (accelerator.logging_dir,) if cls.requires_logging_directory else ()
            tracker = cls("finetune", *args, **init_kwargs.get(name, {}))
            tracker.start()
        except Exception as exc:  # noqa: BLE001 - the client's error, in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            where = tracker_uri(name)
            raise UserError(
                f"log.trackers: {name} could not start a run{f' at {where}' if where else ''} "
                f"({type(exc).__name__}: {first}); fix its settings or remove {name} from log.trackers"
            ) from None
        guarded = GuardedTracker(tracker)
        guarded.store_init_configuration(config)
        accelerator.trackers.append(guarded)
