"""The multi-process harness turns hangs and aborts into per-rank reports, and cleans up."""

import os
import subprocess
import time

import pytest

from hf_zero3.testing import DistributedFailure, mark, run_ranks


def _sum_ranks():
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def _rank1_sleeps_forever():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        mark("rank1 sleeping instead of all_reduce")
        _sleep_here_forever()
    mark("rank0 in all_reduce")
    dist.all_reduce(torch.ones(1))


def _sleep_here_forever():
    while True:
        time.sleep(0.05)


def _rank1_aborts():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        mark("rank1 about to abort")
        _abort_here()
    mark("rank0 in all_reduce")
    dist.all_reduce(torch.ones(1))


def _abort_here():
    os.abort()


def _leaves_a_child(pidfile):
    import torch.distributed as dist

    child = subprocess.Popen(["sleep", "300"])
    with open(f"{pidfile}.{dist.get_rank()}", "w") as f:
        f.write(str(child.pid))
    mark("child started")
    _sleep_here_forever()


def test_results_come_back_from_every_rank():
    assert run_ranks(_sum_ranks, 3, timeout=60) == [6.0, 6.0, 6.0]


def test_hang_is_reported_with_stack_and_state():
    start = time.monotonic()
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_rank1_sleeps_forever, 2, timeout=12, pg_timeout=4)
    elapsed = time.monotonic() - start
    err = info.value
    assert elapsed < 30
    assert err.outcomes == {0: "error", 1: "hang"}
    r0, r1 = err.reports
    assert r0.state == "rank0 in all_reduce"
    assert "all_reduce" in r0.error or "Timed out" in r0.error or "timeout" in r0.error.lower()
    assert err.timed_out
    assert r1.state == "rank1 sleeping instead of all_reduce"
    assert "_sleep_here_forever" in r1.stack
    text = str(err)
    assert "rank 1: HANG" in text and "_sleep_here_forever" in text


def test_abort_is_reported_with_stack():
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_rank1_aborts, 2, timeout=30, pg_timeout=5)
    err = info.value
    r1 = err.reports[1]
    assert r1.outcome == "died"
    assert r1.exitcode == -6  # SIGABRT
    assert r1.state == "rank1 about to abort"
    assert "_abort_here" in r1.stack
    assert err.reports[0].outcome in ("error", "died")
    assert "signal SIGABRT" in str(err)


def test_no_process_left_behind(tmp_path):
    pidfile = str(tmp_path / "child")
    with pytest.raises(DistributedFailure) as info:
        run_ranks(_leaves_a_child, 2, args=(pidfile,), timeout=8)
    assert info.value.outcomes == {0: "hang", 1: "hang"}
    time.sleep(0.5)
    for rank in range(2):
        pid = int(open(f"{pidfile}.{rank}").read())
        assert not _alive(pid), f"rank {rank}'s child {pid} outlived the run"


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie reaped by nobody counts as gone
    with open(f"/proc/{pid}/status") as f:
        return "zombie" not in f.read()


def test_a_gloo_pair_closed_by_its_peers_timeout_counts_as_timed_out():
    """When one side's timeout closes the pair first, gloo tells the other side "Application
    timeout caused pair closure", not "Timed out": both are the same hang."""
    from hf_zero3.testing.launcher import RankReport

    def report(rank, error):
        return RankReport(rank, "error", 1, "training", error, "", "")

    closed = "RuntimeError: Application timeout caused pair closure"
    assert DistributedFailure([report(0, closed), report(1, "ValueError: bad shape")], 1.0).timed_out
    assert not DistributedFailure([report(0, "ValueError: bad shape")], 1.0).timed_out
