"""Tests for monitor.py: the Echo Trap monitor fires on each of the paper's signals, and only then.

    python -m pytest -q tests/test_monitor.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_echo_monitor_fires_on_each_signal():
    from monitor import EchoMonitor, echo_check, watch
    mon = EchoMonitor()
    quiet = {"rollout/in_group_std": 1.0, "rollout/success": 0.5, "train/grad_norm": 1.0, "train/entropy": 2.0}
    for _ in range(6):
        assert echo_check(mon, dict(quiet)) == {}
    # the std falls to ~0 and success does not rise: the mean of 5 drops below 0.25x at the 4th low iteration,
    # and the warning comes at the 3rd such iteration in a row
    fired = [echo_check(mon, {**quiet, "rollout/in_group_std": 0.01}) for _ in range(6)]
    assert [bool(f) for f in fired] == [False] * 5 + [True]
    assert list(fired[-1]) == ["std_collapse"] and "reward std" in fired[-1]["std_collapse"]
    mon = EchoMonitor()
    for _ in range(6):
        echo_check(mon, dict(quiet))
    m = {**quiet, "train/grad_norm": 50.0}
    w = watch(mon, m)
    assert len(w) == 1 and "grad norm" in w[0] and m["echo/grad_spike"] == 1 and m["echo/warnings"] == 1
    # one noisy entropy is not a swing; a sustained one is (its mean of 5 beyond 5x the early level)
    assert echo_check(mon, {**quiet, "train/entropy": 12.0}) == {}
    fired = [echo_check(mon, {**quiet, "train/entropy": 40.0}) for _ in range(3)]
    assert "entropy_swing" in fired[-1] and "entropy" in fired[-1]["entropy_swing"]


def test_a_vanishing_std_with_rising_success_is_convergence_not_a_warning():
    """Issue 53.6: the old monitor warned 65 times over 5 healthy Bandit runs (entropy noise of one iteration
    against its median). A run whose every rollout comes to succeed also loses its reward spread: no warning."""
    from monitor import EchoMonitor, echo_check
    mon = EchoMonitor()
    for i in range(30):
        converging = {"rollout/in_group_std": 1.0 if i < 5 else 0.01, "rollout/success": 0.5 if i < 5 else 0.99,
                      "train/grad_norm": 1.0 + 0.5 * (i % 3), "train/entropy": 0.3 if i % 2 else 0.08}
        assert echo_check(mon, converging) == {}, i


def test_recorded_runs_healthy_ones_silent_a_collapsing_one_warned():
    """The signals of four recorded runs (docs/results.md, "The Echo Trap monitor"; tests/data): two healthy
    Bandit runs with the defaults and the lab's StarPO-S seed 6 (held) raise no warning; the lab's StarPO seed 6
    (collapsed at iteration 3: the safe arm, one template) raises std_collapse from iteration 11 on."""
    import json
    from monitor import EchoMonitor, echo_check
    runs = json.loads((Path(__file__).parent / "data" / "echo_signals.json").read_text())
    keys = ("in_group_std", "success", "grad_norm", "entropy")
    first = {}
    for name, sig in runs.items():
        mon, fired = EchoMonitor(), []
        for i in range(len(sig["success"])):  # the entropy and grad norm are absent on skipped updates
            m = {f"{'rollout' if k in ('in_group_std', 'success') else 'train'}/{k}": sig[k][i] for k in keys
                 if sig[k][i] is not None}
            fired += [(i + 1, w) for w in echo_check(mon, m)]
        first[name] = fired[0] if fired else None
    assert first == {"healthy bandit s0": None, "healthy bandit s1": None, "lab starpo-s s6 (held)": None,
                     "lab starpo s6 (collapsed)": (11, "std_collapse")}


def test_mi_warning_fires_only_on_a_collapsing_mi_when_it_is_measured():
    from monitor import EchoMonitor, echo_check, watch
    mon = EchoMonitor()
    quiet = {"rollout/in_group_std": 1.0, "rollout/success": 0.5, "train/grad_norm": 1.0, "train/entropy": 2.0}
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
