"""Tests for monitor.py: the Echo Trap monitor fires on each of the paper's signals, and only then.

    python -m pytest -q tests/test_monitor.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_echo_monitor_fires_on_each_signal():
    from monitor import EchoMonitor, echo_check, watch
    mon = EchoMonitor()
    quiet = {"rollout/in_group_std": 1.0, "train/grad_norm": 1.0, "train/entropy": 2.0}
    for _ in range(6):
        assert echo_check(mon, dict(quiet)) == {}
    fired = [echo_check(mon, {**quiet, "rollout/in_group_std": 0.01}) for _ in range(10)]
    assert list(fired[-1]) == ["std_collapse"] and "reward std" in fired[-1]["std_collapse"] and not any(fired[:9])
    mon = EchoMonitor()
    for _ in range(6):
        echo_check(mon, dict(quiet))
    m = {**quiet, "train/grad_norm": 50.0, "train/entropy": 4.0}
    w = watch(mon, m)
    assert len(w) == 2 and "grad norm" in w[0] and "entropy" in w[1]
    assert m["echo/warnings"] == 2 and m["echo/grad_spike"] == m["echo/entropy_swing"] == 1
