"""train.py's options beyond the paper: their flags (`Options`, which train.Config inherits), the rules their
values must meet, and the words that name them in a run's first printed line. train.py imports this file only when a run uses one of them; each option's module
plugs into the loop's named points (train.extension_points) with its `plug(cfg, points, run)`.

Each option is opt-in (its default is the paper's method) and lives in its own file here: RAGEN HEAD's
filter rules (filter_rules.py), turn rewards and bi-level GAE (turn_credit.py), RAGEN-2's template-collapse
metrics (collapse.py), hindsight imitation (hindsight.py), verl-agent's GiGPO (gigpo.py); verl's dual clip
is a keyword of starpo.policy_loss. An option's companion flag typed without it would change nothing, so
that is an error too.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, fields

from engine import cli
from envs import ENVS

METRICS = ["reward_std", "reward_mean", "reward_sum"]
FILTERS, TOP_P = ["top_k", "top_k_abs", "top_p", "min_p"], ["linear", "softmax"]
DEMOS, GIGPO = ["hindsight", "best"], ["mean_norm", "mean_std_norm"]
option = cli.option


@dataclass
class Options:
    """train.py's flags beyond the paper: train.Config inherits them, `--help` lists them after the paper's.
    Each default is the paper's method; a run names those it uses in its first line (`describe`)."""
    filter_strategy: str = option("top_k", "RAGEN's rules (top_k: the paper's)", choices=FILTERS)
    filter_metric: str = option("reward_std", "the score groups are ranked by", choices=METRICS)
    filter_include_zero: bool = option(True, "rank zero-score groups too (RAGEN-2: off)")
    filter_top_p_mode: str = option("linear", "top_p over the score or softmax mass", choices=TOP_P)
    filter_eps: float = option(0.01, "top_p linear: RAGEN's selection_eps", lo=0)
    filter_empty_stop: int = option(0, "stop after K iterations with no group kept (RAGEN: 5)", lo=0)
    turn_rewards: bool = option(False, "PPO: each turn's reward on its last token (RAGEN)")
    bi_level_gae: bool = option(False, "PPO: turn-level, then token-level GAE (RAGEN)")
    high_level_gamma: float = option(0.95, "--bi-level-gae's turn-level discount", lo=0, hi=1)
    dual_clip: float = option(0.0, "verl's dual clip C > 1 (RAGEN's runs: 3; 0: off)", lo=0)
    collapse_every: int = option(0, "RAGEN-2's template-collapse metrics every K iterations", lo=0)
    collapse_samples: int = option(64, "first turns scored per collapse measurement", lo=2)
    hindsight_imitation: int = option(0, "Sokoban: K passes of GCSL after each update", lo=0)
    imitation_demos: str = option("hindsight", "its demos: relabelled, or each room's best", choices=DEMOS)
    imitation_lr: float | None = option(None, "its AdamW's rate (default: tiny 2.5e-4, hub 5e-4)", gt=0)
    gigpo_weight: float = option(1.0, "--algo gigpo: the step-level weight", lo=0)
    gigpo_gamma: float = option(0.95, "--algo gigpo: the step-level discount", gt=0, hi=1)
    gigpo_mode: str = option("mean_norm", "--algo gigpo: the step groups' normalisation", choices=GIGPO)
    rollout_correction: str = option("none", "rollout-vs-update mismatch: tis (verl, TRL), mask (SkyRL)",
                                     choices=["none", "tis", "mask"])
    rollout_correction_cap: float = option(2.0, "its C: weights <= C; the mask keeps [1/C, C]", lo=1)
    ratio_level: str = option("token", "PPO's ratio per token (the paper) or sequence (GSPO)",
                              choices=["token", "sequence"])
    gspo_clip_low: float = option(3e-4, "--ratio-level sequence: GSPO's eps_low", gt=0, lt=1)
    gspo_clip_high: float = option(4e-4, "--ratio-level sequence: GSPO's eps_high", gt=0)


PLUGS = {  # an option (a Config field of train.py) -> the module here that plugs it into the loop
    "filter_strategy": "extras.filter_rules", "filter_metric": "extras.filter_rules",
    "filter_include_zero": "extras.filter_rules", "filter_empty_stop": "extras.filter_rules",
    "turn_rewards": "extras.turn_credit", "bi_level_gae": "extras.turn_credit",
    "collapse_every": "extras.collapse", "hindsight_imitation": "extras.hindsight",
    "rollout_correction": "extras.rollout_correction", "ratio_level": "extras.gspo"}


def plug(cfg, points: dict, run: dict) -> None:
    """train.extension_points: each module of an option the run uses (once, in Config's order) calls its
    `plug(cfg, points, run)`, which replaces a point (the filter, the estimator) or adds a hook."""
    modules = [PLUGS[name] for name in cli.opt_ins(cfg) if name in PLUGS]
    for module in dict.fromkeys(modules):
        importlib.import_module(module).plug(cfg, points, run)


def changed(cfg, name: str) -> bool:
    """Whether the field `name` differs from its default."""
    return getattr(cfg, name) != next(f.default for f in fields(cfg) if f.name == name)


def rules(cfg, explicit: set[str] = frozenset()) -> list[tuple[bool, str]]:
    """(ok, the error line) of every rule of the options beyond the paper (`explicit`: the flags typed)."""
    from extras.hindsight import supported
    sokobans = ", ".join(sorted(n for n in ENVS if supported(n)))
    companions = [("high_level_gamma", "--bi-level-gae", cfg.bi_level_gae),
                  ("filter_top_p_mode", "--filter-strategy top_p", cfg.filter_strategy == "top_p"),
                  ("filter_eps", "--filter-strategy top_p", cfg.filter_strategy == "top_p"),
                  ("collapse_samples", "--collapse-every K", cfg.collapse_every > 0),
                  ("imitation_demos", "--hindsight-imitation K (K >= 1)", cfg.hindsight_imitation > 0),
                  *[(k, "--algo gigpo", cfg.algo == "gigpo")
                    for k in ("gigpo_weight", "gigpo_gamma", "gigpo_mode")],
                  ("rollout_correction_cap", "--rollout-correction tis or mask",
                   cfg.rollout_correction != "none"),
                  *[(k, "--ratio-level sequence", cfg.ratio_level == "sequence")
                    for k in ("gspo_clip_low", "gspo_clip_high")]]
    return [(switch or not changed(cfg, name), f"--{name.replace('_', '-')} {getattr(cfg, name)}: only with "
                                               f"{needs} (it changes nothing without)")
            for name, needs, switch in companions] + [
        ("imitation_lr" not in explicit or cfg.hindsight_imitation > 0,
         f"--imitation-lr {cfg.imitation_lr}: only with --hindsight-imitation K (K >= 1) (it changes nothing "
         f"without)"),
        (not cfg.hindsight_imitation or supported(cfg.env),
         f"--hindsight-imitation {cfg.hindsight_imitation}: "
         f"only for {sokobans} (this run: --env {cfg.env}; 0 turns it off)"),
        (cfg.filter_strategy != "top_k_abs" or float(cfg.filter).is_integer(), f"--filter {cfg.filter}: "
         f"--filter-strategy top_k_abs keeps a whole number of groups"),
        (cfg.algo == "ppo" or not cfg.bi_level_gae,
         "--bi-level-gae: PPO only (it needs the critic's values)"),
        (cfg.algo == "ppo" or not cfg.turn_rewards,
         "--turn-rewards: PPO only (GRPO credits the trajectory)"),
        (not cfg.turn_rewards or cfg.context_turns == 0,
         f"--turn-rewards: needs --context-turns 0 (one row per trajectory), got {cfg.context_turns}"),
        (not cfg.bi_level_gae or cfg.response_mask,
         "--bi-level-gae: needs --response-mask (turns end at sampled tokens)"),
        (not cfg.collapse_every or cfg.think,
         f"--collapse-every {cfg.collapse_every}: needs think mode (it scores the reasoning between <think> "
         f"and </think>); this run has --no-think"),
        (cfg.dual_clip == 0 or cfg.dual_clip > 1,
         f"--dual-clip {cfg.dual_clip}: must be > 1 (verl's clip_ratio_c; 0 = off)"),
        (cfg.algo != "gigpo" or cfg.response_mask,
         "--algo gigpo: needs --response-mask (each turn's advantage sits on the tokens it sampled)"),
    ]


def describe(cfg) -> tuple[str, bool]:
    """-> (" + ..." naming the options a run uses, whether they change the method: the run is then named
    "(modified)"; measuring the collapse metrics changes nothing)."""
    later = [k for k, on in (("filter " + cfg.filter_strategy, cfg.filter_strategy != "top_k"),
                             ("by " + cfg.filter_metric, cfg.filter_metric != "reward_std"),
                             ("no zero groups", not cfg.filter_include_zero),
                             ("turn rewards", cfg.turn_rewards),
                             ("bi-level GAE", cfg.bi_level_gae),
                             (f"dual clip {cfg.dual_clip:g}", cfg.dual_clip > 0))
             if on]
    parts = []
    if cfg.hindsight_imitation:
        parts.append(f"hindsight imitation x{cfg.hindsight_imitation} (GCSL, beyond the paper)")
    if cfg.rollout_correction != "none":
        parts.append(f"rollout correction {cfg.rollout_correction}, cap {cfg.rollout_correction_cap:g} "
                     f"({'verl, TRL' if cfg.rollout_correction == 'tis' else 'SkyRL'}; beyond the paper)")
    if cfg.ratio_level == "sequence":
        eps = f"{cfg.gspo_clip_low:g}/{cfg.gspo_clip_high:g}"
        parts.append(f"sequence-level ratios, clip {eps} (GSPO, beyond the paper)")
    if cfg.algo == "gigpo":
        parts.append(f"GiGPO step-level advantages (w {cfg.gigpo_weight:g}, gamma {cfg.gigpo_gamma:g}, "
                     f"{cfg.gigpo_mode}; verl-agent, beyond the paper)")
    if later:
        parts.append(f"{', '.join(later)} (RAGEN's later code)")
    if cfg.collapse_every:
        parts.append(f"collapse metrics every {cfg.collapse_every} (RAGEN-2, measured only)")
    modified = bool(later) or cfg.algo == "gigpo" or cfg.hindsight_imitation > 0 or \
        cfg.rollout_correction != "none" or cfg.ratio_level == "sequence"
    return "".join(f" + {p}" for p in parts), modified
