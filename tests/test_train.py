"""train.py and eval.py end to end: smoke runs, resume equivalence, flag errors, JSONL keys, plots, monitor.

    python -m pytest -q tests/test_train.py

The runs use a small tiny-policy build (2 layers, hidden 64, bandit only, seconds to build) passed as --model, in
--no-think mode (where such a small warm-up already answers well enough to give rewards a spread), with budgets of
a few iterations. They call the script's main(argv) in this process (`run`), but for the smoke tests, which start
the real scripts as `python` would.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train  # noqa: E402

KEYS = ["rollout/reward_mean", "rollout/success", "rollout/in_group_std", "rollout/chosen_in_group_std",
        "rollout/filter_kept", "rollout/zero_std_groups", "rollout/response_length", "rollout/valid_action",
        "rollout/effective_action", "train/entropy", "train/grad_norm", "train/kl_to_init", "train/pg_clipfrac",
        "train/skipped_nonfinite", "time/rollout", "time/iteration"]


IN_PROCESS = {"train.py", "eval.py", "sft_baseline.py"}


def run(args, cwd, check=True, fresh=False):
    """`python SCRIPT ARGS` in `cwd` -> (returncode, stdout, stderr). An entry script runs in this process
    (its main(ARGS), as `python` would call it: saves the ~2 s start of a Python with torch, per run) unless
    `fresh`; the smoke tests start the real script, once per script."""
    if Path(args[0]).name in IN_PROCESS and not fresh:
        p = run_main(Path(args[0]).stem, args[1:], cwd)
    else:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        p = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p


def run_main(module: str, argv: list[str], cwd) -> SimpleNamespace:
    """main(argv) of an entry script, here: its exit code (SystemExit's; 0 when it returns), what it printed;
    the working folder and torch's thread count as they were."""
    import importlib
    here, threads = os.getcwd(), torch.get_num_threads()
    out, err, code = io.StringIO(), io.StringIO(), 0
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            importlib.import_module(module).main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(here)
        torch.set_num_threads(threads)
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def read_jsonl(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def test_train_smoke_writes_metrics_dumps_checkpoint_and_final(bandit_tiny, tmp_path):
    out = tmp_path / "run"
    run([str(ROOT / "train.py"), "--env", "bandit", "--no-think", "--model", bandit_tiny, "--lr", "1e-3",
         "--steps", "2", "--prompts", "8", "--rollouts", "4", "--filter", "0.5", "--eval-every", "2",
         "--eval-prompts", "8", "--out", str(out)], tmp_path, fresh=True)
    start, *rows = read_jsonl(out / "metrics.jsonl")
    assert start["step"] == 0 and "eval/success" in start  # the start's eval: the level the run must beat
    assert (out / "trajectories-000000.txt").is_file()
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if r["train/skipped_zero_std"] == 0]
    assert trained, "the small policy should give some reward spread on bandit"
    for k in KEYS:
        assert k in trained[0] or k == "train/kl_to_init", k
    # with --kl-coef 0 the reference runs only on the iterations that evaluate (here 2), to feed the KL monitor
    assert all(("train/kl_to_init" in r) == ("eval/success" in r) for r in trained)
    assert "eval/success" in rows[-1] and 0 <= rows[-1]["eval/success_lo"] <= rows[-1]["eval/success_hi"] <= 1
    assert (out / "trajectories-000002.txt").read_text().startswith("=== env=bandit")
    assert (out / "latest").read_text().strip() == "ckpt-000002"
    final = out / "final"
    assert (final / "config.json").exists() and (final / "train_config.json").exists()
    # eval.py loads the final policy with the run's own rollout settings
    p = run([str(ROOT / "eval.py"), "--env", "bandit", "--policy", str(final), "--prompts", "8",
             "--json", str(tmp_path / "e.json")], tmp_path, fresh=True)
    assert "| bandit |" in p.stdout
    assert json.loads((tmp_path / "e.json").read_text())["rollout"]["bandit"]["max_turns"] == 5


@pytest.mark.end_to_end
@pytest.mark.parametrize("levers", [[], ["--lora-rank", "4", "--grad-checkpoint", "--kl-coef", "0.01"]])
def test_resume_reproduces_an_uninterrupted_run(bandit_tiny, tmp_path, levers):
    """Also with the memory levers: LoRA adapters (saved in state.pt, the policy merged) and activation
    checkpointing resume exactly, with a KL term to the adapters-off reference, and a LoRA run's final/ is a plain
    model that moved off its base."""
    common = [str(ROOT / "train.py"), "--env", "bandit", "--no-think", "--algo", "ppo", "--model", bandit_tiny,
              "--lr", "1e-3", "--critic-lr", "1e-3", "--prompts", "8", "--rollouts", "4", "--filter", "0.5",
              "--eval-every", "0", "--eval-prompts", "4", "--save-every", "2", *levers]
    run(common + ["--steps", "3", "--out", str(tmp_path / "a")], tmp_path)
    run(common + ["--steps", "2", "--out", str(tmp_path / "b")], tmp_path)
    p = run([str(ROOT / "train.py"), "--resume", str(tmp_path / "b"), "--steps", "3"], tmp_path)
    assert "resumed from" in p.stdout
    a, b = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert any("train/value_loss" in r for r in a), "PPO must train its critic at least once"
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if not k.startswith("time/"):
                assert rb[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (ra["step"], k)
    if levers:
        from engine.models import load_policy
        final, base = load_policy(str(tmp_path / "a" / "final"))[0], load_policy(bandit_tiny)[0]
        fw, bw = final.state_dict(), base.state_dict()
        assert fw.keys() == bw.keys()
        assert not torch.equal(fw["model.layers.0.self_attn.q_proj.weight"], bw["model.layers.0.self_attn.q_proj.weight"])
        assert torch.equal(fw["model.norm.weight"], bw["model.norm.weight"])  # frozen outside the adapters


@pytest.mark.parametrize("args,needle", [
    (["--filter", "1.5"], "--filter 1.5"),
    (["--algo", "dpo"], "--algo"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--eval-prompts", "300"], "--eval-prompts 300"),
    (["--model", "/nonexistent/folder"], "--model '/nonexistent/folder'"),
    (["--lora-rank", "-2"], "--lora-rank -2"),
    (["--lora-rank", "100000"], "--lora-rank 100000: must be <= the model's hidden size"),
    (["--filter-strategy", "top_q"], "--filter-strategy"),
    (["--filter-metric", "reward_max"], "--filter-metric"),
    (["--filter-strategy", "top_p", "--filter", "1.5"], "--filter 1.5: must be <= 1 with --filter-strategy top_p"),
    (["--filter-strategy", "top_k_abs", "--filter", "2.5"], "--filter 2.5: --filter-strategy top_k_abs keeps a whole"),
    (["--bi-level-gae"], "--bi-level-gae: PPO only"),
    (["--turn-rewards"], "--turn-rewards: PPO only"),
    (["--collapse-every", "5", "--no-think"], "--collapse-every 5: needs think mode"),
    (["--dual-clip", "0.5"], "--dual-clip 0.5: must be > 1"),
    (["--dual-clip", "1"], "--dual-clip 1.0: must be > 1"),
    pytest.param(["--memory-cap", "24"], "--memory-cap 24: caps CUDA memory",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="on CPU only")),
])
def test_bad_flag_values_give_one_error_line(args, needle, tmp_path):
    p = run([str(ROOT / "train.py"), *args, "--out", str(tmp_path / "x")], tmp_path, check=False)
    assert p.returncode == 2
    err = [l for l in p.stderr.splitlines() if l.strip()]
    assert "Traceback" not in p.stderr
    assert needle in err[-1], p.stderr


def test_presets_and_explicit_flags():
    from engine import cli
    cfg, explicit = cli.parse(train.Config, ["--preset", "starpo"], presets=train.PRESETS)
    assert (cfg.filter, cfg.kl_coef, cfg.clip_high) == (1.0, 0.001, 0.2)
    cfg, _ = cli.parse(train.Config, ["--preset", "starpo", "--clip-high", "0.3"], presets=train.PRESETS)
    assert cfg.clip_high == 0.3 and cfg.filter == 1.0
    cfg = train.derive(cli.parse(train.Config, [], presets=train.PRESETS)[0])
    assert (cfg.filter, cfg.kl_coef, cfg.clip_low, cfg.clip_high, cfg.groups) == (0.25, 0.0, 0.2, 0.28, 8)
    assert cfg.lr == train.MODEL_DEFAULTS["tiny"]["lr"] and cfg.micro_batch == 16
    assert train.derive(cli.parse(train.Config, ["--micro-batch", "2"])[0]).micro_batch == 2
    cfg = train.derive(cli.parse(train.Config, ["--model", "Qwen/Qwen2.5-0.5B-Instruct"])[0])
    assert (cfg.lr, cfg.critic_lr, cfg.micro_batch) == (1e-6, 1e-5, 4)


def test_the_main_command_runs_the_papers_starpo_s_on_every_model():
    """No model has a rendering or batch of its own (issue 41): the paper's everywhere; only sizes differ."""
    from engine import cli
    parse = lambda args: train.derive(cli.parse(train.Config, args, presets=train.PRESETS)[0])  # noqa: E731
    keys = ("think", "context_turns", "max_turns", "max_actions_per_turn", "max_actions", "prompts", "rollouts",
            "filter", "kl_coef", "clip_low", "clip_high", "format_penalty", "hindsight_imitation")
    paper = (True, 0, 5, 5, 10, 8, 16, 0.25, 0.0, 0.2, 0.28, -0.1, 0)
    get = lambda c: tuple(getattr(c, k) for k in keys)  # noqa: E731
    main = parse(["--env", "sokoban", "--algo", "grpo", "--filter", "0.25"])
    for args in ([], ["--env", "bandit"], ["--model", "Qwen/Qwen2.5-0.5B-Instruct"], ["--preset", "starpo-s"]):
        assert get(parse(args)) == paper == get(main), args
    assert (main.steps, main.eval_prompts, main.imitation_lr) == (30, 128, 2.5e-4)
    hub = parse(["--model", "Qwen/Qwen2.5-0.5B-Instruct"])
    assert (hub.steps, hub.eval_prompts, hub.imitation_lr, hub.max_new_tokens) == (200, 256, 5e-4, 400)
    assert train.describe(main, "cpu") == ("StarPO-S: GRPO, top 25% of 8 groups by reward std, no KL, clip 0.2/0.28 "
                                           "| sokoban | tiny policy | cpu")
    starpo = parse(["--preset", "starpo", "--algo", "ppo", "--env", "bandit"])
    assert train.describe(starpo, "cuda").startswith("StarPO: PPO, all 8 groups by reward std, KL 0.001 (in the "
                                                     "rewards), clip 0.2/0.2 | bandit")
    gcsl = parse(["--hindsight-imitation", "3", "--no-think", "--max-actions-per-turn", "1"])
    assert "+ hindsight imitation x3 (GCSL, beyond the paper)" in train.describe(gcsl, "cpu")
    assert train.describe(parse(["--filter", "1.0"]), "cpu").startswith("StarPO (modified): GRPO, all 8 groups")
    assert parse(["--preset", "starpo", "--max-turns", "10"]).max_turns == 10


def test_a_trained_model_folder_lends_its_rendering_unless_a_flag_is_typed(tmp_path, capsys):
    from engine import cli
    (tmp_path / "train_config.json").write_text(json.dumps({"context_turns": 1, "think": False, "lr": 3.0,
                                                            "max_new_tokens": 60}))
    parse = lambda args: train.inherit_rendering(*cli.parse(train.Config, args), train.ROLLOUT_KEYS)  # noqa
    cfg = parse(["--model", str(tmp_path)])
    assert (cfg.context_turns, cfg.think, cfg.max_new_tokens, cfg.lr) == (1, False, 60, None)  # rendering only
    assert "rollout settings of" in capsys.readouterr().out
    cfg = parse(["--model", str(tmp_path), "--context-turns", "0", "--think"])
    assert (cfg.context_turns, cfg.think, cfg.max_new_tokens) == (0, True, 60)
    assert parse([]).context_turns == 0  # the embedded policy has no saved settings: the paper's


def test_plot_writes_png(bandit_tiny, tmp_path):
    # run b: a perfect eval whose Wilson bound came out a rounding error below 1 (it crashed the plot once)
    for name, std, ev in (("a", 0.5, (0.2, 0.1, 0.3)), ("b", 0.05, (1.0, 0.97, 1 - 1e-16))):
        d = tmp_path / name
        d.mkdir()
        rows = [{"step": i, "rollout/reward_mean": 0.1 * i, "rollout/in_group_std": std, "train/grad_norm": 1.0,
                 "train/entropy": 2.0, **(dict(zip(("eval/success", "eval/success_lo", "eval/success_hi"), ev))
                                          if i % 2 == 0 else {})} for i in range(1, 7)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "p.png"
    run([str(ROOT / "tools" / "plot.py"), str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(png)],
        tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # issue 61: an existing PNG is replaced only with --overwrite; a run's start (iteration 0) is drawn dashed
    again = [str(ROOT / "tools" / "plot.py"), str(tmp_path / "a"), "--out", str(png)]
    assert run(again, tmp_path, check=False).returncode == 2
    start = {"step": 0, "eval/success": 0.15, "eval/success_lo": 0.1, "eval/success_hi": 0.2}
    lines = (tmp_path / "a" / "metrics.jsonl").read_text()
    (tmp_path / "a" / "metrics.jsonl").write_text(json.dumps(start) + "\n" + lines)
    run(again + ["--overwrite"], tmp_path)
    from tools.plot import plot_runs
    import matplotlib.pyplot as plt
    real_close, drawn = plt.close, []
    plt.close = lambda fig=None: drawn.append(fig) or real_close(fig)
    try:
        plot_runs([str(tmp_path / "a")], str(tmp_path / "q.png"))
    finally:
        plt.close = real_close
    eval_ax = drawn[0].axes[4]
    assert any(list(line.get_ydata()) == [0.15, 0.15] and line.get_linestyle() == "--" for line in eval_ax.lines)
    assert all(ax.get_ylabel() for ax in drawn[0].axes)


def test_paper_switches_in_config_and_help():
    """Each faithfulness switch: the preset's KL kind and placement, the group noise, the mask, the loss
    aggregation and the reply budget land in the config as the paper ran them, and --help names the paper's value."""
    from engine import cli
    parse = lambda args: train.derive(cli.parse(train.Config, args, presets=train.PRESETS)[0])  # noqa
    ppo = parse(["--preset", "starpo", "--algo", "ppo"])
    assert (ppo.kl_coef, ppo.kl_kind, ppo.kl_in_reward, ppo.filter, ppo.clip_high) == (0.001, "k1", True, 1.0, 0.2)
    grpo = parse(["--preset", "starpo", "--algo", "grpo"])
    assert (grpo.kl_kind, grpo.kl_in_reward) == ("k1", False)  # GRPO: a KL loss term (RAGEN's kl_loss_type kl)
    s = parse(["--preset", "starpo-s", "--algo", "ppo"])
    assert (s.kl_coef, s.kl_in_reward, s.filter, s.clip_high) == (0.0, False, 0.25, 0.28)
    assert parse(["--no-kl-in-reward", "--preset", "starpo", "--algo", "ppo"]).kl_in_reward is False
    with pytest.raises(ValueError, match="--kl-in-reward"):
        parse(["--kl-in-reward", "--algo", "grpo"])
    d = parse([])
    assert (d.group_noise, d.response_mask, d.loss_agg, d.ppo_epochs, d.online_k) == \
        ("shared", True, "token-mean", 1, 1)
    assert parse(["--online-k", "3"]).groups == 3 * d.prompts
    hub = lambda env: parse(["--model", "Qwen/Qwen2.5-0.5B-Instruct", "--env", env]).max_new_tokens  # noqa: E731
    assert (d.max_new_tokens, hub("sokoban"), hub("bandit")) == (100, 400, 500)
    helptext = " ".join(train.cli.build_parser(train.Config, "").format_help().split())
    for needle in ("StarPO: 0.001", "RAGEN's `kl`", "with --preset starpo", "Online-k", "shared (RAGEN's)",
                   "as the paper's runs did", "the paper's 1/|tau| form", "hub models 400/500",
                   "the paper's runs: 1"):
        assert needle in helptext, needle
    for action in train.cli.build_parser(train.Config, "")._actions:  # one default a flag, never "None"
        assert (action.help or "").count("default:") <= 1 and "(default: None)" not in (action.help or "")


@pytest.mark.end_to_end
def test_switches_change_what_they_say(bandit_tiny, tmp_path):
    """--online-k 2 rolls out 2P prompts and takes twice the optimizer steps, each trajectory once; --ppo-epochs 2
    passes twice over P prompts' rollouts; --no-response-mask trains the prompt tokens too."""
    common = [str(ROOT / "train.py"), "--env", "bandit", "--no-think", "--model", bandit_tiny, "--lr", "1e-3",
              "--prompts", "4", "--rollouts", "4", "--filter", "1.0", "--mini-batch", "16", "--steps", "1",
              "--eval-every", "0", "--eval-prompts", "2", "--save-every", "0", "--group-noise", "independent"]
    rows = {}
    for name, extra in (("base", []), ("online2", ["--online-k", "2"]), ("epochs2", ["--ppo-epochs", "2"]),
                        ("allmask", ["--no-response-mask"])):
        run(common + extra + ["--out", str(tmp_path / name)], tmp_path)
        rows[name] = read_jsonl(tmp_path / name / "metrics.jsonl")[0]
    if rows["base"]["train/skipped_zero_std"]:
        pytest.skip("the small policy gave no reward spread on these prompts")
    assert (rows["base"]["train/rows"], rows["base"]["train/optimizer_steps"]) == (16, 1)
    assert (rows["online2"]["train/rows"], rows["online2"]["train/optimizer_steps"]) == (32, 2)
    assert (rows["epochs2"]["train/rows"], rows["epochs2"]["train/optimizer_steps"]) == (16, 2)
    assert rows["allmask"]["train/rows"] == 16 and rows["allmask"]["train/entropy"] != rows["base"]["train/entropy"]


@pytest.mark.end_to_end
def test_ragens_later_options_run_and_log(bandit_tiny, tmp_path):
    """RAGEN's later options in one PPO run (beyond the paper, each opt-in): RAGEN-2's top_p filter without zero
    groups, turn rewards with bi-level GAE, dual clip and the template-collapse metrics every iteration. The run
    says so in its first line, logs collapse/* with its cost, and an empty selection is skipped and logged; a run
    whose filter keeps nothing ends after --filter-empty-stop such iterations."""
    common = [str(ROOT / "train.py"), "--env", "bandit", "--model", bandit_tiny, "--algo", "ppo", "--prompts", "4",
              "--rollouts", "4", "--eval-every", "0", "--eval-prompts", "4", "--save-every", "0"]
    p = run(common + ["--steps", "2", "--filter-strategy", "top_p", "--filter", "0.9", "--no-filter-include-zero",
                      "--turn-rewards", "--bi-level-gae", "--dual-clip", "3", "--collapse-every", "1",
                      "--out", str(tmp_path / "a")], tmp_path)
    assert "StarPO-S (modified): PPO, top_p 0.9 of 4 groups by reward std" in p.stdout and "bi-level GAE" in p.stdout and "dual clip 3" in p.stdout
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    for r in rows:
        assert {"collapse/mi", "collapse/retrieval_acc", "collapse/retrieval_chance", "collapse/cond_entropy",
                "time/collapse"} <= set(r)
        assert -1e-3 <= r["collapse/mi"] <= r["collapse/mi_upper_bound"] + 1e-9  # an estimate: rounding
        assert ("train/pg_clipfrac_dual" in r) != bool(r["train/skipped_empty_filter"])
    from tools.plot import plot_runs  # two more panels, MI and prompt retrieval, for a run that measured them
    png = Path(plot_runs([str(tmp_path / "a")], str(tmp_path / "mi.png"))).read_bytes()
    assert int.from_bytes(png[16:20], "big") == round(3.6 * 7 * 110)
    # a filter that keeps nothing: top_p over the mean reward, every group scoring < 0 (one-token replies never
    # answer, so every turn pays the format penalty)
    p = run(common + ["--steps", "6", "--filter-strategy", "top_p", "--filter", "0.5", "--filter-metric",
                      "reward_mean", "--filter-empty-stop", "2", "--max-new-tokens", "1", "--out",
                      str(tmp_path / "b")], tmp_path)
    rows = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert len(rows) == 2 and all(r["train/skipped_empty_filter"] == 1 for r in rows)
    assert "the filter kept no group 2 iterations in a row" in p.stdout + p.stderr


def test_plot_labels_name_only_settings_two_runs_set_differently():
    """Issue 53.13: docs/main_command.png's legend said the seeds ran different code, because one run's config
    left a later opt-in unset (None) where the others named its default."""
    from tools.plot import run_labels
    cfgs = {"r/s0": {"seed": 0, "imitation_demos": None, "lr": 1e-4},
            "r/s1": {"seed": 1, "imitation_demos": "hindsight", "lr": 1e-4},
            "r/s2": {"seed": 2, "lr": 1e-4}}
    assert run_labels(cfgs) == ({"r/s0": "s0 (seed 0)", "r/s1": "s1 (seed 1)", "r/s2": "s2 (seed 2)"}, ["seed"])
    cfgs["r/s2"]["lr"] = 2e-3
    assert run_labels(cfgs)[0]["r/s2"] == "s2 (lr 0.002, seed 2)"


def test_the_readme_commands_run_in_order_without_a_collision():
    """Issue 53.4: run in the README's order, the Echo Trap and hindsight commands found the main command's folder
    taken. Every train.py / sft_baseline.py command in the README gets a run folder of its own, and a command that
    reads another's output (--model runs/...) comes after the one that writes it."""
    import re
    import shlex
    import sft_baseline
    from engine import cli
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")  # a command continued on the next line
    commands = [c.split("#")[0] for c in re.findall(r"python (?:train|sft_baseline)\.py [^`\n]*", text)]
    assert len(commands) >= 6
    outs = []
    for c in commands:
        script, *argv = shlex.split(c)[1:]
        if "--model" in argv and "Qwen" in argv[argv.index("--model") + 1]:
            continue  # the GPU section's hub runs
        if script == "train.py":
            cfg, explicit = cli.parse(train.Config, argv, presets=train.PRESETS)
            cfg = train.derive(cfg, explicit)
        else:
            cfg = sft_baseline.derive(cli.parse(sft_baseline.Config, argv)[0])
        reads = argv[argv.index("--model") + 1] if "--model" in argv else None
        if reads and reads.startswith("runs/"):
            assert any(reads.startswith(o + "/") or reads == o for o in outs), (c, outs)
        outs.append(cfg.out)
    assert len(outs) == len(set(outs)), outs


def test_one_bf16_iteration_on_a_random_llama(random_llama, tmp_path):
    """--dtype bf16 (what auto picks for a hub model on a CPU with native bf16, and on CUDA) on a Llama with
    LoRA: rollouts through the engine's bf16 weight copies, the update under bf16 autocast with fp32 weights;
    the run's first line says bf16, and the weights stay fp32."""
    out = tmp_path / "run"
    p = run([str(ROOT / "train.py"), "--env", "bandit", "--model", random_llama, "--dtype", "bf16",
             "--lora-rank", "4", "--steps", "1", "--prompts", "2", "--rollouts", "4", "--max-new-tokens", "12",
             "--filter", "1.0", "--eval-prompts", "4", "--out", str(out)], tmp_path)
    assert p.stdout.splitlines()[0].endswith("| cpu, bf16"), p.stdout.splitlines()[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and all("eval/success" in r for r in rows)
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved.get("dtype", saved.get("torch_dtype")) in ("float32", None)
