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


def test_mi_warning_fires_only_on_a_collapsing_mi_when_it_is_measured():
    from monitor import EchoMonitor, echo_check, watch
    mon = EchoMonitor()
    quiet = {"rollout/in_group_std": 1.0, "train/grad_norm": 1.0, "train/entropy": 2.0}
    for mi in (0.8, 1.0, 1.2):  # baseline: mean 1.0 over the first 3 measurements
        assert echo_check(mon, {**quiet, "collapse/mi": mi}) == {}
    for _ in range(4):  # iterations without a measurement change nothing
        assert echo_check(mon, dict(quiet)) == {}
    assert echo_check(mon, {**quiet, "collapse/mi": 0.6}) == {}  # above 0.5x: fine
    assert echo_check(mon, {**quiet, "collapse/mi": 0.4}) == {}  # below, once
    m = {**quiet, "collapse/mi": 0.3}
    w = watch(mon, m)  # below twice in a row
    assert len(w) == 1 and "MI 0.3000 < 0.5x its early level 1.0000 for 2 measurements" in w[0]
    assert m["echo/mi_collapse"] == 1 and m["echo/warnings"] == 1
    assert echo_check(mon, {**quiet, "collapse/mi": 0.9}) == {}  # recovered: the run restarts
    assert mon.low_mi_run == 0
    # MI 0 from the start (identical prompts): nothing to lose, never a warning
    mon = EchoMonitor()
    assert not any(echo_check(mon, {"collapse/mi": 0.0}) for _ in range(10))
    # MI at noise level from the start (Bandit: +-0.002 nats): halving noise is not a collapse
    mon = EchoMonitor()
    assert not any(echo_check(mon, {"collapse/mi": mi}) for mi in (2e-3, 1e-3, 2e-3, 1e-4, -1e-3, 0.0, 1e-5))
    # the monitor still round-trips through its checkpoint form, with and without the new fields
    from dataclasses import asdict
    state = asdict(mon)
    assert EchoMonitor(**state) == mon
    del state["mi_history"], state["low_mi_run"]
    assert EchoMonitor(**state).mi_history == []
