"""Run a function on N ranks of a real ``torch.distributed`` group and turn hangs into reports.

Every distributed test of hf_zero3 goes through :func:`run_ranks`. Each rank is a new process
in its own session (so nothing it starts outlives it), joins a gloo (or NCCL) group with
a short process-group timeout, and keeps three files in a scratch folder: its last *state*
(set with :func:`mark`), its *stack* (``faulthandler`` dumps on a fatal signal or when the parent
asks) and its *log*. When the outer deadline passes, the parent asks every live rank for its
stack, kills what is left and raises :class:`DistributedFailure`, which names each rank, what
happened to it, where it was, and its last stack.

CPU (gloo) ranks are forked from a fork server that imported torch, DeepSpeed, transformers,
accelerate, PEFT and TRL once (``hf_zero3/testing/_rank_imports.py``): every rank is still a fresh
process with its own state, but starts in milliseconds instead of paying those imports again.
CUDA ranks are spawned (a process that may have touched CUDA must not be forked).
"""

from __future__ import annotations

import datetime
import faulthandler
import fcntl
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hf_zero3._upstream.torch import inductor_compile_module

_STATE_FILE: str | None = None

#: Outcomes a rank can have, in the order a report lists the worst first.
OK, ERROR, DIED, HANG = "ok", "error", "died", "hang"

#: How gloo words a collective that ran past the process-group timeout: the waiting side
#: reports "Timed out ...", or, when its peer's pair closed first, "Application timeout caused
#: pair closure".
_COLLECTIVE_TIMEOUT = re.compile(r"timed out|application timeout", re.IGNORECASE)


@dataclass
class RankReport:
    """What one rank did: ``outcome`` is ok / error (raised) / died (signal or exit) / hang."""

    rank: int
    outcome: str
    exitcode: int | None
    state: str
    error: str
    stack: str
    log: str

    def describe(self) -> str:
        head = f"rank {self.rank}: {self.outcome.upper()}"
        if self.exitcode is not None and self.outcome != OK:
            code = self.exitcode
            head += f" (signal {signal.Signals(-code).name})" if code < 0 else f" (exit {code})"
        head += f"; last state: {self.state or '<none>'}"
        parts = [head]
        if self.error:
            parts.append("  error:\n" + _indent(self.error.strip()))
        if self.stack and self.outcome in (HANG, DIED):
            parts.append("  stack:\n" + _indent(self.stack.strip()))
        if self.log and self.outcome != OK:
            parts.append("  log tail:\n" + _indent(_tail(self.log, 25)))
        return "\n".join(parts)


class DistributedFailure(AssertionError):
    """Raised when any rank did not finish cleanly; ``reports`` holds every rank's report."""

    def __init__(self, reports: Sequence[RankReport], elapsed: float):
        self.reports = list(reports)
        self.elapsed = elapsed
        super().__init__(self._format())

    @property
    def outcomes(self) -> dict[int, str]:
        return {r.rank: r.outcome for r in self.reports}

    @property
    def timed_out(self) -> bool:
        """A rank hung, or a collective ran past the process-group timeout (a hang the
        timeout turned into an error)."""
        return any(r.outcome == HANG or _COLLECTIVE_TIMEOUT.search(r.error) for r in self.reports)

    def _format(self) -> str:
        lines = [
            f"distributed run failed after {self.elapsed:.1f}s: "
            + ", ".join(f"rank {r.rank} {r.outcome}" for r in self.reports)
        ]
        lines += [r.describe() for r in self.reports]
        return "\n".join(lines)


def mark(state: str) -> None:
    """Record where this rank is; a failure report shows the last mark of every rank."""
    if _STATE_FILE is None:
        return
    with open(_STATE_FILE, "w") as f:
        f.write(state)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 20.0,
    backend: str = "gloo",
    init: str = "torch",
    env: dict[str, str] | None = None,
    capture: bool = True,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return each rank's result.

    ``init``: ``"torch"`` joins the group with ``torch.distributed.init_process_group``,
    ``"deepspeed"`` with ``deepspeed.init_distributed`` (which also sets up DeepSpeed's comm
    backend), ``"none"`` leaves it to ``fn``. ``timeout`` is the hard wall-clock limit for the
    whole run; ``pg_timeout`` is every collective's limit. ``capture=False`` lets rank output
    through to the terminal (for demos) instead of into the report. ``start_method``: how ranks
    start; by default ``"forkserver"`` for gloo (imports paid once per process that calls this)
    and ``"spawn"`` for NCCL.
    Raises :class:`DistributedFailure` if any rank raises, dies or is still running at the deadline.
    """
    if init not in ("torch", "deepspeed", "none"):
        raise ValueError(f"init must be 'torch', 'deepspeed' or 'none', not {init!r}")
    workdir = tempfile.mkdtemp(prefix="hf_zero3_ranks_")
    ctx = _context(start_method or ("forkserver" if backend == "gloo" else "spawn"))
    port = free_port()
    procs = []
    start = time.monotonic()
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    port,
                    workdir,
                    args,
                    kwargs or {},
                    pg_timeout,
                    backend,
                    init,
                    {**os.environ, **(env or {})},
                    capture,
                ),
                name=f"hf_zero3-rank{rank}",
            )
            p.start()
            procs.append(p)
        deadline = start + timeout
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            time.sleep(0.1)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in hung:  # ask for stacks first, then kill
            _signal(procs[i].pid, signal.SIGUSR1, group=False)
        if hung:
            time.sleep(1.0)
        reports = [_report(i, procs[i], workdir, hung=i in hung) for i in range(world_size)]
        elapsed = time.monotonic() - start
        if any(r.outcome != OK for r in reports):
            raise DistributedFailure(reports, elapsed)
        return [_load(os.path.join(workdir, f"rank{i}.result")) for i in range(world_size)]
    finally:
        for p in procs:
            if p.pid is not None:
                _signal(p.pid, signal.SIGKILL, group=True)
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _context(method: str):
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method {method!r} is not available here; use one of {multiprocessing.get_all_start_methods()}"
        )
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["hf_zero3.testing._rank_imports"])
    return ctx


def _compile_one_rank_at_a_time(lock_path: str) -> None:
    """CPU ranks of one run compile with inductor one at a time (a file lock around
    ``torch._inductor.compile_fx.compile_fx``, the entry ``torch.compile``'s inductor backend
    calls). Ranks of a group trace the same graphs: the first compiles each one (C++ codegen and
    a compiler run per kernel, the bulk of a CPU test's time) and writes inductor's on-disk caches,
    the next finds it there instead of compiling it again at the same moment. Compiling runs no
    collective, so a rank waiting for the lock holds up no other rank's collective; the lock is the
    run's own, so two runs side by side still compile at once."""
    module = inductor_compile_module()
    inner, depth = module.compile_fx, threading.local()

    def compile_fx(*args, **kwargs):
        if getattr(depth, "n", 0):  # compile_fx calls itself (config patches): the lock is held
            return inner(*args, **kwargs)
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            depth.n = 1
            try:
                return inner(*args, **kwargs)
            finally:
                depth.n = 0
                fcntl.flock(lock, fcntl.LOCK_UN)

    module.compile_fx = compile_fx


def _rank_main(fn, rank, world_size, port, workdir, args, kwargs, pg_timeout, backend, init, env, capture):
    """``env`` is the caller's whole environment at launch (plus the run's ``env``): a forked
    rank would otherwise see the fork server's, taken when it started."""
    global _STATE_FILE
    os.setsid()  # own session: the parent kills it and everything it started in one go
    if capture:
        log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    _STATE_FILE = os.path.join(workdir, f"rank{rank}.state")
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        # One intra-op thread per rank unless asked otherwise, as torchrun sets OMP_NUM_THREADS=1
        # for several processes on one host: ranks sharing the cores must not oversubscribe them.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
        _compile_one_rank_at_a_time(os.path.join(workdir, "compile.lock"))
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    result_path = os.path.join(workdir, f"rank{rank}.result")
    try:
        mark("init_process_group")
        timeout = datetime.timedelta(seconds=pg_timeout)
        if init == "torch":
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        elif init == "deepspeed":
            import deepspeed  # after the rank environment above: DeepSpeed picks its accelerator on import

            deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
        mark("running")
        result = fn(*args, **kwargs)
        mark("done")
        with open(result_path, "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(workdir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a destroyed-while-peers-wait group can block there.
    os._exit(0)


def _report(rank, proc, workdir, hung) -> RankReport:
    def read(name):
        try:
            with open(os.path.join(workdir, f"rank{rank}.{name}"), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    error = read("error")
    if hung:
        outcome = HANG
    elif proc.exitcode == 0 and os.path.exists(os.path.join(workdir, f"rank{rank}.result")):
        outcome = OK
    elif error:
        outcome = ERROR
    else:
        outcome = DIED
    return RankReport(rank, outcome, None if hung else proc.exitcode, read("state"), error, read("stack"), read("log"))


def _load(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _signal(pid, sig, group):
    try:
        if group:
            os.killpg(pid, sig)  # the rank is its session's (and group's) leader
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _tail(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])
