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


def echo_check(mon: EchoMonitor, m: dict, baseline_iters: int = 5, std_ratio: float = 0.1, patience: int = 10,
               grad_factor: float = 5.0, ent_swing: float = 0.5, window: int = 20) -> dict[str, str]:
    """One iteration's metrics -> {signal: warning} for those that fired: std_collapse (std below std_ratio x
    its early mean, `patience` iterations in a row), grad_spike, entropy_swing (vs their running medians)."""
    warnings = {}
    std = m.get("rollout/in_group_std")
    if std is not None:
        mon.std_history.append(std)
        if len(mon.std_history) > baseline_iters:
            base = statistics.fmean(mon.std_history[:baseline_iters])
            mon.low_std_run = mon.low_std_run + 1 if std < std_ratio * base else 0
            if mon.low_std_run >= patience:
                warnings["std_collapse"] = (f"reward std {std:.4f} < {std_ratio}x its early level {base:.4f} "
                                            f"for {mon.low_std_run} iterations")
    g = m.get("train/grad_norm")
    if g is not None and math.isfinite(g):
        past = mon.grad_history[-window:]
        if len(past) >= 5 and g > grad_factor * statistics.median(past):
            warnings["grad_spike"] = (f"grad norm {g:.3g} > {grad_factor}x its running median "
                                      f"{statistics.median(past):.3g}")
        mon.grad_history.append(g)
    e = m.get("train/entropy")
    if e is not None and math.isfinite(e):
        past = mon.ent_history[-window:]
        med = statistics.median(past) if len(past) >= 5 else None
        if med is not None and abs(e - med) > ent_swing * med:
            warnings["entropy_swing"] = (f"entropy {e:.3g} swung by more than {ent_swing:.0%} from its "
                                         f"running median {med:.3g}")
        mon.ent_history.append(e)
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
