"""Tests for the course (course/): the grader passes the reference code and fails plausible student mistakes
(shortcuts into code that restates a unit among them); course/make.py hands out a copy that holds none of the
answers, stops a command at a stub before it writes anything, and hands out the spec-only variant;
course/submit.py packs a submission.

    python -m pytest -q tests/test_course.py      (about 45 s on a 2-core CPU)

Each mistake is a mutated copy of a reference function, swapped into its module as a student's file would
be (the grader looks functions up at call time). This file is an answer key: make.py leaves it out.
"""
import ast
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import advantages  # noqa: E402
import envs  # noqa: E402
import filter as variance_filter  # noqa: E402
import monitor  # noqa: E402
import rollout  # noqa: E402
import starpo  # noqa: E402
from engine.rooms import DIRS  # noqa: E402
from extras import filter_rules, gigpo, gspo, turn_credit  # noqa: E402


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"course_{name}", ROOT / "course" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grade, make, units = load("grade"), load("make"), load("units")
REF = {name: getattr(mod, name) for mod, names in [
    (advantages, ["grpo_advantages", "gae"]), (starpo, ["policy_loss", "aggregate", "kl_penalty"]),
    (rollout, ["parse_reply"]), (variance_filter, ["select_groups"]), (envs, ["_push", "sokoban_bfs"])]
    for name in names}


@pytest.mark.parametrize("n", units.GRADED)
def test_the_reference_passes_every_unit(n):
    result = grade.grade_unit(n)
    assert result["status"] == "pass" and result["passed"] == result["total"] >= 10, result["line"]
    assert result["points"] == result["max_points"] > 0 and f"({result['points']:g}/" in result["line"]


# ---- unit 1: envs.py

def push_into_wall(floor, player, boxes, off):  # forgets the wall behind the box
    q = player + off
    if not floor[q] or (q in boxes and q + off in boxes):
        return player, boxes
    return q, (tuple(sorted(q + off if b == q else b for b in boxes)) if q in boxes else boxes)


def push_through_box(floor, player, boxes, off):  # forgets the box behind the box
    q = player + off
    if not floor[q] or (q in boxes and not floor[q + off]):
        return player, boxes
    return q, (tuple(sorted(q + off if b == q else b for b in boxes)) if q in boxes else boxes)


def push_unsorted(floor, player, boxes, off):  # boxes in the order they came: states no longer compare equal
    q = player + off
    if not floor[q] or (q in boxes and (not floor[q + off] or q + off in boxes)):
        return player, boxes
    return q, (tuple(q + off if b == q else b for b in boxes) if q in boxes else boxes)


def push_fresh_tuple(floor, player, boxes, off):  # an equal tuple where nothing moved, not the one given
    p, b = REF["_push"](floor, player, boxes, off)
    return p, tuple(sorted(b))


def push_fresh_on_a_step(floor, player, boxes, off):  # the same object only where the player is blocked
    p, b = REF["_push"](floor, player, boxes, off)
    return p, (tuple(sorted(b)) if p != player and b is boxes else b)


def search(floor, width, targets, player, boxes, depth_first):
    if all(b in targets for b in boxes):
        return []
    offsets = [dr * width + dc for dr, dc in DIRS]
    start = (player, boxes)
    parent, todo = {start: None}, [start]
    while todo:
        state = todo.pop() if depth_first else todo.pop(0)
        for a, off in enumerate(offsets):
            child = envs._push(floor, *state, off)
            if child in parent:
                continue
            parent[child] = (state, a)
            if all(b in targets for b in child[1]):
                plan = []
                while parent[child] is not None:
                    child, a = parent[child]
                    plan.append(a)
                return plan[::-1]
            todo.append(child)
    return None


def bfs_depth_first(floor, width, targets, player, boxes):  # a plan, not the shortest
    return search(floor, width, targets, player, boxes, depth_first=True)


def bfs_empty_when_stuck(floor, width, targets, player, boxes):  # [] where no plan exists
    plan = search(floor, width, targets, player, boxes, depth_first=False)
    return [] if plan is None else plan


def bfs_one_short(floor, width, targets, player, boxes):  # drops the last move of the plan
    plan = search(floor, width, targets, player, boxes, depth_first=False)
    return plan[:-1] if plan else plan


def apply_reward_without_step_cost(self, a):
    before, moved_from = self._on_target(), self._player
    self._player, self._boxes = self._move(self._player, self._boxes, a)
    after = self._on_target()
    self.done = success = after == len(self._boxes)
    reward = (1.0 if after > before else -1.0 if after < before else 0.0) + 10.0 * success
    return self._render(), reward, success, {"success": success, "action_is_valid": True,
                                             "action_is_effective": self._player != moved_from}


def apply_no_penalty_off_target(self, a):
    before, moved_from = self._on_target(), self._player
    self._player, self._boxes = self._move(self._player, self._boxes, a)
    after = self._on_target()
    self.done = success = after == len(self._boxes)
    reward = -0.1 + (1.0 if after > before else 0.0) + 10.0 * success
    return self._render(), reward, success, {"success": success, "action_is_valid": True,
                                             "action_is_effective": self._player != moved_from}


def apply_never_done(self, a):
    before, moved_from = self._on_target(), self._player
    self._player, self._boxes = self._move(self._player, self._boxes, a)
    after = self._on_target()
    success = after == len(self._boxes)
    reward = -0.1 + (1.0 if after > before else -1.0 if after < before else 0.0) + 10.0 * success
    return self._render(), reward, False, {"success": success, "action_is_valid": True,
                                           "action_is_effective": self._player != moved_from}


# ---- unit 2: rollout.py

def parse_without_close(text, think, max_actions):  # accepts a reply without </answer>
    if think:
        start = text.find("<think>")
        junction = rollout.JUNCTION_RE.search(text, start + len("<think>")) if start >= 0 else None
        begin = junction.end() if junction is not None else -1
    else:
        begin = text.find("<answer>")
        begin = begin + len("<answer>") if begin >= 0 else -1
    if begin < 0:
        return [], False
    end = text.find("</answer>", begin)
    end = len(text) if end < 0 else end
    actions = [a.strip() for a in text[begin:end].split("||") if a.strip()]
    return actions[:max_actions], True


def parse_any_junction(text, think, max_actions):  # text between </think> and <answer> allowed
    if think:
        start = text.find("<think>")
        close = text.find("</think>", start) if start >= 0 else -1
        begin = text.find("<answer>", close) if close >= 0 else -1
    else:
        begin = text.find("<answer>")
    begin = begin + len("<answer>") if begin >= 0 else -1
    end = text.find("</answer>", begin) if begin >= 0 else -1
    if end < 0:
        return [], False
    actions = [a.strip() for a in text[begin:end].split("||") if a.strip()]
    return actions[:max_actions], True


def parse_no_budget(text, think, max_actions):  # keeps every action
    return REF["parse_reply"](text, think, 10 ** 6)


def mask_template_tokens(seg, response_mask=True):  # env and template tokens left in the loss mask
    return [0] * seg.system_len + [1] * (len(seg.input_ids) - seg.system_len)


def append_end_off_by_one(self, ids, sampled, logp=None):
    self.input_ids += ids
    self.loss_mask += [sampled] * len(ids)
    self.logp += list(logp) if logp is not None else [math.nan] * len(ids)
    if sampled and ids:
        self.reply_ends.append(len(self.input_ids))


def append_masks_everything(self, ids, sampled, logp=None):  # env tokens in the mask
    self.input_ids += ids
    self.loss_mask += [1] * len(ids)
    self.logp += list(logp) if logp is not None else [math.nan] * len(ids)
    if sampled and ids:
        self.reply_ends.append(len(self.input_ids) - 1)


def append_end_of_empty_reply(self, ids, sampled, logp=None):
    self.input_ids += ids
    self.loss_mask += [sampled] * len(ids)
    self.logp += list(logp) if logp is not None else [math.nan] * len(ids)
    if sampled:
        self.reply_ends.append(len(self.input_ids) - 1)


# ---- unit 3: advantages.py

def gae_variant(token_rewards, values, mask, gamma=1.0, lam=1.0, mistake=""):  # never under torch.no_grad
    sampled = mask > 0
    if bool(((token_rewards != 0) & ~sampled).any()):
        raise ValueError("token_rewards has non-zero entries outside mask")
    rewards, vals = token_rewards.float(), values.float()
    B, T = mask.shape
    next_value, running, adv = torch.zeros(B), torch.zeros(B), torch.zeros(B, T)
    for t in reversed(range(T)):
        if mistake == "discount":
            delta = rewards[:, t] + next_value - vals[:, t]
        else:
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + (gamma if mistake == "lam" else gamma * lam) * running
        on = sampled[:, t] if mistake != "chain" else torch.ones(B, dtype=torch.bool)
        running = torch.where(on, adv_t, running)
        next_value = torch.where(on, vals[:, t], next_value)
        adv[:, t] = torch.where(sampled[:, t], adv_t, 0.0)
    return adv, adv + vals


def grpo_variant(scores, group_ids, eps=1e-6, norm_by_std=True, mistake=""):
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    s = scores.float()
    out = torch.zeros_like(s)
    for g in set(ids):
        rows = [i for i, x in enumerate(ids) if x == g]
        x = s[rows]
        mean = s.mean() if mistake == "global mean" else x.mean()
        a = x - mean
        if norm_by_std and mistake != "no std" and len(rows) > 1:
            a = a / (x.std(unbiased=mistake != "biased std") + eps)
        out[rows] = a if len(rows) > 1 else 0.0
    return out


# ---- unit 4: starpo.py

def loss_variant(logp, old_logp, advantages_, mask, clip_low=0.2, clip_high=0.28, agg="token-mean",
                 denom=None, dual_clip=None, mistake=""):  # mistake "": advantages not detached
    m = mask > 0
    adv = torch.where(m, advantages_.float(), 0.0)
    old = torch.where(m, old_logp.float(), logp.detach().float())
    if mistake == "no mask":  # padding left to the aggregation's mask
        adv, old = advantages_.float(), old_logp.float()
    log_ratio = (logp.float() - old).clamp(-starpo.LOG_RATIO_CLAMP, starpo.LOG_RATIO_CLAMP)
    if mistake == "bf16":  # the ratio in the inputs' dtype
        log_ratio = (logp - torch.where(m, old_logp, logp.detach())).clamp(-20, 20)
    if mistake == "inverted ratio":
        log_ratio = -log_ratio
    ratio = torch.exp(log_ratio)
    high = clip_low if mistake == "symmetric" else clip_high
    low = clip_high if mistake == "high both sides" else clip_low
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss_tok = torch.minimum(unclipped, clipped) if mistake == "min" else torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(m)
    if dual_clip:
        dual = (adv < 0) & (loss_tok > -adv * dual_clip)  # before the cap
        loss_tok = torch.where(adv < 0, torch.minimum(-adv * dual_clip, loss_tok), loss_tok)
    metrics = {
        "pg_clipfrac": starpo.masked_mean((clipped > unclipped).float(), mask),
        "pg_clipfrac_upper": starpo.masked_mean(((adv > 0) & (ratio > 1.0 + high)).float(), mask),
        "pg_clipfrac_lower": starpo.masked_mean(((adv < 0) & (ratio < 1.0 - low)).float(), mask),
        "pg_clipfrac_dual": starpo.masked_mean(dual.float(), mask),
        "approx_kl": starpo.masked_mean(-log_ratio.detach(), mask),
    }
    return starpo.aggregate(loss_tok, mask, agg, denom), metrics


def aggregate_seq_mean(loss_tok, mask, agg="token-mean", denom=None):  # a sequence mean for the token mean
    return REF["aggregate"](loss_tok, mask, "seq-mean-token-mean" if agg == "token-mean" else agg, denom)


def aggregate_times_mask(loss_tok, mask, agg="token-mean", denom=None):  # padding's inf becomes NaN
    masked, m = loss_tok * mask, mask.float()
    if agg == "token-mean":
        total, count = masked.sum(), m.sum()
    else:
        row = masked.sum(dim=1) / (m.sum(dim=1).clamp(min=1) if agg == "seq-mean-token-mean" else 1)
        total, count = row.sum(), (m.sum(dim=1) > 0).sum()
    return total / (count.clamp(min=1) if denom is None else denom)


def kl_swapped(logp, ref_logp, kind="k3"):  # k3 on the wrong side: KL(pi_ref || pi)
    return REF["kl_penalty"](logp, ref_logp, "k1") if kind == "k1" else \
        REF["kl_penalty"](ref_logp, logp, "k3")


def kl_k3_unclamped(logp, ref_logp, kind="k3"):
    if kind == "k1":
        return logp.float() - ref_logp.float()
    log_r = ref_logp.float() - logp.float()
    return torch.exp(log_r) - log_r - 1.0


def kl_in_bf16(logp, ref_logp, kind="k3"):  # k3 in the inputs' dtype: a bf16 result
    if kind == "k1":
        return logp.float() - ref_logp.float()
    log_r = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10, 10)


def kl_in_bf16_then_float(logp, ref_logp, kind="k3"):  # float32 out, bf16's lost digits inside
    return kl_in_bf16(logp, ref_logp, kind).float()


# ---- unit 5: filter.py

def select_variant(group_rewards, keep=0.25, largest=True, mistake=""):
    variance_filter.check_groups(group_rewards)
    if not 0 < keep <= 1:
        raise ValueError(f"keep must lie in (0, 1], got {keep}")
    G = group_rewards.shape[0]
    std = group_rewards.float().std(dim=1, unbiased=mistake != "biased std")
    score = group_rewards.float().mean(dim=1) if mistake == "mean" else std
    order = torch.sort(score, descending=largest if mistake != "lowest" else False, stable=True).indices
    k = round(keep * G) if mistake == "round" else int(keep * G)
    keep_mask = torch.zeros(G, dtype=torch.bool)
    keep_mask[order[:k if mistake == "no minimum" else max(1, min(k, G))]] = True
    return keep_mask, variance_filter.group_stats(std, keep_mask, std)


# ---- unit 6: monitor.py

def echo_variant(mon, m, baseline_iters=5, smooth=5, std_ratio=0.25, patience=3, grad_factor=7.0,
                 ent_band=(0.1, 5.0), window=20, mistake=""):
    warnings = {}
    std, success = m.get("rollout/in_group_std"), m.get("rollout/success")
    if std is not None:
        mon.std_history.append(std)
        mon.success_history.append(success if success is not None else 0.0)
        if len(mon.std_history) > baseline_iters:
            base = statistics.fmean(mon.std_history[:baseline_iters])
            improving = statistics.fmean(mon.success_history[-smooth:]) > statistics.fmean(
                mon.success_history[:baseline_iters]) and mistake != "no success guard"
            recent = mon.std_history[-1:] if mistake == "last std" else mon.std_history[-smooth:]
            now = statistics.fmean(recent)
            mon.low_std_run = mon.low_std_run + 1 if now < std_ratio * base and not improving else 0
            if mon.low_std_run >= (1 if mistake == "no patience" else patience):
                warnings["std_collapse"] = f"reward std {now:.4f}"
    g = m.get("train/grad_norm")
    if g is not None and math.isfinite(g):
        past = mon.grad_history if mistake == "whole history" else mon.grad_history[-window:]
        level = (statistics.fmean if mistake == "mean" else statistics.median)(past) if past else 0.0
        if len(past) >= 5 and g > grad_factor * level:
            warnings["grad_spike"] = f"grad norm {g:.3g}"
        mon.grad_history.append(g)
    e = m.get("train/entropy")
    if e is not None and math.isfinite(e):
        mon.ent_history.append(e)
        if len(mon.ent_history) > baseline_iters:
            base = statistics.fmean(mon.ent_history[:baseline_iters])
            now = statistics.fmean(mon.ent_history[-smooth:])
            low = 0.0 if mistake == "rise only" else ent_band[0] * base
            if not low <= now <= ent_band[1] * base:
                warnings["entropy_swing"] = f"entropy {now:.3g}"
    mi = m.get("collapse/mi")
    if mi is not None and math.isfinite(mi):
        from extras.collapse import mi_check
        warning = mi_check(mon, mi)
        if warning:
            warnings["mi_collapse"] = warning
    return warnings


# ---- shortcuts: a unit's function that calls code restating it, beyond the unit files

def select_by_rule(group_rewards, keep=0.25, largest=True):  # extras/filter_rules.py with its defaults
    return filter_rules.select_groups_by_rule(group_rewards, keep, largest)


def gae_by_bi_level(token_rewards, values, mask, gamma=1.0, lam=1.0):  # bi-level GAE with one turn end
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).amax(dim=1, keepdim=True)
    return turn_credit.bi_level_gae(token_rewards, values, mask, (positions == last) & (mask > 0), gamma, lam)


def loss_by_gspo(logp, old_logp, advantages_, mask, clip_low=0.2, clip_high=0.28, agg="token-mean",
                 denom=None, dual_clip=None):  # GSPO with one token per row: each ratio is the token's
    rows = [x.reshape(-1, 1) for x in (logp, old_logp, advantages_, mask)]
    return gspo.sequence_policy_loss(*rows, clip_low, clip_high, "token-mean", denom, dual_clip)


def grpo_by_gigpo(scores, group_ids, eps=1e-6, norm_by_std=True):  # GiGPO's step normalisation
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    out = gigpo._step_normalise(scores.float().tolist(), ids, "mean_std_norm" if norm_by_std else "mean_norm",
                                eps)
    return torch.tensor(out, dtype=torch.float32)


def grpo_by_test_loop(scores, group_ids, eps=1e-6, norm_by_std=True):  # a test file's slow loop
    from test_gigpo import slow_gigpo
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    episode, _ = slow_gigpo(scores.float().tolist(), ids, [[] for _ in ids], [[] for _ in ids], 1.0, 1.0,
                            "mean_std_norm" if norm_by_std else "mean_norm", eps)
    return torch.tensor(episode, dtype=torch.float32)


def select_by_snapshot(group_rewards, keep=0.25, largest=True):  # reads the grader's recorded answers
    json.loads((ROOT / "course" / "snapshots" / "unit5-filter.json").read_text())
    return REF["select_groups"](group_rewards, keep, largest)


def variant(fn, mistake):
    return lambda *a, **kw: fn(*a, **kw, mistake=mistake)


MUTATIONS = [  # (unit, owner, attribute, the mistake, what it is)
    (1, envs, "_push", push_into_wall, "a push moves a box into a wall"),
    (1, envs, "_push", push_through_box, "a push moves a box into another box"),
    (1, envs, "_push", push_unsorted, "boxes not kept sorted"),
    (1, envs, "_push", push_fresh_tuple, "an equal tuple, not the one given, where nothing moved"),
    (1, envs, "_push", push_fresh_on_a_step, "an equal tuple where the player steps and pushes nothing"),
    (1, envs, "sokoban_bfs", bfs_depth_first, "depth-first: a plan, not the shortest"),
    (1, envs, "sokoban_bfs", bfs_empty_when_stuck, "[] instead of None where no plan exists"),
    (1, envs, "sokoban_bfs", bfs_one_short, "the plan one move short"),
    (1, envs.SokobanEnv, "_apply", apply_reward_without_step_cost, "no -0.1 a step"),
    (1, envs.SokobanEnv, "_apply", apply_no_penalty_off_target, "no -1 for a box off a target"),
    (1, envs.SokobanEnv, "_apply", apply_never_done, "never done"),
    (2, rollout, "parse_reply", parse_without_close, "a reply without </answer> accepted"),
    (2, rollout, "parse_reply", parse_any_junction, "text between </think> and <answer> accepted"),
    (2, rollout, "parse_reply", parse_no_budget, "max_actions ignored"),
    (2, rollout, "trained_mask", mask_template_tokens, "env and template tokens in the loss mask"),
    (2, rollout.Segment, "append", append_end_off_by_one, "an off-by-one reply end"),
    (2, rollout.Segment, "append", append_masks_everything, "env tokens in the loss mask"),
    (2, rollout.Segment, "append", append_end_of_empty_reply, "a reply end for an empty reply"),
    (3, advantages, "gae", variant(gae_variant, "discount"), "GAE: no gamma on the next value"),
    (3, advantages, "gae", variant(gae_variant, "lam"), "GAE ignoring lam"),
    (3, advantages, "gae", variant(gae_variant, "chain"), "GAE's chain through tokens off the mask"),
    (3, advantages, "gae", variant(gae_variant, ""), "GAE's advantages keep a gradient (no torch.no_grad)"),
    (3, advantages, "grpo_advantages", variant(grpo_variant, "no std"), "GRPO without the std"),
    (3, advantages, "grpo_advantages", variant(grpo_variant, "biased std"), "GRPO with the biased std"),
    (3, advantages, "grpo_advantages", variant(grpo_variant, "global mean"), "GRPO with the batch mean"),
    (4, starpo, "policy_loss", variant(loss_variant, "symmetric"), "a symmetric clip ignoring clip_high"),
    (4, starpo, "policy_loss", variant(loss_variant, "min"), "min where PPO takes the max"),
    (4, starpo, "policy_loss", variant(loss_variant, "inverted ratio"), "the ratio upside down"),
    (4, starpo, "policy_loss", variant(loss_variant, "high both sides"), "clip_high used for both bounds"),
    (4, starpo, "policy_loss", variant(loss_variant, "no mask"), "padding left to the aggregation's mask"),
    (4, starpo, "policy_loss", variant(loss_variant, "bf16"), "the ratio computed in bf16"),
    (4, starpo, "policy_loss", variant(loss_variant, ""), "the advantages not detached"),
    (4, starpo, "kl_penalty", kl_swapped, "k3 with logp and ref_logp swapped"),
    (4, starpo, "kl_penalty", kl_k3_unclamped, "k3 without its clamps"),
    (4, starpo, "kl_penalty", kl_in_bf16, "k3 in bf16: a bf16 result"),
    (4, starpo, "kl_penalty", kl_in_bf16_then_float, "k3 in bf16, then float32"),
    (4, starpo, "aggregate", aggregate_seq_mean, "a sequence mean where the token mean belongs"),
    (4, starpo, "aggregate", aggregate_times_mask, "the mask multiplied in (inf * 0 = NaN)"),
    (5, variance_filter, "select_groups", variant(select_variant, "mean"), "ranking by mean, not std"),
    (5, variance_filter, "select_groups", variant(select_variant, "lowest"), "keeping the lowest-std groups"),
    (5, variance_filter, "select_groups", variant(select_variant, "round"), "round(keep * G), not int"),
    (5, variance_filter, "select_groups", variant(select_variant, "no minimum"), "none kept at a small keep"),
    (5, variance_filter, "select_groups", variant(select_variant, "biased std"), "the biased std"),
    (6, monitor, "echo_check", variant(echo_variant, "no success guard"), "a converging std warned"),
    (6, monitor, "echo_check", variant(echo_variant, "last std"), "the last std, not the mean of 5"),
    (6, monitor, "echo_check", variant(echo_variant, "no patience"), "the std warning without patience"),
    (6, monitor, "echo_check", variant(echo_variant, "mean"), "a spike against the mean, not the median"),
    (6, monitor, "echo_check", variant(echo_variant, "whole history"), "every grad norm, not the last 20"),
    (6, monitor, "echo_check", variant(echo_variant, "rise only"), "an entropy that falls never warns"),
]
SHORTCUTS = [  # (unit, owner, attribute, the shortcut, the file it reaches)
    (5, variance_filter, "select_groups", select_by_rule, "extras/filter_rules.py"),
    (3, advantages, "gae", gae_by_bi_level, "extras/turn_credit.py"),
    (4, starpo, "policy_loss", loss_by_gspo, "extras/gspo.py"),
    (3, advantages, "grpo_advantages", grpo_by_gigpo, "extras/gigpo.py"),
    (3, advantages, "grpo_advantages", grpo_by_test_loop, "tests/test_gigpo.py"),
    (5, variance_filter, "select_groups", select_by_snapshot, "opened a file"),
]


@pytest.mark.parametrize("n, owner, name, mistake, what", MUTATIONS, ids=[m[4] for m in MUTATIONS])
def test_the_grader_fails_each_mistake(n, owner, name, mistake, what, monkeypatch):
    if what == "the advantages not detached" and not grade.load_snapshot(units.BY_NUMBER[4])["pl_constants"]:
        pytest.xfail("starpo.policy_loss lets a gradient reach its advantages: detach them there, then "
                     "`python course/grade.py --record 4` makes the grader check it")
    monkeypatch.setattr(owner, name, mistake)
    result = grade.grade_unit(n)
    assert result["status"] == "fail", f"{what}: {result['line']}"
    assert result["line"].startswith(f"unit {n} ") and " FAIL " in result["line"], result["line"]
    assert name.lstrip("_") in result["failures"][0], result["failures"][0]  # it names the function
    assert "out of reach" not in " ".join(result["failures"]), result["failures"]  # a mistake, not a shortcut


def test_every_unit_has_three_mistakes():
    assert all(sum(m[0] == n for m in MUTATIONS) >= 3 for n in units.GRADED)


@pytest.mark.parametrize("n, owner, name, shortcut, reached", SHORTCUTS,
                         ids=[s[3].__name__ for s in SHORTCUTS])
def test_a_unit_that_calls_code_restating_it_fails(n, owner, name, shortcut, reached, monkeypatch):
    """Issue 59.1: select_groups delegating to extras/filter_rules.py passed unit 5, a wrapper around
    bi_level_gae passed every gae check. The grader names what the function reached (read with ast, or
    watched while it ran) in every failing check."""
    monkeypatch.setattr(owner, name, shortcut)
    result = grade.grade_unit(n)
    assert result["status"] == "fail", result["line"]
    mine = [f for f in result["failures"] if f.startswith(name.lstrip("_"))]
    assert mine and all("out of reach" in f and reached in f for f in mine), mine[:2]


def test_an_exception_names_the_case_and_the_students_line(monkeypatch):
    def gae_raises(token_rewards, values, mask, gamma=1.0, lam=1.0):
        rows = mask.shape[0]
        return values[rows + 3], values  # IndexError, on this line
    line = gae_raises.__code__.co_firstlineno + 2
    monkeypatch.setattr(advantages, "gae", gae_raises)
    failure = grade.grade_unit(3)["failures"][0]
    assert failure.startswith("gae (one turn, values 0) raised IndexError at test_course.py:") and \
        f"test_course.py:{line} `return values[rows + 3], values" in failure, failure


def test_the_clip_message_reads_the_students_own_bounds(monkeypatch):
    """Issue 59.4: the message said [0.8, 1.2] where the student's loss clipped to [0.72, 1.28]."""
    monkeypatch.setattr(starpo, "policy_loss", variant(loss_variant, "high both sides"))
    failure = grade.grade_unit(4)["failures"][0]
    assert "Clip-Higher" in failure and "your loss clips the ratio to [0.72, 1.28]" in failure and \
        "= [0.8, 1.28]" in failure, failure


def test_verbose_shows_the_inputs_of_a_failing_case(monkeypatch):
    monkeypatch.setattr(advantages, "gae", variant(gae_variant, "discount"))
    assert "inputs:" not in grade.grade_unit(3)["failures"][0]
    monkeypatch.setattr(grade, "VERBOSE", True)
    failure = next(f for f in grade.grade_unit(3)["failures"] if "discount" in f)
    assert "; inputs: row " in failure and " rewards [" in failure and " mask [" in failure, failure
    monkeypatch.setattr(starpo, "aggregate", aggregate_seq_mean)
    failure = grade.grade_unit(4)["failures"][0]
    assert failure.startswith("aggregate") and "inputs: loss_tok [[" in failure, failure


def test_a_stub_reads_not_implemented_and_names_the_function(monkeypatch):
    def stub(*args, **kwargs):
        raise NotImplementedError("unit 3 (advantages): implement gae -- see course/unit3-advantages.md")
    monkeypatch.setattr(advantages, "gae", stub)
    result = grade.grade_unit(3)
    assert result["status"] == "not implemented" and result["missing"] == ["gae"]
    assert result["line"].startswith("unit 3 advantages: not implemented -- implement gae "
                                     "(course/unit3-advantages.md); the rest: pass"), result["line"]
    # the stub's checks count, unpassed: the points are grpo_advantages' share only
    assert 0 < result["points"] < result["max_points"]
    assert f"({result['points']:g}/15 points)" in result["line"]


# ---- make.py: the student copy

def body_statements(src: str, fn) -> tuple[str, list[str]]:
    """A function's body after its docstring: its lines as written, and each statement's source."""
    doc = isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0], "value", None), ast.Constant)
    body = fn.body[doc:]
    lines = "".join(src.splitlines(keepends=True)[body[0].lineno - 1:fn.end_lineno])
    return lines, [ast.get_source_segment(src, s) for s in body]


def make_copy(out: Path, *flags: str) -> Path:
    p = subprocess.run([sys.executable, str(ROOT / "course" / "make.py"), str(out), *flags],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    return make_copy(tmp_path_factory.mktemp("course") / "student")


@pytest.fixture(scope="module")
def solved(tmp_path_factory) -> Path:
    """A student copy with the reference's unit files pasted back: a correct solution."""
    out = make_copy(tmp_path_factory.mktemp("course") / "solved")
    for unit in units.UNITS:
        if not unit.get("lab"):
            shutil.copy2(ROOT / unit["file"], out / unit["file"])
    return out


def test_the_copy_holds_no_reference_body(student):
    texts = {}
    for path in student.rglob("*"):
        try:
            texts[path] = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    assert not (student / "tests" / "test_course.py").exists() and not (student / "runs").exists()
    assert not any((student / n).exists() for n in make.INSTRUCTOR_ONLY)  # the answer key, make.py's lists
    for unit in make.UNITS:
        for func in unit.get("funcs", []):
            src = (ROOT / unit["file"]).read_text()
            body, stmts = body_statements(src, make.find_function(ast.parse(src), func))
            stubbed = make.find_function(ast.parse((student / unit["file"]).read_text()), func)
            assert isinstance(stubbed.body[-1], ast.Raise) and len(stubbed.body) <= 2, func
            for path, text in texts.items():
                assert body not in text, (func, path)
                shared = make.SHARED.get(path.relative_to(student).as_posix(), set())
                leaked = [s for s in stmts if len(s) >= 30 and s not in shared and s in text]
                assert not leaked, (func, path, leaked)


def run_in(copy: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=copy, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_the_copy_grades_not_implemented_and_a_command_stops_before_it_writes(student):
    """Issue 59.2: train.py stopped at a stub after making runs/bandit-grpo-s0, so the next try said "a run
    is already there". Now each entry script checks the units its command needs first: one line, nothing
    written; the unit it names is the first the command needs (Sokoban's unit 1 only on Sokoban)."""
    p = run_in(student, "course/grade.py", timeout=120)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 1 and len(lines) == len(units.GRADED) + 1, p.stdout + p.stderr
    assert all(f"unit {n} " in lines[n - 1] and ": not implemented -- implement " in lines[n - 1]
               for n in units.GRADED), p.stdout
    assert lines[-1].startswith("total: 0/6 units pass, 0/75 points"), lines[-1]
    for args, unit in [
            (["train.py", "--env", "bandit", "--steps", "1"], "unit 2 (rollout): implement parse_reply"),
            (["train.py", "--steps", "1"], "unit 1 (envs): implement _push"),
            (["eval.py", "--env", "frozenlake", "--prompts", "2"], "unit 2 (rollout): implement"),
            (["sft_baseline.py", "--env", "sokoban"], "unit 1 (envs): implement _push")]:
        p = run_in(student, *args)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr[-2000:]
        assert p.stderr.startswith(f"{args[0]}: error: {unit}"), (args, p.stderr)
        assert not (student / "runs").exists(), args
    assert run_in(student, "train.py", "--help").returncode == 0  # help is never stopped


def test_a_correct_copy_passes_its_grader_and_trains(solved):
    p = run_in(solved, "course/grade.py", timeout=120)
    assert p.returncode == 0 and "total: 6/6 units pass, 75/75 points" in p.stdout, p.stdout + p.stderr
    p = run_in(solved, "train.py", "--env", "bandit", "--steps", "1", "--eval-prompts", "4", "--prompts", "2",
               "--rollouts", "4", "--out", "runs/one")
    assert p.returncode == 0 and (solved / "runs" / "one" / "final").is_dir(), p.stderr[-2000:]


def test_a_shortcut_in_the_copy_fails_its_unit(student, tmp_path):
    """Issue 59.1, in a student copy: select_groups written as a call into extras/filter_rules.py fails unit
    5 (read with ast), and gae through a helper that calls bi_level_gae fails unit 3 (watched as it runs)."""
    copy = make_copy(tmp_path / "copy")
    unit5, unit3 = units.BY_NUMBER[5], units.BY_NUMBER[3]
    stub = f'raise NotImplementedError("{units.stub_message(unit5, "select_groups")}")'
    text = (copy / "filter.py").read_text()
    shortcut = ("from extras.filter_rules import select_groups_by_rule\n"
                "    return select_groups_by_rule(group_rewards, keep, largest)")
    (copy / "filter.py").write_text(text.replace(stub, shortcut))
    stub = f'raise NotImplementedError("{units.stub_message(unit3, "gae")}")'
    text = (copy / "advantages.py").read_text()
    text = text.replace(stub, "return _mine(token_rewards, values, mask, gamma, lam)")
    (copy / "advantages.py").write_text(text + textwrap_helper())
    p = run_in(copy, "course/grade.py", "3", "5", timeout=120)
    lines = p.stdout.splitlines()
    assert "gae (one turn, values 0) called bi_level_gae (extras/turn_credit.py" in lines[0], lines[0]
    assert lines[1].startswith("unit 5 filter: FAIL 0/12 (0/5 points) -- select_groups names "
                               "select_groups_by_rule (extras/filter_rules.py"), lines[1]


def textwrap_helper() -> str:
    return ("\n\ndef _mine(r, v, m, gamma, lam):\n"
            "    mod = __import__('extras.turn_credit', fromlist=['x'])\n"
            "    pos = torch.arange(m.shape[1]).expand_as(m)\n"
            "    ends = (pos == torch.where(m > 0, pos, -1).amax(dim=1, keepdim=True)) & (m > 0)\n"
            "    return getattr(mod, 'bi_' + 'level_gae')(r, v, m, ends, gamma, lam)\n")


def test_the_spec_only_copy_keeps_the_specs_and_drops_the_hints(student, tmp_path):
    """Issue 59.7: `make.py OUT --spec-only` hands out each handout without what lies between its hint
    markers; the plain copy keeps the hints and drops only the markers. The grader is the same."""
    spec = make_copy(tmp_path / "spec", "--spec-only")
    for unit in units.UNITS:
        name = units.handout(unit)
        source, plain, bare = ((d / name).read_text() for d in (ROOT, student, spec))
        assert make.HINT not in plain and make.END_HINT not in plain and make.HINT not in bare, name
        if unit.get("lab"):
            assert plain == bare == source, name
            continue
        assert source.count(make.HINT) == source.count(make.END_HINT) >= 1, name
        assert len(bare) < len(plain) < len(source), name
    unit5 = (spec / "course" / "unit5-filter.md").read_text()
    assert "torch.sort" not in unit5 and "max(1, int(keep * G))" in unit5  # the hint gone, the contract kept
    assert "spec-only" in (spec / "course" / "STUDENT_COPY").read_text()
    assert (spec / "course" / "grade.py").read_text() == (student / "course" / "grade.py").read_text()


def test_submit_packs_the_units_answers_and_plots_but_no_runs(solved, tmp_path):
    (solved / "echo_trap.png").write_bytes(b"\x89PNG not really")
    (solved / "runs" / "x").mkdir(parents=True, exist_ok=True)
    (solved / "runs" / "x" / "metrics.jsonl").write_text("{}\n")
    (solved / "models").mkdir(exist_ok=True)
    out = tmp_path / "me.zip"
    p = run_in(solved, "course/submit.py", "--out", str(out), timeout=120)
    assert p.returncode == 0 and "wrote " in p.stdout and "75/75 points" in p.stdout, p.stdout + p.stderr
    assert "still has 15 unanswered questions" in p.stdout, p.stdout  # the template untouched
    names = set(zipfile.ZipFile(out).namelist())
    assert names == {"grade.json", "MANIFEST.txt", "envs.py", "rollout.py", "advantages.py", "starpo.py",
                     "filter.py", "monitor.py", "course/lab-answers.md", "echo_trap.png"}, names
    graded = json.loads(zipfile.ZipFile(out).read("grade.json"))
    assert graded["passed"] == 6 and graded["points"] == 75 and len(graded["units"]) == 6
    assert zipfile.ZipFile(out).read("starpo.py") == (ROOT / "starpo.py").read_bytes()
    p = run_in(solved, "course/submit.py", "--out", str(out), timeout=60)
    assert p.returncode == 2 and "exists" in p.stderr and p.stderr.count("\n") == 1


def test_a_command_needs_the_units_it_runs_on(tmp_path):
    assert units.needed_units("train.py", ["--env", "bandit"]) == [2, 3, 4, 5, 6]
    assert units.needed_units("train.py", []) == [1, 2, 3, 4, 5, 6]  # the default env is Sokoban
    assert units.needed_units("eval.py", ["--envs", "bandit,sokoban-large"]) == [1, 2]
    assert units.needed_units("sft_baseline.py", ["--env=frozenlake"]) == [2]
    (tmp_path / "config.json").write_text(json.dumps({"env": "bandit"}))
    assert units.needed_units("train.py", ["--resume", str(tmp_path)]) == [2, 3, 4, 5, 6]
    assert units.stubs(units.BY_NUMBER[3]) == []  # the reference: nothing to write


def test_make_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "x.txt").write_text("mine")
    p = subprocess.run([sys.executable, str(ROOT / "course" / "make.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not an empty folder" in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["x.txt"]
