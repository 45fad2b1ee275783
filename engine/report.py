"""What the entry scripts print: one line per iteration (train.py), one line per SFT step (sft_baseline.py),
eval.py's line per env and its markdown table, a trajectory as text. Formatting only: nothing here computes a
number the scripts log. (A training run's first line, which names the method, is train.describe.)
"""
from __future__ import annotations


def run_line(name: str, cfg, extra: str, device) -> str:
    """train.py's first printed line: the method's `name` (train.describe), what it filters, its KL and clip,
    the options beyond the paper (`extra`), the env, the model, the device."""
    kl = "no KL"
    if cfg.kl_coef:
        kl = f"KL {cfg.kl_coef:g} (in the {'rewards' if cfg.kl_in_reward else 'loss'})"
    kept = f"{'bottom' if cfg.filter_smallest else 'top'} {cfg.filter:.0%} of"
    if cfg.filter >= 1:
        kept = "all"
    if cfg.filter_strategy != "top_k":
        kept = f"{cfg.filter_strategy} {cfg.filter:g} of"
    model = "tiny policy" if cfg.model == "tiny" else cfg.model
    by = cfg.filter_metric.replace("_", " ")
    return (f"{name}: {cfg.algo.upper()}, {kept} {cfg.groups} groups by {by}, {kl}, clip "
            f"{cfg.clip_low:g}/{cfg.clip_high:g}{extra} | {cfg.env} | {model} | {device}")


def iteration_line(m: dict) -> str:
    """train.py's one printed line per iteration (docs/metrics.md)."""
    keys = [("reward", "rollout/reward_mean"), ("succ", "rollout/success"), ("std", "rollout/in_group_std"),
            ("kept_std", "rollout/chosen_in_group_std"), ("fmt", "rollout/format"), ("ent", "train/entropy"),
            ("gnorm", "train/grad_norm"), ("kl0", "train/kl_to_init"), ("mi", "collapse/mi"),
            ("clip", "train/pg_clipfrac"), ("eval", "eval/success"), ("s", "time/iteration")]
    return " | ".join([f"it {m['step']}"] + [f"{n} {m[k]:.3g}" for n, k in keys if m.get(k) is not None])


def step_line(m: dict, steps: int) -> str:
    """sft_baseline.py's one printed line per optimizer step."""
    keys = [("loss", "train/loss"), ("ent", "train/entropy"), ("gnorm", "train/grad_norm"),
            ("lr", "train/lr"), ("test", "test/loss"), ("eval", "eval/success"), ("s", "time/iteration")]
    return " | ".join([f"step {m['step']}/{steps} ep {m['epoch']}"] +
                      [f"{n} {m[k]:.3g}" for n, k in keys if m.get(k) is not None])


def eval_line(env: str, m: dict, per_sample: list[float]) -> str:
    """eval.py's line per env (to stderr): success with its interval, each sample's when several, actions."""
    each = f" (per sample: {' '.join(f'{x:.3f}' for x in per_sample)})" if len(per_sample) > 1 else ""
    if "pass_at_k" in m:
        each += " " + " ".join(f"pass@{k} {v:.3f}" for k, v in m["pass_at_k"].items())
    return (f"{env}: success {m['success']:.3f} [{m['success_lo']:.3f}, {m['success_hi']:.3f}]{each} "
            f"actions {m['num_actions']:.2f} valid {m['valid_action']:.3f} effective "
            f"{m['effective_action']:.3f} format {m['format']:.3f} ({m['seconds']:.0f}s)")


def table(rows: dict[str, dict]) -> str:
    """eval.py's markdown table: a row per env."""
    head = "| env | success (95% CI) | reward | actions | valid | effective | format | resp. tokens |"
    out = [head, "|" + "---|" * 8]
    for env, m in rows.items():
        rl = "-" if m["response_length"] is None else f"{m['response_length']:.1f}"
        out.append(f"| {env} | {m['success']:.3f} ({m['success_lo']:.3f}-{m['success_hi']:.3f}) | "
                   f"{m['reward']:.3f} | {m['num_actions']:.2f} | {m['valid_action']:.3f} | "
                   f"{m['effective_action']:.3f} | {m['format']:.3f} | {rl} |")
    return "\n".join(out)


def dump(traj, tokenizer=None) -> str:
    """One trajectory (rollout.Trajectory) as readable text: its messages, turns, and the tokens trained."""
    lines = [f"=== env={traj.env} seed={traj.seed} group={traj.group_id} reward={traj.reward:.2f} "
             f"success={traj.success} actions={traj.num_actions} valid={traj.valid_actions} "
             f"effective={traj.effective_actions}"]
    for m in traj.messages:
        lines.append(f"--- {m['role']}\n{m['content'].rstrip()}")
    for k, t in enumerate(traj.turns, 1):
        lines.append(f"[turn {k}] actions={t.actions} format_ok={t.format_ok} reward={t.reward:.2f}")
    if tokenizer is not None and traj.segments:
        s = traj.segments[-1]
        trained = tokenizer.decode([i for i, m in zip(s.input_ids, s.loss_mask) if m],
                                   skip_special_tokens=False)
        lines.append(f"--- trained tokens of the last segment:\n{trained}")
    return "\n".join(lines) + "\n"
