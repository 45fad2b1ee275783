"""Multi-turn rollouts: the trajectory that StarPO optimises (paper sections 2.1-2.2, Figure 2).

A trajectory: the instruction, then up to `max_turns` turns of (state -> <think>..</think><answer>..</answer>
-> reward feedback) in the chat template and RAGEN's layout; live episodes reply in one batch. It keeps the
token ids as sampled and a loss mask that is 1 exactly on them. `context_turns` 0: the paper's whole
conversation, one sequence; K > 0: RAGEN's window of the last K turns, a segment per turn. Next: filter.py.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from engine import distributed as dist
from engine.models import autocast_dtype, turn_close
from envs import make_env, train_seeds

SYSTEM_PROMPT = "You're a helpful assistant."
# the settings a policy is trained and evaluated with
ROLLOUT_KEYS = ("max_turns", "max_actions_per_turn", "max_actions", "format_penalty", "think",
                "context_turns", "max_new_tokens")


@dataclass
class RolloutConfig:
    max_turns: int = 5
    max_actions_per_turn: int = 5
    max_actions: int = 10
    format_penalty: float = -0.1
    think: bool = True
    context_turns: int = 0
    max_new_tokens: int = 100
    temperature: float = 1.0  # 0 = greedy
    kv_cache: bool = True  # speed only
    cuda_graphs: bool = True  # speed only

    @classmethod
    def of(cls, cfg, temperature: float) -> "RolloutConfig":
        return cls(temperature=temperature, **{k: getattr(cfg, k) for k in ROLLOUT_KEYS})


@dataclass
class Turn:
    obs: str
    reply: str               # the pre-filled tag + the reply
    actions: list[str]       # the actions run
    parsed: bool             # well-formed
    format_ok: bool          # well-formed, every action valid (else the format penalty)
    env_reward: float
    reward: float            # env reward + format penalty
    valid: int
    effective: int
    response_tokens: int
    success: bool = False


@dataclass
class Segment:               # one training sequence
    input_ids: list[int]
    loss_mask: list[int]     # 1 exactly where the policy sampled the token
    system_len: int = 0      # the system message's tokens (-1: unknown)
    reply_ends: list[int] = field(default_factory=list)  # each turn's last sampled token
    logp: list[float] = field(default_factory=list)  # the sampler's log-probs, NaN where not sampled

    def __post_init__(self):
        self.logp = self.logp or [math.nan] * len(self.input_ids)

    def append(self, ids: list[int], sampled: int, logp: list[float] | None = None):
        self.input_ids += ids
        self.loss_mask += [sampled] * len(ids)
        self.logp += list(logp) if logp is not None else [math.nan] * len(ids)
        if sampled and ids:
            self.reply_ends.append(len(self.input_ids) - 1)


def trained_mask(seg: Segment, response_mask: bool = True) -> list[int]:
    """The tokens a segment trains: those sampled, or (`response_mask=False`, the paper's runs) every token
    after the system message."""
    if response_mask:
        return seg.loss_mask
    if seg.system_len < 0:
        raise ValueError("--no-response-mask: this chat template does not start a conversation with the "
                         "system message as rendered alone, so where it ends is unknown")
    return [0] * seg.system_len + [1] * (len(seg.input_ids) - seg.system_len)


@dataclass
class Trajectory:
    env: str
    seed: int
    group_id: int
    turns: list[Turn] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    success: bool = False
    done: bool = False       # the environment ended it (not a budget)
    truncated: bool = False  # its next turn could have run past the model's positions
    messages: list[dict] = field(default_factory=list)

    @property
    def reward(self) -> float:  # env rewards + format penalties: what StarPO maximises
        return sum(t.reward for t in self.turns)

    @property
    def num_actions(self) -> int:
        return sum(len(t.actions) for t in self.turns)

    @property
    def valid_actions(self) -> int:
        return sum(t.valid for t in self.turns)

    @property
    def effective_actions(self) -> int:
        return sum(t.effective for t in self.turns)


# ---- the text

def format_prompt(think: bool) -> str:
    return ("<think> [your thoughts] </think> " if think else "") + "<answer> [your answer] </answer>"


def header_text(env, cfg: RolloutConfig) -> str:
    """Shown once at the top (RAGEN's env instruction)."""
    return (f"{env.instruction}\n"
            f"You can take up to {cfg.max_actions_per_turn} actions per turn, separated by ||, "
            f"and {cfg.max_actions} actions in total.\n")


def turn_text(k: int, obs: str, actions_left: int, cfg: RolloutConfig) -> str:
    return (f"Turn {k}:\nState:\n{obs}\nYou have {actions_left} actions left. "
            f"Always output: {format_prompt(cfg.think)} with no extra text.\n")


PENALTY_NOTE = "Invalid format or action.\n"


def feedback_text(turn: Turn) -> str:  # the turn's whole reward (RAGEN: the env's)
    note = "" if turn.format_ok else PENALTY_NOTE
    return f"Reward: {round(turn.reward, 2):g}\n{note}"


def prefill(cfg: RolloutConfig) -> str:
    return "<think>" if cfg.think else "<answer>"


JUNCTION_RE = re.compile(r"</think>\s*<answer>")


def parse_reply(text: str, think: bool, max_actions: int) -> tuple[list[str], bool]:
    """-> (actions, parsed): the answer of the first "<think>..</think> <answer>..</answer>" (no-think:
    "<answer>..</answer>") split on '||', the first `max_actions` kept (linear time, unlike a lazy regex)."""
    if think:
        start = text.find("<think>")
        junction = JUNCTION_RE.search(text, start + len("<think>")) if start >= 0 else None
        begin = junction.end() if junction is not None else -1
    else:
        begin = text.find("<answer>")
        begin = begin + len("<answer>") if begin >= 0 else -1
    end = text.find("</answer>", begin) if begin >= 0 else -1
    if end < 0:
        return [], False
    actions = [a.strip() for a in text[begin:end].split("||") if a.strip()]
    return actions[:max_actions], True


# ---- the tokens

def render_ids(tokenizer, messages: list[dict], cfg: RolloutConfig) -> list[int]:
    """Chat-template a conversation, opening the next assistant turn with the pre-filled tag."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill(cfg)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- scripted agents

def scripted_reply(actions: list[str], thought: str, cfg: RolloutConfig) -> str:  # without the pre-filled tag
    answer = f"<answer> {' || '.join(actions)} </answer>"
    return f" {thought} </think> {answer}" if cfg.think else answer[len("<answer>"):]


def expert_thought(note: str, moves: list[str]) -> str:
    return (note + ". " if note else "") + "I pick my moves: " + ", ".join(moves) + "."


# ---- the episode loop

def rollout(env: str | list, seeds: list[int], group_ids: list[int], cfg: RolloutConfig, tokenizer=None,
            model=None, agent=None, generator: torch.Generator | None = None,
            samples: list[int] | None = None, env_overrides: dict | None = None) -> list[Trajectory]:
    """len(seeds) episodes in lock-step (`env`: a name, or an env per seed). Replies: `model` (sampled) or
    `agent(env, actions_left, cfg) -> (actions, thought)`; `tokenizer=None`: text only. Episode i's noise:
    (seed, samples[i])."""
    if (model is not None) + (agent is not None) != 1:
        raise ValueError("rollout needs exactly one of model= or agent=")
    envs = [make_env(env, **(env_overrides or {})) for _ in seeds] if isinstance(env, str) else list(env)
    trajs = [Trajectory(env=e.name, seed=s, group_id=g) for e, s, g in zip(envs, seeds, group_ids)]
    samples = samples if samples is not None else [0] * len(seeds)
    obs = [e.reset(s, sample=k) for e, s, k in zip(envs, seeds, samples)]
    left = [cfg.max_actions] * len(envs)
    live = list(range(len(envs)))
    hdr = [header_text(e, cfg) for e in envs]
    user_msgs: list[list[str]] = [[] for _ in envs]
    reply_texts: list[list[str]] = [[] for _ in envs]
    running: list[Segment | None] = [None] * len(envs)  # each episode's sequence
    if model is not None:
        from engine.sampler import make_sampler
        sampler = make_sampler(model, tokenizer, len(envs), cfg)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    close = turn_close(tokenizer) if tokenizer is not None else None
    system = [] if tokenizer is None else tokenizer(tokenizer.apply_chat_template([{
        "role": "system", "content": SYSTEM_PROMPT}], tokenize=False), add_special_tokens=False)["input_ids"]
    for k in range(1, cfg.max_turns + 1):
        prompts, fits = [], []
        for i in live:
            user_msgs[i].append(("" if k == 1 else feedback_text(trajs[i].turns[-1])) +
                                turn_text(k, obs[i], left[i], cfg))
            msgs = window_messages(hdr[i], user_msgs[i], reply_texts[i], cfg.context_turns)
            if tokenizer is not None:
                if cfg.context_turns == 0 and running[i] is not None:
                    delta = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
                    prev = tokenizer.apply_chat_template(msgs[:-1], tokenize=False)
                    if not delta.startswith(prev):
                        raise ValueError("chat template is not prefix-stable across turns; use "
                                         "--context-turns")
                    add = tokenizer(delta[len(prev):] + prefill(cfg), add_special_tokens=False)["input_ids"]
                    n = len(running[i].input_ids) + len(add)
                else:
                    ids = render_ids(tokenizer, msgs, cfg)
                    n = len(ids)
                if limit is not None and n + cfg.max_new_tokens > limit:
                    # the reply could run past the model's positions: the episode ends
                    user_msgs[i].pop()
                    trajs[i].truncated = True
                    continue
                if cfg.context_turns == 0 and running[i] is not None:
                    running[i].append(add, 0)
                else:
                    sys_len = len(system) if ids[:len(system)] == system else -1
                    running[i] = Segment(list(ids), [0] * len(ids), sys_len)
                prompts.append(running[i].input_ids)
            fits.append(i)
        live = fits
        if not live:
            break
        # --- replies, all at once
        if agent is not None:
            texts = [scripted_reply(*agent(envs[i], left[i], cfg), cfg) for i in live]
            sampled = None if tokenizer is None else [tokenizer(t, add_special_tokens=False).input_ids
                                                      for t in texts]
            logps = None
        else:
            device = next(model.parameters()).device
            amp = autocast_dtype(device)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                sampled, logps = sampler(live, prompts, generator)
            # an end-of-turn token is not the reply's text: the template writes it
            texts = [tokenizer.decode(s[:-1] if s[-1] == tokenizer.eos_token_id else s,
                                      skip_special_tokens=False) for s in sampled]
        # --- parse, act, record
        still = []
        for j, i in enumerate(live):
            reply = prefill(cfg) + texts[j]
            n_tok = len(sampled[j]) if sampled is not None else len(texts[j].split())
            turn = act_turn(envs[i], reply, left[i], cfg, obs[i], n_tok)
            left[i] -= turn.valid
            obs[i] = envs[i].render()
            reply_texts[i].append(reply)
            trajs[i].turns.append(turn)
            trajs[i].success = trajs[i].success or turn.success
            if tokenizer is not None:
                running[i].append(sampled[j], 1, logps[j] if logps else None)
                # it closed its turn: the rest of the template's close follows
                ended = sampled[j][-1:] == [tokenizer.eos_token_id] and tokenizer.eos_token
                tail = close.removeprefix(tokenizer.eos_token) if ended else close
                running[i].append(tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else [], 0)
                if cfg.context_turns > 0:
                    trajs[i].segments.append(running[i])
            trajs[i].done = envs[i].done
            if not envs[i].done and left[i] > 0:
                still.append(i)
        live = still
    for i, t in enumerate(trajs):
        t.messages = window_messages(hdr[i], user_msgs[i], reply_texts[i], 0)
        if tokenizer is not None and cfg.context_turns == 0 and running[i] is not None:
            t.segments = [running[i]]
    return trajs


def group_rollouts(cfg, it: int, seed: int, policy, tok, rcfg: RolloutConfig, env_kw: dict, device) -> list:
    """Training iteration `it`'s P x N rollouts (section 2.1, `seed`: its own): cfg.groups rooms, each
    rolled out --rollouts times, a group that shares its room and (--group-noise shared, RAGEN's) its
    luck. Under torchrun each rank rolls out its share of the groups and all ranks get them all."""
    gen = torch.Generator(device=device).manual_seed(seed + (dist.rank() << 40))
    seeds = train_seeds([cfg.seed, it], cfg.groups)
    mine, n = dist.my_range(cfg.groups), cfg.rollouts
    env_seeds = [seeds[g] for g in mine for _ in range(n)]
    group_ids = [g for g in mine for _ in range(n)]
    shared = cfg.group_noise == "shared"
    samples = [0 if shared else k for _ in mine for k in range(n)]
    policy.eval()
    trajs = rollout(cfg.env, env_seeds, group_ids, rcfg, tokenizer=tok, model=policy, generator=gen,
                    env_overrides=env_kw, samples=samples)
    return dist.all_gather_objects(trajs)


def act_turn(env, reply: str, actions_left: int, cfg: RolloutConfig, obs: str, n_tok: int) -> Turn:
    """One reply's actions as RAGEN's es_manager runs them (unknown words cost no budget) until the budget
    or episode ends. A turn with an invalid word run, or no valid one, pays the format penalty once."""
    actions, parsed = parse_reply(reply, cfg.think, cfg.max_actions_per_turn)
    env_r, valid, effective, ran, success = 0.0, 0, 0, [], False
    for a in actions:
        if env.done or valid == actions_left:
            break
        _, r, _, info = env.step(a)
        ran.append(a)
        env_r += r
        valid += int(info["action_is_valid"])
        effective += int(info["action_is_effective"])
        success = success or bool(info["success"])
    ok = parsed and valid == len(ran) and len(ran) > 0
    return Turn(obs=obs, reply=reply, actions=ran, parsed=parsed, format_ok=ok, env_reward=env_r,
                reward=env_r + (0.0 if ok else cfg.format_penalty), valid=valid, effective=effective,
                response_tokens=n_tok, success=success)


def window_messages(header: str, user_msgs: list[str], replies: list[str], context_turns: int) -> list[dict]:
    """The system message, the instruction and the last K turns (K = 0: all)."""
    n = len(user_msgs)
    first = 0 if context_turns == 0 else max(0, n - context_turns)
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(first, n):
        msgs.append({"role": "user", "content": (header if t == first else "") + user_msgs[t]})
        if t < len(replies):
            msgs.append({"role": "assistant", "content": replies[t]})
    return msgs
