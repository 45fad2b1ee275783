"""The Echo Trap monitor (paper section 4.1): the early-warning signals of a collapsing multi-turn RL run.

The paper's order of events: the in-group reward std collapses first, then the gradient norm spikes, the
entropy swings, and the policy repeats one template. `echo_check` says which signals fired; `train.py
--stop-on-collapse` ends the run there. The thresholds are this codebase's, not the paper's (docs/results.md).
With --collapse-every, RAGEN-2's template-collapse MI is one more signal (extras/collapse.py).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class EchoMonitor:
    """The signals' histories (checkpointed: a resumed run warns as the uninterrupted one would)."""
    std_history: list = field(default_factory=list)
    grad_history: list = field(default_factory=list)
    ent_history: list = field(default_factory=list)
    low_std_run: int = 0
    mi_history: list = field(default_factory=list)
    low_mi_run: int = 0
    success_history: list = field(default_factory=list)


def _recent(xs: list, n: int) -> float:
    return statistics.fmean(xs[-n:])


def echo_check(mon: EchoMonitor, m: dict, baseline_iters: int = 5, smooth: int = 5, std_ratio: float = 0.25,
               patience: int = 3, grad_factor: float = 7.0, ent_band: tuple = (0.1, 5.0),
               window: int = 20) -> dict[str, str]:
    """One iteration's metrics -> {signal: warning} for those that fired. Each signal is read as a running
    mean of `smooth` iterations against its first `baseline_iters` (one iteration's entropy and std, on 2 kept
    groups, are too noisy to read alone). std_collapse: the reward std below std_ratio x its early level
    `patience` iterations in a row while training success is not above its early level (a std that vanishes
    because every rollout succeeds is convergence, not the trap); grad_spike: one grad norm above
    grad_factor x its running median; entropy_swing: the entropy outside ent_band x its early level.
    Thresholds measured on healthy and collapsing Bandit runs (docs/results.md, "The Echo Trap monitor")."""
    warnings = {}
    std, success = m.get("rollout/in_group_std"), m.get("rollout/success")
    if std is not None:
        mon.std_history.append(std)
        mon.success_history.append(success if success is not None else 0.0)
        if len(mon.std_history) > baseline_iters:
            base = statistics.fmean(mon.std_history[:baseline_iters])
            improving = _recent(mon.success_history, smooth) > statistics.fmean(
                mon.success_history[:baseline_iters])
            now = _recent(mon.std_history, smooth)
            mon.low_std_run = mon.low_std_run + 1 if now < std_ratio * base and not improving else 0
            if mon.low_std_run >= patience:
                warnings["std_collapse"] = (f"reward std {now:.4f} (mean of "
                                            f"{smooth}) < {std_ratio}x its early level {base:.4f} for "
                                            f"{mon.low_std_run} iterations, success not rising")
    g = m.get("train/grad_norm")
    if g is not None and math.isfinite(g):
        past = mon.grad_history[-window:]
        if len(past) >= 5 and g > grad_factor * statistics.median(past):
            warnings["grad_spike"] = (f"grad norm {g:.3g} > {grad_factor:g}x its running median "
                                      f"{statistics.median(past):.3g}")
        mon.grad_history.append(g)
    e = m.get("train/entropy")
    if e is not None and math.isfinite(e):
        mon.ent_history.append(e)
        if len(mon.ent_history) > baseline_iters:
            base, now = statistics.fmean(mon.ent_history[:baseline_iters]), _recent(mon.ent_history, smooth)
            if not ent_band[0] * base <= now <= ent_band[1] * base:
                warnings["entropy_swing"] = (f"entropy {now:.3g} (mean of {smooth}) left {ent_band[0]:g}-"
                                             f"{ent_band[1]:g}x its early level {base:.3g}")
    mi = m.get("collapse/mi")
    if mi is not None and math.isfinite(mi):  # beyond the paper: --collapse-every
        from extras.collapse import mi_check
        warning = mi_check(mon, mi)
        if warning:
            warnings["mi_collapse"] = warning
    return warnings


def watch(mon: EchoMonitor, m: dict) -> list[str]:
    """echo_check, its verdict logged into `m` (echo/warnings, echo/SIGNAL = 1) -> the warnings' texts."""
    warnings = echo_check(mon, m)
    m["echo/warnings"] = len(warnings)
    m.update({f"echo/{signal}": 1 for signal in warnings})
    return list(warnings.values())
