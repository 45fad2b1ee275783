"""Bad input, as a new user types it, to every entry script: one error line, exit code 2, nothing lost.

    python -m pytest -q tests/test_bad_inputs.py      (about a minute on one core)

One table of cases (script, flags, what the error line must name). Each case runs the script's main() in
this process and asserts: exit code 2, exactly one line on stderr and it is the error (no traceback, no usage
block), the flag (or file) named in it; and, where the case points at an existing run, that every file of that
run is byte-identical afterwards. A few subprocess runs check the parts a main() call cannot show: Ctrl-C (exit
130 and the command that resumes), a script's own `__main__`, webshop.py without arguments.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tools import bench, plot  # noqa: E402
from tools import prior  # noqa: E402
import eval as eval_py  # noqa: E402
import sft_baseline  # noqa: E402
import train  # noqa: E402
from extras import webshop  # noqa: E402

SCRIPTS = {"train": train, "eval": eval_py, "sft": sft_baseline, "webshop": webshop, "bench": bench,
           "prior": prior, "plot": plot}


@pytest.fixture(scope="module")
def base_run(bandit_tiny, tmp_path_factory) -> Path:
    """A real, finished 2-iteration run with checkpoints (every file a bad input must leave alone)."""
    out = tmp_path_factory.mktemp("runs") / "run"
    train.main(["--env", "bandit", "--no-think", "--model", bandit_tiny, "--steps", "2", "--prompts", "4",
                "--rollouts", "4", "--eval-every", "0", "--eval-prompts", "2", "--save-every", "1",
                "--out", str(out)])
    return out


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def damaged(base: Path, tmp: Path, damage: str) -> Path:
    """A copy of the run with one thing wrong with it."""
    run = tmp / "damaged"
    shutil.copytree(base, run)
    if damage == "config-json":
        (run / "config.json").write_text('{"env": "bandit", ')
    elif damage == "config-key":
        cfg = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({**cfg, "learning_rate_typo": 1.0}))
    elif damage == "state":
        state = run / (run / "latest").read_text().strip() / "state.pt"
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "metrics":
        (run / "metrics.jsonl").unlink()
    elif damage == "saved-settings":  # a rollout setting saved beside the policy, edited out of its bounds
        saved = json.loads((run / "final" / "train_config.json").read_text())
        (run / "final" / "train_config.json").write_text(json.dumps({**saved, "max_turns": 0}))
    elif damage == "no-checkpoint":  # a run killed before its first checkpoint and before final/
        for p in list(run.glob("ckpt-*")) + [run / "final"]:
            shutil.rmtree(p)
        (run / "latest").unlink()
    return run


# (script, flags; RUN = the run (or its damaged copy), MODEL = the small tiny build, TMP = a fresh folder),
# what the error line must contain, the damage done to the run first (None: the run is untouched too)
CASES = [
    ("train", ["--steps", "x"], "--steps", None),
    ("train", ["--lr", "inf"], "--lr", None),
    ("train", ["--lr", "nan"], "--lr", None),
    ("train", ["--lr", "-1"], "--lr -1.0", None),
    ("train", ["--filter", "1.5"], "--filter 1.5", None),
    ("train", ["--algo", "dpo"], "--algo", None),
    ("train", ["--eval-prompts", "300"], "--eval-prompts 300", None),
    ("train", ["--seed", str(2 ** 70)], "--seed", None),
    ("train", ["--seed", "-1"], "--seed -1", None),
    ("train", ["--max-turns", "0"], "--max-turns 0", None),
    ("train", ["--max-new-tokens", "0"], "--max-new-tokens 0", None),
    ("train", ["--model", "MODEL", "--max-new-tokens", "5000", "--out", "TMP/r"], "positions", None),
    ("train", ["--clip-low", "1.0"], "--clip-low 1.0", None),
    ("train", ["--gamma", "2"], "--gamma 2.0", None),
    ("train", ["--rollouts", "1"], "--rollouts 1", None),
    ("train", ["--kl-in-reward", "--algo", "grpo"], "--kl-in-reward", None),
    ("train", ["--eval-every", "-1"], "--eval-every -1", None),
    ("train", ["--model", "/nonexistent/folder"], "no such folder", None),
    ("train", ["--model", "nobody-has/this-model"], "download it first", None),
    ("train", ["--device", "cuda:x"], "--device", None),
    ("train", ["--out", ""], "--out ''", None),
    ("train", ["--out", "TMP/afile/run"], "is a file", None),
    ("train", ["--out", "RUN"], "continue it with --resume", "untouched"),
    ("train", ["--webshop-data", "TMP", "--env", "sokoban"], "--webshop-data", None),
    ("train", ["--hindsight-imitation", "2", "--env", "bandit"], "--hindsight-imitation 2: only for sokoban", None),
    ("train", ["--hindsight-imitation", "-1"], "--hindsight-imitation -1", None),
    ("train", ["--hindsight-imitation", "0", "--imitation-demos", "best"], "--imitation-demos best: only with", None),
    ("train", ["--high-level-gamma", "0.9"], "--high-level-gamma 0.9: only with --bi-level-gae", None),
    ("train", ["--gigpo-weight", "2", "--algo", "ppo"], "--gigpo-weight 2.0: only with --algo gigpo", None),
    ("train", ["--gigpo-weight", "-1", "--algo", "gigpo"], "--gigpo-weight -1.0: must be >= 0", None),
    ("train", ["--gigpo-gamma", "0", "--algo", "gigpo"], "--gigpo-gamma 0.0: must be in (0, 1]", None),
    ("train", ["--gigpo-gamma", "1.5", "--algo", "gigpo"], "--gigpo-gamma 1.5: must be in (0, 1]", None),
    ("train", ["--gigpo-mode", "median", "--algo", "gigpo"], "--gigpo-mode", None),
    ("train", ["--micro-batch", "64", "--mini-batch", "32"], "--micro-batch 64: larger than --mini-batch 32", None),
    ("train", ["--resume", "RUN", "--steps", "1"], "--steps 1: the run already has 2 iterations", "untouched"),
    ("train", ["--resume", "MODEL"], "a model folder, not a run", None),
    ("train", ["--model", "TMP/empty", "--out", "TMP/r"], "no config.json in this folder", None),
    ("train", ["--model", "RUN/ckpt-000002", "--out", "TMP/r"], "a checkpoint: pass its policy/ folder", "untouched"),
    ("eval", ["--envs", ""], "--envs '': names no env", None),
    ("eval", ["--policy", "TMP/empty"], "no config.json in this folder", None),
    ("train", ["--resume", "RUN", "--env", "sokoban"], "--env", "untouched"),
    ("train", ["--resume", "RUN", "--overwrite"], "--overwrite", "untouched"),
    ("train", ["--resume", "TMP/none"], "--resume", None),
    ("train", ["--resume", "RUN"], "not valid JSON", "config-json"),
    ("train", ["--resume", "RUN"], "learning_rate_typo", "config-key"),
    ("train", ["--resume", "RUN"], "state.pt", "state"),
    ("train", ["--resume", "RUN"], "metrics.jsonl", "metrics"),
    ("plot", ["TMP/none"], "no metrics.jsonl in it", None),
    ("plot", ["TMP/emptyrun"], "holds no iteration yet", None),
    ("plot", ["RUN", "--out", "TMP/none/x.png"], "--out", "untouched"),
    ("train", ["--model", "TMP/broken-model", "--out", "TMP/r"], "broken-model/model.safetensors", None),
    ("eval", ["--policy", "/nonexistent/folder"], "--policy", None),
    ("eval", ["--envs", "sokoban,chess"], "chess", None),
    ("eval", ["--prompts", "0"], "--prompts 0", None),
    ("eval", ["--samples", "0"], "--samples 0", None),
    ("eval", ["--seed", str(2 ** 31 - 1), "--samples", "2"], "--samples 2", None),
    ("eval", ["--policy", "expert", "--samples", "2"], "--samples 2: the expert", None),
    ("eval", ["--temperature", "0", "--samples", "3"], "--samples 3: --temperature 0", None),
    ("eval", ["--policy", "random", "--max-turns", "0"], "--max-turns 0", None),
    ("eval", ["--temperature", "-1"], "--temperature -1.0", None),
    ("eval", ["--temperature", "inf"], "--temperature", None),
    ("eval", ["--policy", "random", "--json", "TMP/none/x.json"], "--json", None),
    ("eval", ["--policy", "random", "--webshop-data", "TMP"], "--webshop-data", None),
    ("eval", ["--policy", "RUN", "--env", "bandit"], "neither final", "no-checkpoint"),
    ("eval", ["--policy", "RUN/final", "--env", "bandit"], "--max-turns 0", "saved-settings"),
    ("eval", ["--policy", "TMP/broken-model"], "cannot load the model from", None),
    ("sft", ["--lora-rank", "-1"], "--lora-rank -1", None),
    ("sft", ["--adam-beta2", "1.0"], "--adam-beta2 1.0", None),
    ("sft", ["--epochs", "0"], "--epochs 0", None),
    ("sft", ["--expert-actions", "9"], "--expert-actions 9", None),
    ("sft", ["--out", "RUN"], "continue it with --resume", "untouched"),
    ("sft", ["--resume", "RUN"], "a run of another script", None),
    ("webshop", ["--play", "-3"], "--play -3", None),
    ("webshop", ["--write-catalogue", "TMP/afile"], "not a folder", None),
    ("webshop", ["--play", "1", "--num-products", "0"], "--num-products", None),
    ("webshop", ["--play", "1", "--data-dir", "TMP/none"], "--data-dir", None),
    ("webshop", ["--max-actions", "x"], "--max-actions", None),
    ("webshop", ["--num-products", "-1"], "--num-products -1", None),
    ("webshop", ["--num-products", "5"], "nothing to do", None),
    ("prior", ["--out", "RUN"], "--overwrite", "untouched"),
    ("prior", ["--steps", "0"], "--steps 0", None),
    ("bench", ["nosuch"], "nosuch", None),
    ("bench", ["rollout", "--repeats", "0"], "--repeats 0", None),
    ("bench", ["gpu", "--gpu-filter", "2"], "--gpu-filter 2.0", None),
    ("bench", ["--device", "tpu"], "--device", None),
    # issue 61: what a newcomer hit on a fresh clone
    ("plot", ["RUN", "--out", "TMP/afile"], "exists; nothing is replaced", "untouched"),
    ("eval", ["--policy", "runs/no-such-run"], "--policy 'runs/no-such-run': no such folder", None),
    ("eval", ["--policy", "RUN-s0"], "no such folder", None),
    ("train", ["--model", "models/smollm2-typo"], "--model 'models/smollm2-typo': no such folder", None),
    ("train", ["--lr", "-1e-4"], "--lr -0.0001: must be > 0", None),
    ("train", ["--clip-high", "-2E-1"], "--clip-high -0.2: must be >= 0", None),
    ("eval", ["--temperature", "-5e-1"], "--temperature -0.5: must be >= 0", None),
    ("sft", ["--lr", "-1e-3"], "--lr -0.001: must be > 0", None),
    ("train", ["--env", "webshop", "--webshop-data", "TMP/none"], "--webshop-data", None),
    ("eval", ["--env", "webshop", "--webshop-data", "TMP/none"], "--webshop-data", None),
    ("eval", ["--envs", "sokoban,,bandit"], "an empty name between commas", None),
]


@pytest.mark.parametrize("script, args, needle, damage", CASES,
                         ids=[f"{c[0]} {' '.join(c[1])}"[:60] for c in CASES])
def test_bad_input_is_one_line_and_loses_nothing(script, args, needle, damage, base_run, bandit_tiny, tmp_path,
                                                 capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # a default run folder (runs/...) would land here, never in the repository
    (tmp_path / "afile").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    (tmp_path / "emptyrun").mkdir()
    (tmp_path / "emptyrun" / "metrics.jsonl").write_text("")  # a run before its first iteration
    broken = tmp_path / "broken-model"
    shutil.copytree(bandit_tiny, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    run = damaged(base_run, tmp_path, damage) if damage and damage != "untouched" else base_run
    before = snapshot(run)
    argv = [a.replace("RUN", str(run)).replace("MODEL", bandit_tiny).replace("TMP", str(tmp_path)) for a in args]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script].main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and len(lines) == 1 and "error:" in lines[0], err
    assert needle in lines[0], lines[0]
    assert snapshot(run) == before  # nothing of an existing run changed
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r").exists()  # and no run folder was started


def test_hub_advice_only_for_a_name_that_could_be_a_hub_id(tmp_path, monkeypatch, capsys):
    """Issue 61.2: a mistyped run path got hub advice. A name under runs/, models/ or prior/, or one that
    names a run folder, is a missing folder, with the closest names beside it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sokoban-grpo-s0").mkdir(parents=True)
    for name, says in (("runs/sokoban-grpo-s1", "did you mean runs/sokoban-grpo-s0?"),
                       ("somewhere/bandit-grpo-s3", "no such folder"), ("someorg/somemodel", "download it first")):
        with pytest.raises(SystemExit):
            eval_py.main(["--policy", name, "--prompts", "2"])
        err = capsys.readouterr().err
        assert says in err and ("huggingface" in err) == (says == "download it first"), err


def test_a_default_micro_batch_follows_a_typed_mini_batch():
    """Issue 61.3: --mini-batch 8 alone was refused (the tiny default micro-batch is 16)."""
    from engine import cli
    cfg = train.derive(*cli.parse(train.Config, ["--mini-batch", "8"]))
    assert (cfg.mini_batch, cfg.micro_batch) == (8, 8)
    cfg = train.derive(*cli.parse(train.Config, ["--mini-batch", "8", "--micro-batch", "4"]))
    assert (cfg.mini_batch, cfg.micro_batch) == (8, 4)


def test_resume_of_a_finished_run_writes_nothing(base_run, tmp_path, capsys):
    """Issue 61.5: --resume of a finished run rewrote config.json and final/train_config.json, doing no work."""
    run = tmp_path / "copy"
    shutil.copytree(base_run, run)
    before = snapshot(run)
    assert train.main(["--resume", str(run)]) == run
    assert "the run is complete (2 iterations)" in capsys.readouterr().out
    assert snapshot(run) == before


def test_eval_prints_only_what_a_rollout_renders(capsys):
    """Issue 61.5: eval printed the engine's switches ('cuda_graphs': True) on a CPU."""
    eval_py.main(["--env", "bandit", "--policy", "random", "--prompts", "2"])
    out = capsys.readouterr().out
    assert "cuda_graphs" not in out and "kv_cache" not in out and "'max_turns': 5" in out


def test_resume_without_a_checkpoint_starts_afresh_and_says_so(base_run, tmp_path, capsys):
    run = damaged(base_run, tmp_path, "no-checkpoint")
    train.main(["--resume", str(run)])
    assert "no checkpoint in" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_overwrite_replaces_a_run_and_eval_finds_a_runs_policy(base_run, bandit_tiny, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(base_run, run)
    (run / "trajectories-000099.txt").write_text("stale")
    train.main(["--env", "bandit", "--no-think", "--model", bandit_tiny, "--steps", "1", "--prompts", "4",
                "--rollouts", "4", "--eval-every", "0", "--eval-prompts", "2", "--out", str(run), "--overwrite"])
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not (run / "trajectories-000099.txt").exists()
    capsys.readouterr()
    eval_py.main(["--env", "bandit", "--policy", str(run), "--prompts", "2"])
    assert f"loading {run / 'final'}" in capsys.readouterr().err


def run_script(args, **kw):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


def test_entry_scripts_exit_2_with_one_line_and_webshop_without_arguments_prints_help(tmp_path):
    p = run_script([str(ROOT / "eval.py"), "--prompts", "0"], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--prompts 0" in p.stderr
    p = run_script([str(ROOT / "extras" / "webshop.py")], cwd=tmp_path)
    assert p.returncode == 0 and "--write-catalogue" in p.stdout


def test_ctrl_c_says_how_to_resume_and_exits_130(bandit_tiny, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--env", "bandit", "--no-think", "--model",
                             bandit_tiny, "--steps", "500", "--prompts", "4", "--rollouts", "4", "--eval-every", "0",
                             "--eval-prompts", "2", "--save-every", "1", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"},
                            # as typed in a terminal: a suite started in the background of a non-interactive shell
                            # ignores SIGINT, and a child would inherit that and never see the Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while not (out / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "interrupted at iteration" in last and f"--resume {out}" in last


def test_a_diverged_run_ends_in_one_line_and_keeps_its_metrics(bandit_tiny, tmp_path, capsys):
    """--lr 1e30 is a finite number, so it runs: the first update blows the weights up, the eval of that
    iteration cannot sample, and the run ends with one line (exit 1) after writing that iteration's metrics."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train.main(["--env", "bandit", "--no-think", "--model", bandit_tiny, "--lr", "1e30", "--steps", "3",
                    "--prompts", "4", "--rollouts", "4", "--filter", "1.0", "--eval-every", "1",
                    "--eval-prompts", "2", "--out", str(out), "--group-noise", "independent"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert exit_.value.code == 1 and len(err) == 1 and ("diverged" in err[0] or "non-finite" in err[0])
    assert rows and rows[-1]["step"] == int(err[0].split("iteration ")[1].split(":")[0])


@pytest.mark.parametrize("script, args", [
    ("train", ["--out", "FOLDER", "--overwrite"]),
    ("train", ["--out", "FOLDER"]),
    ("sft", ["--out", "FOLDER", "--overwrite"]),
    ("prior", ["--out", "RUN", "--overwrite"]),
])
def test_overwrite_never_deletes_what_a_run_did_not_write(script, args, base_run, bandit_tiny, tmp_path, capsys,
                                                         monkeypatch):
    """Issue 53: `--out` on a model folder (a copy of the shipped prior) said "a run is already there ... or
    replace it with --overwrite", and --overwrite then deleted its weights and tokenizer. A folder that is not
    the script's own output is refused whatever the flags, and every file in it stays as it was."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "model-copy"
    shutil.copytree(ROOT / "prior", folder)
    run = tmp_path / "run-copy"
    shutil.copytree(base_run, run)
    before = snapshot(folder), snapshot(run)
    argv = [a.replace("FOLDER", str(folder)).replace("RUN", str(run)) for a in args]
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script].main(argv + (["--model", bandit_tiny] if script != "prior" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "does not write" in err[0], err
    assert (snapshot(folder), snapshot(run)) == before


def test_overwrite_replaces_only_the_runs_own_files(base_run, bandit_tiny, tmp_path, monkeypatch):
    """A run folder may be replaced; a file the user added to it makes it not a run's any more (refused)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "copy"
    shutil.copytree(base_run, run)
    (run / "notes.txt").write_text("mine")
    args = ["--env", "bandit", "--no-think", "--model", bandit_tiny, "--steps", "1", "--prompts", "4",
            "--rollouts", "4", "--eval-every", "0", "--eval-prompts", "2", "--out", str(run), "--overwrite"]
    with pytest.raises(SystemExit):
        train.main(args)
    assert (run / "notes.txt").read_text() == "mine" and (run / "ckpt-000002").is_dir()


def test_eval_json_never_replaces_an_existing_file(tmp_path, capsys):
    target = tmp_path / "e.json"
    target.write_text('{"mine": 1}')
    with pytest.raises(SystemExit) as exit_:
        eval_py.main(["--policy", "random", "--env", "bandit", "--prompts", "2", "--json", str(target)])
    assert exit_.value.code == 2 and "exists" in capsys.readouterr().err
    assert target.read_text() == '{"mine": 1}'
