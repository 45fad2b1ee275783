"""Tests for hindsight.py (GCSL, beyond the paper): loop-free turns, relabelled demos, the supervised step, resume.

    python -m pytest -q tests/test_hindsight.py
"""
import copy
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extras import hindsight as H  # noqa: E402
from engine import models as policy  # noqa: E402
import rollout as R  # noqa: E402
from eval import expert_agent, random_agent  # noqa: E402
from engine.logprobs import pad_segments  # noqa: E402
import envs  # noqa: E402
from envs import make_env  # noqa: E402
from test_envs import parse_sokoban  # noqa: E402

torch.set_num_threads(1)


def gcsl_rendering(think: bool = False) -> R.RolloutConfig:
    """The GCSL recipe's rendering (hindsight.py's command): one move per turn, a one-turn window."""
    return R.RolloutConfig(temperature=1.0, think=think, context_turns=1, max_turns=10, max_actions_per_turn=1)


def test_loop_free_turns_cut_every_return_to_a_visited_state():
    """A turn that leads back to a state the episode was in is cut with the turns in between: the kept turns visit
    no state twice and end where the rollout ended."""
    env = make_env("sokoban")
    rcfg = gcsl_rendering()
    trajs = R.rollout("sokoban", list(range(5000, 5016)), list(range(16)), rcfg,
                      agent=random_agent(random.Random(1)))
    cut = 0
    for t in trajs:
        kept = H.loop_free_turns(env, t)
        cut += len(t.turns) - len(kept)
        env.reset(t.seed)
        states = [env.render()]
        for k in kept:
            for a in t.turns[k].actions:
                env.step(a)
            states.append(env.render())
        assert len(set(states)) == len(states)  # no state twice on the loop-free path
        env.reset(t.seed)
        for turn in t.turns:
            for a in turn.actions:
                env.step(a)
        assert env.render() == states[-1]  # it ends where the rollout ended
    assert cut > 0  # random moves bump and loop: the test sees cuts


def sources_and_goals(trajs, env_name="sokoban"):
    """The rollouts a demo is made of, each with the goal it demonstrates (None: it solved its own room)."""
    sim, out = H.goal_env(env_name, {}), []
    for t in trajs:
        turns = H.loop_free_turns(sim, t)
        goal = None if t.success else sim.reached_goal()
        if turns and (goal is not None or t.success):
            out.append((t, goal, turns))
    return out


def test_hindsight_demos_replay_each_moving_rollout_as_a_success_with_rendered_replies(small):
    """--hindsight-imitation's data (GCSL): one demo per rollout that moved the box or solved the room, in its
    own room with the target where it left the box (a solved room keeps its own), every demo a success; its
    replies are the loop-free turns' actions rendered as RAGEN re-renders a parsed reply, one row per turn."""
    _, tok = small
    rcfg = gcsl_rendering()
    seeds = [6000 + g for g in range(8) for _ in range(4)]
    trajs = R.rollout("sokoban", seeds, [g for g in range(8) for _ in range(4)], rcfg, tokenizer=tok,
                      agent=random_agent(random.Random(2)))
    demos = H.hindsight_demos("sokoban", trajs, tok, rcfg, {})
    sources = sources_and_goals(trajs)
    assert len(demos) == len(sources) >= 10 and all(d.success for d in demos)
    assert any(goal is not None for _, goal, _ in sources)
    for d, (t, goal, kept) in zip(demos, sources):
        room = H.goal_env("sokoban", {}, goal)
        assert d.seed == t.seed and d.turns[0].obs == room.reset(t.seed)  # the relabelled room
        rendered = [R.scripted_reply(t.turns[k].actions, "", rcfg) for k in kept]
        trained = [[i for i, m in zip(seg.input_ids, seg.loss_mask) if m] for seg in d.segments]
        assert trained == [tok(r, add_special_tokens=False).input_ids for r in rendered][:len(d.turns)]
        assert len(d.segments) == len(d.turns)  # a one-turn window: one row per turn


def test_hindsight_demos_with_think_say_what_the_relabelled_board_shows(small):
    """With --think a demo's thought is rewritten in the expert's words and is true of the replayed room: where
    the player and box are and the target where the rollout left the box, the first push of the demo's moves
    from there, the turn's moves. The sampled thought read the original target: keeping it teaches a
    misreading."""
    _, tok = small
    rcfg = gcsl_rendering(think=True)
    seeds = [6100 + g for g in range(8) for _ in range(4)]
    trajs = R.rollout("sokoban", seeds, [g for g in range(8) for _ in range(4)], rcfg, tokenizer=tok,
                      agent=random_agent(random.Random(3)))
    demos = H.hindsight_demos("sokoban", trajs, tok, rcfg, {})
    sources = sources_and_goals(trajs)
    assert sum(goal is not None for _, goal, _ in sources) >= 5 and all(d.success for d in demos)
    for d, (_, goal, _) in zip(demos, sources):
        env = H.goal_env("sokoban", {}, goal)
        env.reset(d.seed)
        for turn in d.turns:
            thought = turn.reply.split("</think>")[0].removeprefix("<think>").strip()
            assert thought.startswith(env.describe() + ".")
            if goal is not None:
                assert f"target at {goal[0] // env.size + 1} {goal[0] % env.size + 1}" in thought
            assert thought.endswith("I pick my moves: " + ", ".join(turn.actions) + ".")
            for a in turn.actions:
                if not env.done:
                    env.step(a)
        assert env.done  # the replay solves the relabelled room


def test_imitation_demos_best_keeps_each_rooms_shortest_solved_rollout(small):
    """--imitation-demos best (expert iteration / rejection sampling): one demo per room that some rollout
    solved, that of the fewest actions (the first of equals), in its own room, its loop-free turns; no
    relabelling."""
    _, tok = small
    rcfg = gcsl_rendering()
    rng = random.Random(13)

    def noisy_expert(env, actions_left, cfg):  # solves some rooms, in more or fewer moves
        return [env.expert_action() if rng.random() < 0.35 else rng.choice(env.actions)], ""

    groups = [6200 + g for g in range(10)]
    trajs = R.rollout("sokoban", [s for s in groups for _ in range(4)], [g for g in range(10) for _ in range(4)],
                      rcfg, tokenizer=tok, agent=noisy_expert)
    n_actions = [sum(len(turn.actions) for turn in t.turns) for t in trajs]
    want = {}
    for t, n in zip(trajs, n_actions):
        if t.success and (t.group_id not in want or n < want[t.group_id][0]):
            want[t.group_id] = (n, t)
    assert 2 <= len(want) < 10  # some rooms solved, some not: the test tells the two apart
    env = make_env("sokoban")

    def moves(t):
        return [t.turns[k].actions for k in H.loop_free_turns(env, t)]
    assert any(len({str(moves(t)) for t in trajs if t.group_id == g and t.success}) > 1 for g in want)  # a choice
    demos = H.hindsight_demos("sokoban", trajs, tok, rcfg, {}, demos="best")
    assert [d.seed for d in demos] == [t.seed for _, t in want.values()]
    for d, (_, t) in zip(demos, want.values()):
        assert d.success and d.turns[0].obs == make_env("sokoban").reset(t.seed)  # its own room
        assert [turn.actions for turn in d.turns] == moves(t)


def test_sokoban_note_names_the_first_push_of_any_moves():
    """A demo's thought (`note(moves)`) says where things are, then the first of the moves that pushes the box
    (bumps and steps first are skipped); on the expert's own plan it is `expert_note()`."""
    env = H.goal_env("sokoban", {})
    env.reset(1234)  # player at 4 5, box at 4 4, a wall above the box's left
    assert env.note(["Up", "Left", "Down", "Left"]) == env.describe() + ". I push the box Left: I go to 4 5"
    assert env.note(["Up", "Down"]) == env.describe()  # no push
    assert env.note(["Left"]) == env.expert_note()


def test_imitate_takes_the_supervised_step(small):
    """Hindsight imitation is supervised learning: one mini-batch, plain SGD and no clipping move the weights by
    exactly -lr x the gradient of the token-mean negative log-likelihood of the demos' replies."""
    from starpo import UpdateConfig
    model, tok = copy.deepcopy(small[0]), small[1]
    rcfg = gcsl_rendering()
    trajs = R.rollout("sokoban", [7000, 7001, 7002], [0, 1, 2], rcfg, tokenizer=tok,
                      agent=random_agent(random.Random(0)))
    demos = H.hindsight_demos("sokoban", trajs, tok, rcfg, {})
    rows = [s for d in demos for s in d.segments]
    assert 0 < len(rows) <= 64
    ref = copy.deepcopy(model).float()
    ids, attn, mask = pad_segments(rows, tok.pad_token_id)
    logits = ref(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    ((nll * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = H.imitate(demos, 1, model, opt, UpdateConfig(mini_batch=64, max_grad_norm=1e9), tok.pad_token_id, True,
                  torch.Generator().manual_seed(0), None)
    assert m["imitation/optimizer_steps"] == 1 and m["imitation/rows"] == len(rows)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        before = dict(small[0].named_parameters())[name]
        torch.testing.assert_close(p - before, -0.1 * q.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_a_run_with_hindsight_imitation_resumes_as_if_uninterrupted(small, tmp_path):
    """The imitation's optimizer is checkpointed: 2 iterations, then --resume to 3, log what 3 uninterrupted log."""
    import json
    import train
    model, tok = small
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    common = ["--env", "sokoban", "--model", str(tmp_path / "m"), "--hindsight-imitation", "2", "--no-think",
              "--context-turns", "1", "--max-turns", "6", "--max-actions-per-turn", "1", "--prompts", "8",
              "--rollouts", "2", "--filter", "0.5", "--lr", "1e-3", "--eval-every", "0", "--eval-prompts", "4",
              "--save-every", "1", "--dump-trajectories", "0"]
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "a")])
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "b")])
    train.main(["--resume", str(tmp_path / "b"), "--steps", "3"])
    a, b = ([json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab")
    assert [r["step"] for r in b] == [1, 2, 3] and all(r["imitation/optimizer_steps"] > 0 for r in a)
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if not k.startswith("time/"):
                assert rb[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (ra["step"], k)


SOKOBAN = {  # name -> (size, boxes, legend: wall, empty, target, box, box on target, player, player on target)
    "sokoban": (6, 1, "#_OX√PS"),
    "sokoban-newvocab": (6, 1, "W.GBCA@"),
    "sokoban-large": (8, 2, "#_OX√PS"),
}


@pytest.mark.parametrize("name", list(SOKOBAN))
def test_sokoban_hindsight_goal_is_where_the_boxes_were_left(name):
    """reached_goal() names the boxes' cells (None while none moved or on the room's own targets); a goal_env with
    that goal is the same room (walls, boxes and player) with the targets moved there, and the same moves now
    solve it."""
    size, nbox, legend = SOKOBAN[name]
    env, rng, relabelled = H.goal_env(name, {}), np.random.default_rng(2), 0
    for seed in envs.EVAL_SEEDS[:60]:
        start = env.reset(seed)
        assert env.reached_goal() is None
        moves = []
        for _ in range(20):
            moves.append(env.actions[rng.integers(4)])
            obs, _, done, _ = env.step(moves[-1])
            if done:
                break
        boxes = parse_sokoban(obs, legend)[2]
        goal = env.reached_goal()
        if done or boxes == parse_sokoban(start, legend)[2]:
            assert goal is None
            continue
        assert sorted(divmod(c, size) for c in goal) == sorted(boxes)
        env = H.goal_env(name, {}, goal)
        new = env.reset(seed)
        w0, t0, b0, p0, _ = parse_sokoban(start, legend)
        w1, t1, b1, p1, _ = parse_sokoban(new, legend)
        assert (w1, b1, p1) == (w0, b0, p0) and t1 == set(boxes)
        for word in moves:
            _, reward, done, info = env.step(word)
            if done:
                break
        assert done and info["success"] and reward > 9
        relabelled += 1
        env = H.goal_env(name, {})
    assert relabelled >= 10, relabelled
