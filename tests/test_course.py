"""Tests for the course (course/): the grader passes the reference code and fails plausible student mistakes;
course/make.py hands out a copy that holds none of the answers and stops with one line naming a unit.

    python -m pytest -q tests/test_course.py      (about 15 s on a 2-core CPU)

Each mistake is a mutated copy of a reference function, swapped into its module as a student's file would
be (the grader looks functions up at call time). This file is an answer key: make.py leaves it out.
"""
import ast
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import advantages  # noqa: E402
import envs  # noqa: E402
import filter as variance_filter  # noqa: E402
import rollout  # noqa: E402
import starpo  # noqa: E402
from engine.rooms import DIRS  # noqa: E402


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"course_{name}", ROOT / "course" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grade, make = load("grade"), load("make")
REF = {name: getattr(mod, name) for mod, names in [
    (advantages, ["grpo_advantages", "gae"]), (starpo, ["policy_loss", "aggregate", "kl_penalty"]),
    (rollout, ["parse_reply"]), (variance_filter, ["select_groups"]), (envs, ["_push", "sokoban_bfs"])]
    for name in names}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_reference_passes_every_unit(n):
    result = grade.grade_unit(n)
    assert result["status"] == "pass" and result["passed"] == result["total"] >= 10, result["line"]


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

def gae_variant(token_rewards, values, mask, gamma=1.0, lam=1.0, mistake=""):
    sampled = mask > 0
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
                 denom=None, dual_clip=None, mistake=""):
    m = mask > 0
    adv = torch.where(m, advantages_.float(), 0.0)
    old = torch.where(m, old_logp.float(), logp.detach().float())
    log_ratio = (logp.float() - old).clamp(-starpo.LOG_RATIO_CLAMP, starpo.LOG_RATIO_CLAMP)
    if mistake == "inverted ratio":
        log_ratio = -log_ratio
    ratio = torch.exp(log_ratio)
    high = clip_low if mistake == "symmetric" else clip_high
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + high)
    loss_tok = torch.minimum(unclipped, clipped) if mistake == "min" else torch.maximum(unclipped, clipped)
    if dual_clip:
        loss_tok = torch.where(adv < 0, torch.minimum(-adv * dual_clip, loss_tok), loss_tok)
    metrics = {
        "pg_clipfrac": starpo.masked_mean((clipped > unclipped).float(), mask),
        "pg_clipfrac_upper": starpo.masked_mean(((adv > 0) & (ratio > 1.0 + high)).float(), mask),
        "pg_clipfrac_lower": starpo.masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).float(), mask),
        "pg_clipfrac_dual": starpo.masked_mean(((adv < 0) & (loss_tok > -adv * (dual_clip or 1e9))).float(),
                                               mask),
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


def variant(fn, mistake):
    return lambda *a, **kw: fn(*a, **kw, mistake=mistake)


MUTATIONS = [  # (unit, owner, attribute, the mistake, what it is)
    (1, envs, "_push", push_into_wall, "a push moves a box into a wall"),
    (1, envs, "_push", push_through_box, "a push moves a box into another box"),
    (1, envs, "_push", push_unsorted, "boxes not kept sorted"),
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
    (3, advantages, "grpo_advantages", variant(grpo_variant, "no std"), "GRPO without the std"),
    (3, advantages, "grpo_advantages", variant(grpo_variant, "biased std"), "GRPO with the biased std"),
    (3, advantages, "grpo_advantages", variant(grpo_variant, "global mean"), "GRPO with the batch mean"),
    (4, starpo, "policy_loss", variant(loss_variant, "symmetric"), "a symmetric clip ignoring clip_high"),
    (4, starpo, "policy_loss", variant(loss_variant, "min"), "min where PPO takes the max"),
    (4, starpo, "policy_loss", variant(loss_variant, "inverted ratio"), "the ratio upside down"),
    (4, starpo, "kl_penalty", kl_swapped, "k3 with logp and ref_logp swapped"),
    (4, starpo, "kl_penalty", kl_k3_unclamped, "k3 without its clamps"),
    (4, starpo, "aggregate", aggregate_seq_mean, "a sequence mean where the token mean belongs"),
    (4, starpo, "aggregate", aggregate_times_mask, "the mask multiplied in (inf * 0 = NaN)"),
    (5, variance_filter, "select_groups", variant(select_variant, "mean"), "ranking by mean, not std"),
    (5, variance_filter, "select_groups", variant(select_variant, "lowest"), "keeping the lowest-std groups"),
    (5, variance_filter, "select_groups", variant(select_variant, "round"), "round(keep * G), not int"),
    (5, variance_filter, "select_groups", variant(select_variant, "no minimum"), "none kept at a small keep"),
    (5, variance_filter, "select_groups", variant(select_variant, "biased std"), "the biased std"),
]


@pytest.mark.parametrize("n, owner, name, mistake, what", MUTATIONS, ids=[m[4] for m in MUTATIONS])
def test_the_grader_fails_each_mistake(n, owner, name, mistake, what, monkeypatch):
    monkeypatch.setattr(owner, name, mistake)
    result = grade.grade_unit(n)
    assert result["status"] == "fail", f"{what}: {result['line']}"
    assert result["line"].startswith(f"unit {n} ") and " FAIL " in result["line"], result["line"]
    assert name.lstrip("_") in result["failures"][0], result["failures"][0]  # it names the function


def test_every_unit_has_three_mistakes():
    assert all(sum(m[0] == n for m in MUTATIONS) >= 3 for n in range(1, 6))


def test_a_stub_reads_not_implemented_and_names_the_function(monkeypatch):
    def stub(*args, **kwargs):
        raise NotImplementedError("unit 3 (advantages): implement gae -- see course/unit3-advantages.md")
    monkeypatch.setattr(advantages, "gae", stub)
    result = grade.grade_unit(3)
    assert result["status"] == "not implemented" and result["missing"] == ["gae"]
    assert result["line"].startswith("unit 3 advantages: not implemented -- implement gae "
                                     "(course/unit3-advantages.md); the rest: pass"), result["line"]


# ---- make.py: the student copy

def body_statements(src: str, fn) -> tuple[str, list[str]]:
    """A function's body after its docstring: its lines as written, and each statement's source."""
    doc = isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0], "value", None), ast.Constant)
    body = fn.body[doc:]
    lines = "".join(src.splitlines(keepends=True)[body[0].lineno - 1:fn.end_lineno])
    return lines, [ast.get_source_segment(src, s) for s in body]


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("course") / "student"
    p = subprocess.run([sys.executable, str(ROOT / "course" / "make.py"), str(out)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return out


def test_the_copy_holds_no_reference_body(student):
    texts = {}
    for path in student.rglob("*"):
        try:
            texts[path] = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    assert not (student / "tests" / "test_course.py").exists() and not (student / "runs").exists()
    for unit in make.UNITS:
        for func in unit.get("funcs", []):
            src = (ROOT / unit["file"]).read_text()
            body, stmts = body_statements(src, make.find_function(ast.parse(src), func))
            stubbed = make.find_function(ast.parse((student / unit["file"]).read_text()), func)
            assert isinstance(stubbed.body[-1], ast.Raise) and len(stubbed.body) <= 2, func
            for path, text in texts.items():
                assert body not in text, (func, path)
                leaked = [s for s in stmts if len(s) >= 30 and s not in make.SHARED and s in text]
                assert not leaked, (func, path, leaked)


def test_the_copy_grades_not_implemented_and_train_stops_with_one_line(student):
    p = subprocess.run([sys.executable, "course/grade.py"], cwd=student, capture_output=True, text=True,
                       timeout=120)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 6, p.stdout + p.stderr
    assert all(f"unit {n} " in lines[n - 1] and ": not implemented -- implement " in lines[n - 1]
               for n in range(1, 6)), p.stdout
    p = subprocess.run([sys.executable, "train.py", "--env", "bandit", "--steps", "1"], cwd=student,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # train.py's progress bar (tqdm: "StarPO-S:   0%|   | 0/1 [00:00<?, ?it/s]") precedes the one error line
    bar = re.compile(r"\| *\d+/\d+ \[")
    errors = [line for line in p.stderr.splitlines() if line.strip() and not bar.search(line)]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(errors) == 1, p.stderr[-2000:]
    assert errors[0].startswith("train.py: error: unit 2 (rollout): implement "), errors


def test_make_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "x.txt").write_text("mine")
    p = subprocess.run([sys.executable, str(ROOT / "course" / "make.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not an empty folder" in p.stderr
    assert [x.name for x in tmp_path.iterdir()] == ["x.txt"]
