"""Multi-turn rollouts: the trajectory that StarPO optimises (paper section 2.1-2.2, Figure 2).

One trajectory = system message + the environment's instruction, then up to `max_turns` turns of (state ->
<think>..</think><answer>..</answer> -> reward feedback), rendered with the tokenizer's own chat template in
RAGEN's layout (shorter words; the assistant turn pre-filled with "<think>", mask 0). Every turn of every
live episode is decoded in one batch; the trajectory records the exact token ids sampled (never re-tokenised)
and a loss mask that is 1 exactly on them, from positions recorded here (section 2.2: only the agent's own
tokens are optimised). A reply ends at "</answer>", an end token or max_new_tokens. History window
(`context_turns`): 0 = the paper's whole conversation, one growing sequence per trajectory; K > 0 = RAGEN's
later window of the last K turns, each turn its own training segment carrying the trajectory's reward. Actions
follow RAGEN's es_manager (`act_turn`). Read next: filter.py.
"""
from __future__ import annotations

import copy
import random
import re
from dataclasses import dataclass, field

import torch

from engine.models import autocast_dtype
from envs import make_env

SYSTEM_PROMPT = "You're a helpful assistant."
# the settings a policy is trained and evaluated with (saved beside it in train_config.json)
ROLLOUT_KEYS = ("max_turns", "max_actions_per_turn", "max_actions", "format_penalty", "think",
                "context_turns", "max_new_tokens")


def default_reply_tokens(model_kind: str, env: str) -> int:
    """Tokens per reply: RAGEN's vLLM response_length for hub models (400; its bandit runs 500), 100 for the
    tiny policy (its replies are ~14 tokens)."""
    return 100 if model_kind == "tiny" else 500 if env.startswith("bandit") else 400


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
    kv_cache: bool = True  # engine/sampler.py's engine (speed only: the same distribution)
    cuda_graphs: bool = True  # on CUDA, the engine's decode step is a CUDA graph (speed only)

    @classmethod
    def of(cls, cfg, temperature: float) -> "RolloutConfig":
        """The rollout settings of an entry script's Config."""
        return cls(temperature=temperature, **{k: getattr(cfg, k) for k in ROLLOUT_KEYS})


@dataclass
class Turn:
    obs: str                 # the state shown at this turn
    reply: str               # the full assistant reply (pre-filled tag + sampled text)
    actions: list[str]       # parsed actions that were attempted
    parsed: bool             # the reply matched the answer format (well-formed)
    format_ok: bool          # well-formed, and every attempted action valid (else the format penalty)
    env_reward: float
    reward: float            # env reward + format penalty
    valid: int
    effective: int
    response_tokens: int     # tokens the policy sampled this turn
    success: bool = False    # the environment reported success during this turn


@dataclass
class Segment:               # one training sequence
    input_ids: list[int]
    loss_mask: list[int]     # 1 exactly where the policy sampled the token
    system_len: int = 0      # tokens of the system message it starts with (-1: the template renders none)
    reply_ends: list[int] = field(default_factory=list)  # each reply's last sampled token, in turn order

    def append(self, ids: list[int], sampled: int):
        self.input_ids += ids
        self.loss_mask += [sampled] * len(ids)
        if sampled and ids:
            self.reply_ends.append(len(self.input_ids) - 1)


def trained_mask(seg: Segment, response_mask: bool = True) -> list[int]:
    """The tokens a segment trains: those the policy sampled (`response_mask`, the default), or every token
    after the system message, as the paper's runs did (RAGEN's `enable_response_mask: False`: states, feedback
    and template tokens too; RAGEN's mask starts one token later, after the user turn's <|im_start|>)."""
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
    done: bool = False       # the environment ended the episode (vs. a budget)
    truncated: bool = False  # ended because its next turn could have run past the model's positions
    messages: list[dict] = field(default_factory=list)  # the full conversation as text, for dumps

    @property
    def reward(self) -> float:     # env rewards + format penalties (what StarPO maximises)
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


# ----------------------------------------------------------------------------- text of the conversation

def format_prompt(think: bool) -> str:
    return ("<think> [your thoughts] </think> " if think else "") + "<answer> [your answer] </answer>"


def header_text(env, cfg: RolloutConfig) -> str:
    """Shown once at the top: rules, action list, budgets, separator (RAGEN's env instruction)."""
    return (f"{env.instruction}\n"   # the instruction already lists the actions
            f"You can take up to {cfg.max_actions_per_turn} actions per turn, separated by ||, "
            f"and {cfg.max_actions} actions in total.\n")


def turn_text(k: int, obs: str, actions_left: int, cfg: RolloutConfig) -> str:
    return (f"Turn {k}:\nState:\n{obs}\nYou have {actions_left} actions left. "
            f"Always output: {format_prompt(cfg.think)} with no extra text.\n")


PENALTY_NOTE = "Invalid format or action.\n"


def feedback_text(turn: Turn) -> str:
    """The turn's whole reward (RAGEN shows the env's alone), with a note when it was penalised."""
    note = "" if turn.format_ok else PENALTY_NOTE
    return f"Reward: {round(turn.reward, 2):g}\n{note}"


def prefill(cfg: RolloutConfig) -> str:
    return "<think>" if cfg.think else "<answer>"


JUNCTION_RE = re.compile(r"</think>\s*<answer>")


def parse_reply(text: str, think: bool, max_actions: int) -> tuple[list[str], bool]:
    """-> (actions, parsed): the first "<think>..</think> <answer>..</answer>" (no-think: "<answer>..
    </answer>") of the reply, its answer split on '||', empty pieces dropped, the first `max_actions` kept:
    the match of a lazy regex, found in linear time (that regex is quadratic on many unclosed tags)."""
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


# ----------------------------------------------------------------------------- token bookkeeping

def render_ids(tokenizer, messages: list[dict], cfg: RolloutConfig) -> list[int]:
    """Chat-template a conversation and open the next assistant turn with the pre-filled tag."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill(cfg)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_close(tokenizer) -> str:
    """The template text that closes an assistant turn (Qwen: "<|im_end|>\n"), found by rendering a
    placeholder conversation, so any chat template works."""
    mark = "\x00REPLY\x00"
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    open_ = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(base + [{"role": "assistant", "content": mark}], tokenize=False)
    if not closed.startswith(open_) or mark not in closed:
        raise ValueError("chat template does not render an assistant turn after its generation prompt")
    return closed[closed.index(mark) + len(mark):]


# ----------------------------------------------------------------------------- scripted agents

def scripted_reply(actions: list[str], thought: str, cfg: RolloutConfig) -> str:
    """The reply text a scripted agent sends, without the pre-filled opening tag."""
    answer = f"<answer> {' || '.join(actions)} </answer>"   # spaced as RAGEN's format prompt
    return f" {thought} </think> {answer}" if cfg.think else answer[len("<answer>"):]


def available_actions(env) -> list[str]:
    fn = getattr(env, "available_actions", None)
    return fn() if callable(fn) else list(env.actions)


def plan_on_copy(env, k: int, choose) -> list[str]:
    """Up to k actions, each chosen by choose(sim) where the previous ones lead, on a copy of the env; the
    plan stops where the copy's episode ends (the real env is stepped later, by the rollout)."""
    sim, plan = copy.deepcopy(env), []
    for _ in range(k):
        plan.append(choose(sim))
        _, _, done, _ = sim.step(plan[-1])
        if done:
            break
    return plan


def random_agent(rng: random.Random):
    """Uniformly random valid actions, 1..min(max per turn, actions left) of them, and a truthful fixed
    thought. Each is drawn among those valid where the previous ones lead (WebShop's clicks change with the
    page)."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = rng.randint(1, max(1, min(cfg.max_actions_per_turn, actions_left)))
        plan = plan_on_copy(env, k, lambda sim: rng.choice(available_actions(sim)))
        return plan, "I pick my moves at random."
    return act


def expert_thought(note: str, moves: list[str]) -> str:
    """The expert's words for a turn: the note (where things are, its next push), then the turn's moves."""
    return (note + ". " if note else "") + "I pick my moves: " + ", ".join(moves) + "."


def expert_agent(actions_per_turn: int = 1):
    """The env's optimal policy; several actions per turn are planned on a copy of the env. Its truthful
    thought: the env's `expert_note()` where it has one, then the plan."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = max(1, min(actions_per_turn, cfg.max_actions_per_turn, actions_left))
        plan = plan_on_copy(env, k, lambda sim: sim.expert_action())
        return plan, expert_thought(env.expert_note() if hasattr(env, "expert_note") else "", plan)
    return act


# ----------------------------------------------------------------------------- the episode loop

def make_sampler(model, tokenizer, rows: int, cfg: RolloutConfig):
    """The policy's replies to a turn's prompts: engine/sampler.py's engine (one static KV cache for all the
    episodes, each kept across its turns; RAGEN uses vLLM) or, with `kv_cache=False` or an architecture the
    engine does not know, the Hugging Face forward re-prefilling every turn (the reference path)."""
    from engine.sampler import Engine, reference_generate, say_once, unsupported
    why = unsupported(model) if cfg.kv_cache else None
    if cfg.kv_cache and not why:
        engine = Engine(model, tokenizer, rows, graphs=cfg.cuda_graphs)
        return lambda live, prompts, gen: engine.generate(live, prompts, cfg.max_new_tokens, cfg.temperature,
                                                          gen)
    if why:
        say_once(f"note: the rollout engine does not know {why}: sampling with the Hugging Face forward")
    return lambda live, prompts, gen: reference_generate(model, tokenizer, prompts, cfg.max_new_tokens,
                                                         cfg.temperature, gen)


def rollout(env: str | list, seeds: list[int], group_ids: list[int], cfg: RolloutConfig, tokenizer=None,
            model=None, agent=None, generator: torch.Generator | None = None,
            samples: list[int] | None = None, env_overrides: dict | None = None) -> list[Trajectory]:
    """Run len(seeds) episodes in lock-step; each turn, all live episodes reply in one batch.

    `env`: an env name, or one env object per seed (e.g. a wrapper). Replies come from `model` (sampled) or
    `agent(env, actions_left, cfg) -> (actions, thought)` (scripted); `tokenizer=None` records text only.
    `samples[i]`: the env draws episode i's noise (payoffs, slips) from (seed, sample)."""
    if (model is not None) + (agent is not None) != 1:
        raise ValueError("rollout needs exactly one of model= or agent=")
    envs = [make_env(env, **(env_overrides or {})) for _ in seeds] if isinstance(env, str) else list(env)
    trajs = [Trajectory(env=e.name, seed=s, group_id=g) for e, s, g in zip(envs, seeds, group_ids)]
    samples = samples if samples is not None else [0] * len(seeds)
    obs = [e.reset(s, sample=k) for e, s, k in zip(envs, seeds, samples)]
    left = [cfg.max_actions] * len(envs)
    live = list(range(len(envs)))
    hdr = [header_text(e, cfg) for e in envs]
    user_msgs: list[list[str]] = [[] for _ in envs]   # user message of each turn (feedback + turn text)
    reply_texts: list[list[str]] = [[] for _ in envs]  # each episode's replies so far, as text
    running: list[Segment | None] = [None] * len(envs)  # the growing sequence when context_turns == 0
    sampler = make_sampler(model, tokenizer, len(envs), cfg) if model is not None else None
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)  # positions it reads
    close = turn_close(tokenizer) if tokenizer is not None else None
    system = [] if tokenizer is None else tokenizer(tokenizer.apply_chat_template([{
        "role": "system", "content": SYSTEM_PROMPT}], tokenize=False), add_special_tokens=False)["input_ids"]
    for k in range(1, cfg.max_turns + 1):  # an empty `live` ends the loop below, after `fits`
        prompts, fits = [], []
        for i in live:
            user_msgs[i].append(("" if k == 1 else feedback_text(trajs[i].turns[-1])) +
                                turn_text(k, obs[i], left[i], cfg))
            msgs = window_messages(hdr[i], user_msgs[i], reply_texts[i], cfg.context_turns)
            if tokenizer is not None:
                if cfg.context_turns == 0 and running[i] is not None:
                    # extend the sequence: the template's close followed the reply; now the next user turn
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
                    # the reply could run past the model's positions: the episode ends before this turn
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
        # --- replies for all live episodes at once
        if agent is not None:
            texts = [scripted_reply(*agent(envs[i], left[i], cfg), cfg) for i in live]
            sampled = None if tokenizer is None else [tokenizer(t, add_special_tokens=False).input_ids
                                                      for t in texts]
        else:
            device = next(model.parameters()).device
            amp = autocast_dtype(device)  # bf16 on CUDA
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                sampled = sampler(live, prompts, generator)
            # a sampled end-of-turn token is not part of the reply's text: the chat template writes it
            texts = [tokenizer.decode(s[:-1] if s[-1] == tokenizer.eos_token_id else s,
                                      skip_special_tokens=False) for s in sampled]
        # --- parse, act, record
        still = []
        for j, i in enumerate(live):
            reply = prefill(cfg) + texts[j]
            n_tok = len(sampled[j]) if sampled is not None else len(texts[j].split())
            turn = act_turn(envs[i], reply, left[i], cfg, obs[i], n_tok)
            left[i] -= turn.valid  # unknown words cost no budget
            obs[i] = envs[i].render()
            reply_texts[i].append(reply)
            trajs[i].turns.append(turn)
            trajs[i].success = trajs[i].success or turn.success
            if tokenizer is not None:
                running[i].append(sampled[j], 1)
                # it closed its turn: the template's close continues after that end token
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


def act_turn(env, reply: str, actions_left: int, cfg: RolloutConfig, obs: str, n_tok: int) -> Turn:
    """Parse one reply and run its actions, as RAGEN's es_manager: its first max_actions_per_turn words are
    read, unknown ones change nothing and cost no budget, valid ones run until the episode's budget or its end
    (words after the last one run are not checked: WebShop's valid words depend on the page). A turn with an
    invalid word among those run, or without a valid one, pays the format penalty once."""
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
    """System + instruction + the last K turns (K = 0: all), ending with the current user turn."""
    n = len(user_msgs)
    first = 0 if context_turns == 0 else max(0, n - context_turns)
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
    for t in range(first, n):
        msgs.append({"role": "user", "content": (header if t == first else "") + user_msgs[t]})
        if t < len(replies):
            msgs.append({"role": "assistant", "content": replies[t]})
    return msgs


def dump(traj: Trajectory, tokenizer=None) -> str:
    """A readable text dump of one trajectory (what the agent saw and said, rewards per turn)."""
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
