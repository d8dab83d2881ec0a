r"""Run a function on several local processes (one per rank) with a gloo process group.

The command line uses this to start tensor-parallel runs on one machine without
``torchrun``. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) the function runs in the
current process instead, on the group ``torchrun`` set up.

Each rank returns a JSON-serialisable value; :func:`run_ranks` returns them in rank
order. A rank that fails is returned as a dict with ``"error"``, ``"type"``,
``"schedule_error"`` and ``"traceback"`` (so that the other ranks' results still arrive),
plus ``"rank"``, ``"cause"`` (``"raised"``, ``"died"``, ``"hung"`` or ``"collective"``),
``"summary"`` (the last frames of its traceback, or of its stack when it hung),
``"failed_after_s"`` and ``"root_cause"``.

Faults end the launch. The launcher watches its ranks (exit codes and result files):

* when a rank fails (raises, or dies without a result) the others get
  ``min(timeout_s, GRACE_S)`` seconds to end on their own (a peer in a collective with it
  fails at once), then are terminated, then killed;
* when a rank finishes while others run on, they get ``timeout_s + min(timeout_s,
  GRACE_S)``: any collective they wait in times out within ``timeout_s``;
* a rank stopped by the launcher is reported as ``"hung"``, with the Python stack it was
  stuck in.

So a rank that hangs, raises or dies ends every rank within the collective timeout plus
at most ``GRACE_S + KILL_AFTER_S`` (15 s). Ranks that *all* hang outside any collective
cannot be told from slow work and are not stopped.

One failure is the root cause: a rank's own exception first, then a death, then a rank
that hung, and only then a failed collective (the usual consequence of a peer that left);
the earliest one within a kind. :func:`failures` lists the failed ranks in that order and
:func:`raise_first_failure` raises one :class:`~torchloom.core.errors.RankFailedError` that
shows the root cause's own error first:

>>> raise_first_failure([{"ok": True}, {"ok": True}])     # nothing failed: nothing raised
>>> try:
...     raise_first_failure([
...         {"error": "Connection closed by peer", "type": "CollectiveTimeoutError",
...          "schedule_error": True, "rank": 0, "cause": "collective"},
...         {"error": "boom", "type": "ValueError", "schedule_error": False, "rank": 1,
...          "cause": "raised"}])
... except RankFailedError as err:
...     print("\n".join(str(err).splitlines()[:3]))
run_ranks(...): rank 1 of 2 failed first: ValueError: boom
    then:
      rank 0: CollectiveTimeoutError: Connection closed by peer  (a consequence of rank 1)
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import math
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.errors import CollectiveTimeoutError, LaunchError, RankFailedError, ScheduleError
from .process_group import init_distributed

__all__ = ["run_ranks", "under_torchrun", "init_group", "failures", "raise_first_failure",
           "DEFAULT_TIMEOUT_S", "GRACE_S"]

#: Seconds a collective waits for the other ranks before it fails.
DEFAULT_TIMEOUT_S = 120
#: After a rank failed: at most this long (and at most the timeout) for the others to end.
GRACE_S = 10.0
#: After terminating (SIGTERM) a rank: this long before it is killed (SIGKILL).
KILL_AFTER_S = 5.0
#: How long ranks may take to start and meet (importing torch on a busy machine).
START_TIMEOUT_S = 300.0
_POLL_S = 0.05
_CAUSES = ("raised", "died", "hung", "collective")  # root-cause precedence
_PEER_TROUBLE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|"
    r"timed out|gloo/transport|ProcessGroupGloo|ProcessGroupNCCL|NCCL error|Socket Timeout",
    re.IGNORECASE)


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (or another launcher that sets the
    ``RANK`` / ``WORLD_SIZE`` environment)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_group(timeout_s: float = DEFAULT_TIMEOUT_S,
               device: str | torch.device = "cpu") -> None:
    """Initialise the default process group from the environment (torchrun), with a
    timeout so a dead rank stops the others instead of hanging for gloo's 30 minutes;
    a no-op when a group exists. The backend follows ``device``, where the ranks' tensors
    live: NCCL for CUDA, gloo for CPU (:func:`~torchloom.runtime.process_group.backend_for`)."""
    if not dist.is_initialized():
        init_distributed(timeout_s=timeout_s, device=device)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in a rank


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a failed collective: the usual
    consequence of a peer that died, hung or raised, rather than a cause."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (CollectiveTimeoutError, dist.DistError)):
            return True
        if isinstance(e, RuntimeError) and _PEER_TROUBLE.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def _summary(exc: BaseException, frames: int = 3) -> str:
    """The last ``frames`` frames of ``exc``'s traceback (not the launcher's own) and the
    exception's first line."""
    tb = [f for f in traceback.extract_tb(exc.__traceback__)
          if not (f.filename == __file__ and f.name in ("_worker", "_join_group"))][-frames:]
    lines = [f'File "{f.filename}", line {f.lineno}, in {f.name}'
             + (f"\n    {f.line.strip()}" if f.line else "") for f in tb]
    first = (str(exc).strip().splitlines() or [""])[0]
    return "\n".join([*lines, f"{type(exc).__name__}: {first}"])


def _error_record(exc: BaseException, rank: int, t0: float, problem: str | None = None) -> dict:
    return {"error": problem or str(exc) or type(exc).__name__, "type": type(exc).__name__,
            "schedule_error": isinstance(exc, ScheduleError),
            "traceback": "".join(traceback.format_exception(exc)), "rank": rank,
            "cause": "collective" if _is_collective_failure(exc) else "raised",
            "summary": _summary(exc), "failed_after_s": round(time.time() - t0, 3)}


def _write(out_dir: str, rank: int, text: str) -> None:
    """Write a rank's result atomically (the launcher never reads half a file)."""
    tmp = Path(out_dir, f".rank{rank}.json.tmp")
    tmp.write_text(text)
    os.replace(tmp, Path(out_dir, f"rank{rank}.json"))


def _watch_parent(parent: int) -> None:
    """End this rank if the launcher dies (so that no rank outlives it)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="torchloom-watch-launcher", daemon=True).start()


def _join_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Meet the other ranks in the launcher's store (a long wait: starting a rank takes
    seconds on a busy machine), then start gloo with the short collective timeout."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=max(START_TIMEOUT_S, timeout_s)))
    if store.add("torchloom/arrived", 1) == world_size:
        store.set("torchloom/go", "1")
    store.wait(["torchloom/go"])
    init_distributed(timeout_s=timeout_s, store=store, rank=rank, world_size=world_size)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable[..., Any],
            args: tuple, timeout_s: float, t0: float, parent: int) -> None:
    _watch_parent(parent)
    stacks = open(Path(out_dir, f"rank{rank}.stack"), "w")  # noqa: SIM115 - lives as long as the rank
    if hasattr(signal, "SIGUSR1"):  # the launcher asks a hung rank where it is
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        _join_group(rank, world_size, port, timeout_s)
        result: Any = fn(rank, *args)
        try:
            text = json.dumps(result)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"rank {rank} returned a value that is not JSON-serialisable "
                            f"({type(result).__name__}): {exc}") from exc
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        _write(out_dir, rank, json.dumps(_error_record(exc, rank, t0)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the group may be broken: skip its teardown
    _write(out_dir, rank, text)
    if dist.is_initialized():  # fn may have ended the group itself
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the launcher


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Launch:
    """Start ``world_size`` ranks and watch them until each has a result or was stopped."""

    def __init__(self, fn: Callable[..., Any], world_size: int, args: tuple,
                 timeout_s: float, out_dir: str) -> None:
        self.world, self.timeout_s, self.out_dir, self.fn = world_size, timeout_s, out_dir, fn
        self.t0 = time.time()
        self.results: dict[int, Any] = {}
        self.first_failure: tuple[float, int] | None = None  # (monotonic time, rank)
        self.first_success: tuple[float, int] | None = None
        # The launcher hosts the rendezvous store: no port race between ranks.
        self.store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_worker, name=f"torchloom-rank{r}",
                                  args=(r, world_size, self.store.port, out_dir, fn, args,
                                        timeout_s, self.t0, os.getpid()))
                      for r in range(world_size)]

    def run(self) -> list[Any]:
        try:
            for proc in self.procs:
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as exc:
                    raise LaunchError(
                        f"cannot send the rank function or its arguments to a spawned rank: "
                        f"{exc}", primitive="run_ranks",
                        values={"fn": getattr(self.fn, "__qualname__", repr(self.fn))},
                        fix="pass a module-level function (not a lambda or a local "
                        "function) and picklable arguments: run_ranks(my_module.fn, 2, ...)",
                    ) from exc
            self._watch()
            self._end_all(wait_s=min(GRACE_S, KILL_AFTER_S))  # ranks still tearing down
        finally:
            self._end_all(wait_s=0.0)
        return _mark_root_cause([self.results[r] for r in range(self.world)])

    def _elapsed(self) -> float:
        return round(time.time() - self.t0, 3)

    def _watch(self) -> None:
        while len(self.results) < self.world:
            self._collect()
            if len(self.results) == self.world:
                return
            now = time.monotonic()
            if self.first_failure is not None:
                deadline = self.first_failure[0] + min(self.timeout_s, GRACE_S)
            elif self.first_success is not None:
                deadline = self.first_success[0] + self.timeout_s + min(self.timeout_s, GRACE_S)
            else:
                deadline = math.inf
            if now >= deadline:
                self._stop_running()
                return
            running = [p.sentinel for r, p in enumerate(self.procs) if r not in self.results]
            wait(running, timeout=min(_POLL_S, max(0.0, deadline - now)))

    def _read(self, rank: int) -> bool:
        path = Path(self.out_dir, f"rank{rank}.json")
        if not path.exists():
            return False
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            result = {"error": f"rank {rank}'s result file could not be read: {exc}",
                      "type": "RankDied", "schedule_error": False, "traceback": "",
                      "rank": rank, "cause": "died", "summary": "",
                      "failed_after_s": self._elapsed()}
        self._record(rank, result)
        return True

    def _record(self, rank: int, result: Any) -> None:
        self.results[rank] = result
        failed = isinstance(result, dict) and "error" in result
        if failed and self.first_failure is None:
            self.first_failure = (time.monotonic(), rank)
        if not failed and self.first_success is None:
            self.first_success = (time.monotonic(), rank)

    def _collect(self) -> None:
        for rank, proc in enumerate(self.procs):
            if rank in self.results or self._read(rank):
                continue
            code = proc.exitcode
            if code is None or self._read(rank):  # running, or wrote just before exiting
                continue
            how = (f"was killed by {_signal_name(code)}" + (
                " (often the out-of-memory killer)" if code == -signal.SIGKILL else "")
                if code < 0 else f"exited with status {code}")
            self._record(rank, {
                "error": f"rank {rank} {how} before returning a result",
                "type": "RankDied", "schedule_error": False, "traceback": "", "rank": rank,
                "cause": "died", "summary": "", "exitcode": code,
                "failed_after_s": self._elapsed()})

    def _stack(self, rank: int) -> str:
        """Where a running rank is: its faulthandler dump of the current thread."""
        proc, path = self.procs[rank], Path(self.out_dir, f"rank{rank}.stack")
        if not hasattr(signal, "SIGUSR1") or proc.pid is None:
            return ""
        try:
            os.kill(proc.pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + 2.0
        text, before = "", None
        while time.monotonic() < deadline and (not text or text != before):
            time.sleep(0.1)  # until the dump is there and has stopped growing
            before, text = text, path.read_text(errors="replace") if path.exists() else ""
        # faulthandler prints every thread; the main thread is the one marked "Current"
        # or, when the signal landed elsewhere, the one whose stack reaches _worker.
        blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
        main = [b for b in blocks if "in _worker" in b] or blocks
        lines = [ln.strip() for ln in main[0].splitlines()[1:] if ln.strip()]
        lines = [ln for ln in lines if "multiprocessing" not in ln and "in _worker" not in ln
                 and '"<string>"' not in ln]
        return "\n".join(lines[:6])

    def _stop_running(self) -> None:
        """Stop the ranks that neither returned nor died by the deadline: they hung."""
        if self.first_failure is not None:
            after = f"{min(self.timeout_s, GRACE_S):g} s after rank {self.first_failure[1]} failed"
        else:
            assert self.first_success is not None
            after = (f"{self.timeout_s + min(self.timeout_s, GRACE_S):g} s after rank "
                     f"{self.first_success[1]} finished (collective timeout "
                     f"{self.timeout_s:g} s)")
        for rank, proc in enumerate(self.procs):
            if rank in self.results:
                continue
            stack = self._stack(rank)
            self.results[rank] = {
                "error": f"rank {rank} was still running {after}, and was stopped by the "
                "launcher: it hung, or waited for something the other ranks never did",
                "type": "RankHung", "schedule_error": False, "traceback": stack,
                "rank": rank, "cause": "hung",
                "summary": f"stopped here (most recent call first):\n{_indent(stack, '  ')}"
                if stack else "",
                "failed_after_s": self._elapsed()}
            proc.terminate()

    def _end_all(self, wait_s: float) -> None:
        """Give live ranks ``wait_s`` to exit, then terminate, then kill them."""
        deadline = time.monotonic() + wait_s
        for sig_wait, stop in ((deadline, lambda p: None),
                               (None, lambda p: p.terminate()),
                               (None, lambda p: p.kill())):
            alive = [p for p in self.procs if p.pid is not None and p.exitcode is None]
            if not alive:
                return
            for proc in alive:
                stop(proc)
            end = sig_wait if sig_wait is not None else time.monotonic() + KILL_AFTER_S
            for proc in alive:
                proc.join(max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(1.0)


def _mark_root_cause(results: list[Any]) -> list[Any]:
    failed = failures(results)
    for i, record in enumerate(failed):
        record["root_cause"] = i == 0
    return results


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` ranks and return their results.

    ``fn`` must be importable (a module-level function) because ranks are spawned, and
    return a JSON-serialisable value. ``timeout_s`` is the collective timeout of the
    ranks' gloo group (and bounds how long a fault takes to end the launch, see the
    module docstring). With ``world_size == 1`` and no process group, ``fn(0, *args)``
    runs in this process (its exceptions propagate); under ``torchrun`` this rank's
    ``fn`` runs on the group torchrun set up.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
            not timeout_s > 0 or math.isinf(timeout_s):
        raise LaunchError(
            f"timeout_s must be a positive number of seconds, not {timeout_s!r}",
            primitive="run_ranks", values={"timeout_s": timeout_s},
            fix=f"run_ranks(fn, world_size, ..., timeout_s={DEFAULT_TIMEOUT_S})")
    if under_torchrun():
        init_group(timeout_s)
        return [fn(dist.get_rank(), *args)]
    if world_size == 1:
        return [fn(0, *args)]
    with tempfile.TemporaryDirectory(prefix="torchloom-ranks-") as out_dir:
        return _Launch(fn, world_size, args, float(timeout_s), out_dir).run()


# --------------------------------------------------------------------------- reporting


def failures(results: list[Any]) -> list[dict[str, Any]]:
    """The failed ranks' results, the root cause first: a rank's own exception, then a
    rank that died, then one that hung, then failed collectives (consequences); the
    earliest first within each kind.

    >>> [f["rank"] for f in failures([
    ...     {"error": "x", "type": "CollectiveTimeoutError", "cause": "collective", "rank": 0},
    ...     {"error": "y", "type": "ValueError", "cause": "raised", "rank": 1}])]
    [1, 0]
    """
    failed = []
    for i, r in enumerate(results):
        if isinstance(r, dict) and "error" in r:
            r.setdefault("rank", i)
            failed.append(r)

    def order(r: dict[str, Any]) -> tuple[int, float]:
        cause = r.get("cause", "died" if r.get("type") == "RankDied" else "raised")
        rank = _CAUSES.index(cause) if cause in _CAUSES else 0
        return rank, float(r.get("failed_after_s") or 0.0)

    return sorted(failed, key=order)


def _indent(text: str, by: str = "      ") -> str:
    return "\n".join(by + line for line in text.splitlines())


def _first_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


def raise_first_failure(results: list[Any], command: str = "run_ranks") -> None:
    """Raise a :class:`~torchloom.core.errors.RankFailedError` for the root-cause failure of
    ``results`` (see :func:`failures`): its rank, its own error (a ScheduleError's whole
    message, or the exception and the last frames of its traceback; for a hung rank, where
    it was stuck), then one line per other failed rank. Nothing happens when every rank
    succeeded. ``command`` names the caller in the message (``"torchloom verify"``)."""
    failed = failures(results)
    if not failed:
        return
    root, world = failed[0], len(results)
    rank, cause, kind = root.get("rank"), root.get("cause", "raised"), root.get("type", "?")
    if root.get("schedule_error"):
        head = f"rank {rank} of {world} failed first with this error:\n{_indent(root['error'])}"
    elif cause in ("raised", "collective"):
        head = f"rank {rank} of {world} failed first: {kind}: {_first_line(root['error'])}"
        if root.get("summary"):
            head += f"\n    its traceback, last calls:\n{_indent(root['summary'])}"
    else:
        head = f"rank {rank} of {world} {'hung' if cause == 'hung' else 'died'} first: " \
               f"{root['error']}"
        if root.get("summary"):
            head += f"\n{_indent(root['summary'], '    ')}"
    others = [f"rank {r.get('rank')}: {r.get('type')}: {_first_line(r['error'])}"
              + (f"  (a consequence of rank {rank})" if r.get("cause") == "collective" else "")
              for r in failed[1:]]
    if others:
        head += "\n    then:\n" + _indent("\n".join(others))
    timeout_fix = "if a rank is only slow, raise the collective timeout (--timeout SECONDS " \
                  "on the command line, run_ranks(..., timeout_s=...))"
    fix = {
        "raised": f"fix rank {rank}'s own error shown first (the others stopped because it left)"
                  + ("; its message says how" if root.get("schedule_error") else
                     ": the traceback is that rank's"),
        "died": (f"rank {rank} was killed or crashed outside Python: look for the "
                 "out-of-memory killer (dmesg) or a native crash; lower --batch-size / "
                 "--seq-len if memory ran out") if (root.get("exitcode") or -1) < 0 else
                (f"rank {rank} ended its process without returning (os._exit, or a native "
                 "library that exits): let the rank function return or raise instead"),
        "hung": f"make every rank call the same collectives in the same order (the stack "
                f"shows where rank {rank} waited); {timeout_fix}",
        "collective": f"every rank must call the same collectives in the same order, with "
                      f"the same shapes; {timeout_fix}",
    }.get(cause, f"fix rank {rank}'s error shown first")
    raise RankFailedError(
        head, primitive=command,
        values={"rank": rank, "type": kind, "cause": cause, "world_size": world,
                "failed": len(failed)},
        fix=fix)
