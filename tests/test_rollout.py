"""Tests for rollout.py: the parser and turn rules, the loss mask, budgets, history windows, replays, the scripted
agents and the dump (sampler.py: tests/test_sampler.py).

Run from the repository root:  python -m pytest -q tests/test_rollout.py   (about 45 s on one core)

Model-driven tests use `small` (tests/conftest.py): a SMALL tiny policy (2 envs, ~80k parameters, seconds to
build); its replies are a mix of well-formed and broken ones, which is what these tests need.
"""
import copy
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout as R  # noqa: E402
from eval import expert_agent, random_agent  # noqa: E402
from engine.report import dump  # noqa: E402
from envs import ENVS, make_env  # noqa: E402

torch.set_num_threads(1)  # on 2-core machines, 2 threads made small-model forward+backward erratic and slower

SEEDS = list(range(123, 139))


def chaotic_model(tok, seed: int):
    """An untrained model with large random weights (initializer_range 0.2) on the small tokenizer: its greedy
    replies depend on the context, so rows of one batch stop at different lengths and episodes end at different
    turns (the trained tiny prior's greedy reply is nearly the same for every prompt). The tags, moves and
    separator get larger output embeddings so that some replies parse and act."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)).eval()
    with torch.no_grad():
        for piece in (" </think>", " <answer>", " </answer>", " Up", " Down", " Left", " Right", " ||"):
            model.get_output_embeddings().weight[tok.convert_tokens_to_ids(piece)] *= 3
    return model


@pytest.fixture(scope="session")
def chaotic(small):
    return chaotic_model(small[1], 0), small[1]


def sample(small, env, cfg, seeds=SEEDS, seed=0):
    model, tok = small
    return R.rollout(env, seeds, list(range(len(seeds))), cfg, tokenizer=tok, model=model,
                     generator=torch.Generator().manual_seed(seed))


def runs(mask):
    """[(start, end)] of the maximal stretches of 1s."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def reply_text(tok, ids):
    """The reply text of sampled ids: a final end-of-turn token belongs to the template, not the text."""
    if ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids)


# ----------------------------------------------------------------------------- parser and turn rules

@pytest.mark.parametrize("text, think, k, expected", [
    ("<think> go left </think> <answer> Left || Up </answer>", True, 5, (["Left", "Up"], True)),   # well-formed
    ("<think> a </think>\n\n<answer>Up</answer>", True, 5, (["Up"], True)),                        # \s* between
    ("Sure! <think> a </think> <answer> Up </answer> Done.", True, 5, (["Up"], True)),             # text around
    ("<answer> Up </answer>", False, 5, (["Up"], True)),                                           # no-think
    ("<think> a </think> <answer> Up </answer>", False, 5, (["Up"], True)),                        # extra thought
    ("<think> a <answer> Up </answer>", True, 5, ([], False)),                                     # no </think>
    ("<answer> Up </answer>", True, 5, ([], False)),                                               # no thought
    ("<think> a </think> Up", True, 5, ([], False)),                                               # no answer
    ("<think> a </think> <answer> Up", True, 5, ([], False)),                                      # unclosed
    ("<think> a </think> so <answer> Up </answer>", True, 5, ([], False)),                         # text between
    ("Up || Down", False, 5, ([], False)),                                                         # no tags
    ("<ANSWER> Up </ANSWER>", False, 5, ([], False)),                                              # tags: exact
    ("<answer> Jump || Up </answer>", False, 5, (["Jump", "Up"], True)),                           # unknown kept
    ("<answer> A || B || C || D || E || F || G </answer>", False, 5, (["A", "B", "C", "D", "E"], True)),
    ("<answer> A || B || C </answer>", False, 2, (["A", "B"], True)),                              # budget left
    ("<answer> </answer>", False, 5, ([], True)),                                                  # empty
    ("<answer> || Up |||| left ||</answer>", False, 5, (["Up", "left"], True)),                    # empty pieces
    ("<answer>\n  up||DOWN \n</answer>", False, 5, (["up", "DOWN"], True)),                        # case, spaces
    ("<answer> Up </answer> <answer> Down </answer>", False, 5, (["Up"], True)),                   # first answer
])
def test_parse_reply(text, think, k, expected):
    assert R.parse_reply(text, think, k) == expected


def test_parse_reply_is_the_regex_match():
    """parse_reply finds what re.search of the answer pattern finds (it only avoids the regex's quadratic time on
    replies of many unclosed tags), on random soups of tags, words and separators."""
    import re
    patterns = {True: re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL),
                False: re.compile(r"<answer>(.*?)</answer>", re.DOTALL)}
    pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "Up", " || ", "x", "<", ">"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        for think, pattern in patterns.items():
            m = pattern.search(text)
            want = ([], False) if m is None else \
                ([a.strip() for a in m.group(m.lastindex).split("||") if a.strip()][:3], True)
            assert R.parse_reply(text, think, 3) == want, (text, think)
    long = "<think>" * 150_000 + "</think> <answer> Up </answer>"      # ~1 MB: a regex search takes minutes
    assert R.parse_reply(long, True, 5) == (["Up"], True)


def act(env_name, reply, think=False, left=10, **cfg):
    env = make_env(env_name)
    obs = env.reset(1000)
    return R.act_turn(env, reply, left, R.RolloutConfig(think=think, **cfg), obs, n_tok=3)


def test_turn_rules_and_format_penalty():
    ok = act("frozenlake", "<answer> Left </answer>")
    assert ok.parsed and ok.format_ok and ok.reward == ok.env_reward and ok.valid == 1
    # names match case-insensitively and with spaces (the env's matching)
    t = act("sokoban", "<answer>  up ||DOWN|| left </answer>")
    assert t.format_ok and t.valid == 3 and t.actions == ["up", "DOWN", "left"]
    # an unknown action: the penalty once per turn, the valid actions still run
    t = act("sokoban", "<answer> Up || Jump || Down || Fly </answer>")
    assert t.parsed and not t.format_ok and t.valid == 2 and len(t.actions) == 4
    assert t.reward == pytest.approx(t.env_reward - 0.1)
    # unparsable and empty: no action, the penalty
    for reply in ("<think> x </think> Up", "<answer> </answer>"):
        t = act("sokoban", reply, think=reply.startswith("<think>"))
        assert t.actions == [] and not t.format_ok and t.reward == pytest.approx(-0.1)
    # more actions than allowed per turn / left in the episode: only the first ones run
    assert len(act("sokoban", "<answer> Up || Up || Up || Up </answer>", max_actions_per_turn=3).actions) == 3
    assert len(act("sokoban", "<answer> Up || Up || Up || Up </answer>", left=2).actions) == 2
    # a finished episode runs nothing more: Bandit ends after one pull, the second arm is not pulled
    t = act("bandit", "<answer> Dragon || Phoenix </answer>")
    assert t.actions == ["Dragon"] and t.format_ok
    assert act("sokoban", "<answer> Up </answer>", format_penalty=-0.5).reward == pytest.approx(-0.1)  # env only
    assert act("sokoban", "<answer> Jump </answer>", format_penalty=-0.5).reward == pytest.approx(-0.5)


# ----------------------------------------------------------------------------- tokens and the mask

@pytest.mark.parametrize("which, env, think", [("small", "sokoban", True), ("small", "sokoban", False),
                                               ("small", "bandit", True), ("chaotic", "sokoban", True)])
def test_mask_is_exactly_the_sampled_replies(request, which, env, think):
    model = request.getfixturevalue(which)           # the prior's replies, and garbage ones (any token at all)
    _, tok = model
    cfg = R.RolloutConfig(think=think, max_new_tokens=40)
    trajs = sample(model, env, cfg)
    close = R.turn_close(tok)
    opening = "<|im_start|>assistant\n" + R.prefill(cfg)
    for tr in trajs:
        seg, = tr.segments                                   # the paper's layout: one sequence per trajectory
        assert len(seg.input_ids) == len(seg.loss_mask) and set(seg.loss_mask) <= {0, 1}
        # token-for-token the conversation: the ids decode to the chat template's rendering of the messages
        assert tok.decode(seg.input_ids) == tok.apply_chat_template(tr.messages, tokenize=False)
        spans = runs(seg.loss_mask)
        assert len(spans) == len(tr.turns)
        for (a, b), turn in zip(spans, tr.turns):
            ids = seg.input_ids[a:b]
            assert b - a == turn.response_tokens
            assert R.prefill(cfg) + reply_text(tok, ids) == turn.reply       # masked-in = the model's reply
            # ... and nothing else: it sits right after the assistant opening and right before the close
            assert tok.decode(seg.input_ids[:a]).endswith(opening)
            if ids[-1] != tok.eos_token_id:
                assert tok.decode(seg.input_ids[b:]).startswith(close)
            assert turn.obs not in tok.decode(ids)


def test_no_response_mask_trains_every_token_after_the_system_message(small):
    """trained_mask: the sampled tokens by default; with response_mask=False (the paper's runs) every token after
    the system message, the boards, the feedback and the template included."""
    _, tok = small
    system = tok.apply_chat_template([{"role": "system", "content": R.SYSTEM_PROMPT}], tokenize=False)
    cfg = R.RolloutConfig(max_actions_per_turn=1)
    trajs = R.rollout("sokoban", SEEDS[:4], [0, 1, 2, 3], cfg, tokenizer=tok, agent=random_agent(random.Random(0)))
    for tr in [t for t in trajs if len(t.turns) > 1]:
        s = tr.segments[0]
        assert R.trained_mask(s) == s.loss_mask and tok.decode(s.input_ids[:s.system_len]) == system
        full = R.trained_mask(s, response_mask=False)
        assert full == [0] * s.system_len + [1] * (len(s.input_ids) - s.system_len)
        extra = tok.decode([i for i, a, b in zip(s.input_ids, full, s.loss_mask) if a and not b])
        assert "State:" in extra and "Reward:" in extra and "<|im_start|>assistant" in extra


# ----------------------------------------------------------------------------- budgets

def test_budgets_are_never_exceeded(small):
    cfg = R.RolloutConfig(max_turns=3, max_actions_per_turn=2, max_actions=3, max_new_tokens=40)
    trajs = sample(small, "sokoban", cfg)
    proposed = [len(R.parse_reply(t.reply, cfg.think, 99)[0]) for tr in trajs for t in tr.turns]
    assert max(proposed) > cfg.max_actions_per_turn                      # the model asked for more ...
    assert any(len(tr.turns) == cfg.max_turns for tr in trajs)
    for tr in trajs:                                                     # ... and never got it
        assert len(tr.turns) <= cfg.max_turns
        assert all(len(t.actions) <= cfg.max_actions_per_turn for t in tr.turns)
        assert tr.valid_actions <= cfg.max_actions
        done_at = [k for k in range(len(tr.turns)) if sum(t.valid for t in tr.turns[:k + 1]) >= 3]
        if done_at:                                                      # the budget ends the episode
            assert len(tr.turns) == done_at[0] + 1
    # a scripted agent that always asks for 7 actions: 2 + 1 actions in 2 turns, then the episode ends
    greedy = lambda env, left, c: (["Up"] * 7, "more")  # noqa: E731
    tr, = R.rollout("sokoban", [1000], [0], cfg, agent=greedy)
    assert [len(t.actions) for t in tr.turns] == [2, 1]
    # unknown words change nothing and, as in RAGEN, use none of the budget (each turn still pays the penalty)
    clumsy = lambda env, left, c: (["Jump", "Up"], "oops")  # noqa: E731
    tr, = R.rollout("sokoban", [1000], [0], cfg, agent=clumsy)
    assert [(t.actions, t.valid) for t in tr.turns] == [(["Jump", "Up"], 1)] * 3
    assert all(not t.format_ok for t in tr.turns)
    # max_turns ends it too: unparsable replies execute nothing but count as turns
    mute = lambda env, left, c: ([], "nothing")  # noqa: E731
    tr, = R.rollout("sokoban", [1000], [0], cfg, agent=mute)
    assert len(tr.turns) == 3 and tr.num_actions == 0 and tr.reward == pytest.approx(-0.3)


def test_an_episode_ends_before_it_outgrows_the_models_positions(small):
    """With budgets that would run past the positions a model reads, each episode stops before the turn whose
    prompt + reply budget does not fit (Trajectory.truncated, counted by eval.summarize), never past it."""
    model, tok = small
    model = copy.deepcopy(model)
    model.config.max_position_embeddings = 420
    cfg = R.RolloutConfig(max_turns=50, max_actions=500, max_new_tokens=40)
    trajs = R.rollout("sokoban", SEEDS[:6], list(range(6)), cfg, tokenizer=tok, model=model,
                      generator=torch.Generator().manual_seed(0))
    assert any(t.truncated for t in trajs)
    for t in trajs:
        assert len(t.segments[0].input_ids) <= 420
        assert t.truncated or t.done or len(t.turns) == 50
    from eval import summarize
    assert summarize(trajs)["truncated"] == sum(t.truncated for t in trajs) / 6


# ----------------------------------------------------------------------------- history window

@pytest.mark.parametrize("K", [1, 2])
def test_context_window_gives_one_segment_per_turn(small, K):
    _, tok = small
    cfg = R.RolloutConfig(context_turns=K, max_new_tokens=30)
    trajs = sample(small, "sokoban", cfg, SEEDS[:6])
    assert any(len(tr.turns) > K + 1 for tr in trajs)                     # some windows really dropped turns
    for tr in trajs:
        assert len(tr.segments) == len(tr.turns)
        msgs = tr.messages
        first_user = msgs[1]["content"]
        header = first_user[:first_user.index("Turn 1:")]
        users = [first_user[len(header):]] + [m["content"] for m in msgs[3::2]]
        replies = [m["content"] for m in msgs[2::2]]
        for k, (seg, turn) in enumerate(zip(tr.segments, tr.turns)):
            first = max(0, k + 1 - K)
            window = [{"role": "system", "content": R.SYSTEM_PROMPT}]
            for t in range(first, k + 1):
                window += [{"role": "user", "content": (header if t == first else "") + users[t]},
                           {"role": "assistant", "content": replies[t]}]
            # a valid prompt (system, instruction, the last K turns) + that turn's reply, nothing else
            assert tok.decode(seg.input_ids) == tok.apply_chat_template(window, tokenize=False)
            (a, b), = runs(seg.loss_mask)
            assert R.prefill(cfg) + reply_text(tok, seg.input_ids[a:b]) == turn.reply
            assert b - a == turn.response_tokens


# ----------------------------------------------------------------------------- agents, dump, errors

def test_random_agent_takes_only_valid_actions_on_every_env():
    cfg = R.RolloutConfig()
    for name in sorted(ENVS):
        trajs = R.rollout(name, SEEDS, list(range(len(SEEDS))), cfg, agent=random_agent(random.Random(0)))
        assert all(t.format_ok for tr in trajs for t in tr.turns), name
        assert sum(tr.valid_actions for tr in trajs) == sum(tr.num_actions for tr in trajs) > 0, name
        assert all(tr.num_actions <= cfg.max_actions and len(tr.turns) <= cfg.max_turns for tr in trajs)
    bandit = R.rollout("bandit", list(range(1000, 1200)), [0] * 200, cfg, agent=random_agent(random.Random(1)))
    assert all(tr.num_actions == 1 for tr in bandit)
    assert 0.4 < sum(tr.success for tr in bandit) / 200 < 0.6       # the arms uniformly


def test_expert_agent_and_scripted_reply():
    cfg = R.RolloutConfig()
    tr, = R.rollout("bandit", [1000], [0], cfg, agent=expert_agent())
    assert tr.success and tr.turns[0].actions == ["Dragon"] and tr.turns[0].format_ok
    text = R.scripted_reply(["Up", "Left"], "a plan", cfg)
    assert R.parse_reply(R.prefill(cfg) + text, True, 5) == (["Up", "Left"], True)
    nothink = R.RolloutConfig(think=False)
    assert R.parse_reply(R.prefill(nothink) + R.scripted_reply(["Up"], "x", nothink), False, 5) == (["Up"], True)


def test_dump_and_trajectory_fields(small):
    _, tok = small
    tr = sample(small, "sokoban", R.RolloutConfig(max_new_tokens=30), SEEDS[:2])[0]
    text = dump(tr, tok)
    assert text.startswith(f"=== env=sokoban seed={SEEDS[0]} group=0")
    assert all(m["content"].rstrip() in text for m in tr.messages)
    assert text.count("[turn ") == len(tr.turns)
    assert tr.reward == pytest.approx(sum(t.reward for t in tr.turns))
    assert tr.num_actions == sum(len(t.actions) for t in tr.turns) and tr.valid_actions <= tr.num_actions


def test_rollout_needs_exactly_one_of_model_or_agent(small):
    model, tok = small
    with pytest.raises(ValueError, match="exactly one"):
        R.rollout("sokoban", [1], [0], R.RolloutConfig())
    with pytest.raises(ValueError, match="exactly one"):
        R.rollout("sokoban", [1], [0], R.RolloutConfig(), tokenizer=tok, model=model, agent=expert_agent())


def test_rollout_takes_env_objects_one_per_seed():
    """`env` may be one env object per seed (a wrapper, a relabelled room): the same episodes as by name."""
    cfg = R.RolloutConfig(max_turns=3)
    by_name = R.rollout("sokoban", [2000, 2001], [0, 1], cfg, agent=expert_agent(2))
    by_obj = R.rollout([make_env("sokoban"), make_env("sokoban")], [2000, 2001], [0, 1], cfg,
                       agent=expert_agent(2))
    assert [t.messages for t in by_name] == [t.messages for t in by_obj]
    assert [t.env for t in by_obj] == ["sokoban", "sokoban"]
