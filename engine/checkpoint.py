"""Checkpoints of a run (train.py, sft_baseline.py): written atomically, resumed exactly, damage named.

`ckpt-STEP/` is written completely into a temp folder and renamed, then `latest` is repointed atomically, so a
run stopped at any moment resumes from its last whole checkpoint (`--resume RUN`) and reproduces the
uninterrupted run: every random draw of a step derives from (seed, step), so no generator state is saved. The
newest two checkpoints are kept. A LoRA run saves its policy merged (a plain model) and its adapters in
state.pt. The paper has no section on checkpoints; verl saves actor, critic and optimizer states alike.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from engine import cli
from engine.lora import adapter_state, plain_state_dict


def save_checkpoint(out: Path, step: int, tok, models: dict, state: dict, config: dict | None = None) -> None:
    """Write ckpt-STEP/ (each of `models` as a plain model folder, the tokenizer and the run's `config` as
    train_config.json beside the policy, so that eval.py and --model read it as a policy folder; `state` in
    state.pt with the adapters of every LoRA model; a value with a state_dict(), an optimizer or a scheduler,
    as its state_dict, None left out), then point `latest` at it; keep the newest two."""
    final, tmp = out / f"ckpt-{step:06d}", out / f".tmp-ckpt-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {"step": step, **{k: v.state_dict() if hasattr(v, "state_dict") else v
                              for k, v in state.items() if v is not None}}
    for name, model in models.items():
        if model is None:
            continue
        if hasattr(model, "config"):  # a causal LM: merged LoRA, so that eval.py loads it as any model
            model.save_pretrained(tmp / name, state_dict=plain_state_dict(model))
        else:  # the critic writes its backbone and its head
            model.save_pretrained(str(tmp / name))
        state[f"{name}_lora"] = adapter_state(model)
    tok.save_pretrained(tmp / "policy")
    if config is not None:
        (tmp / "policy" / "train_config.json").write_text(json.dumps(config, indent=2))
    torch.save(state, tmp / "state.pt")
    previous = (out / "latest").read_text().strip() if (out / "latest").is_file() else None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = out / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out / "latest")
    for old in out.glob("ckpt-*"):
        if old.name not in (final.name, previous):
            shutil.rmtree(old, ignore_errors=True)


def _load_state(ck: Path, device):
    state = torch.load(ck / "state.pt", map_location=device, weights_only=False)
    return int(state["step"]), state


def read_checkpoint(out: Path, device, flag: str = "--resume"):
    """-> (step, state, checkpoint folder) of the run's latest checkpoint, or None if it has none yet. A
    checkpoint that cannot be read is a ValueError naming its file and an intact earlier one, if any."""
    if not (out / "latest").is_file():
        return None
    ck = out / (out / "latest").read_text().strip()
    try:
        step, state = _load_state(ck, device)
    except Exception as e:  # a damaged file is the user's input here: name it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        intact = None
        for older in sorted(out.glob("ckpt-*"), reverse=True):
            try:
                if older != ck and _load_state(older, "cpu"):
                    intact = older
                    break
            except Exception:
                continue
        hint = f"; {intact.name} is intact: resume from it with `echo {intact.name} > {out / 'latest'}`" \
            if intact else "; no earlier checkpoint is intact"
        raise ValueError(f"{flag} {out}: cannot read {ck / 'state.pt'} ({type(e).__name__}: {first}){hint}") \
            from None
    return step, state, ck


def resume_point(cfg, out: Path, what: str = "iterations") -> tuple[int, dict | None, Path | None]:
    """Where a run starts -> (step, state, checkpoint folder): 0 for a new run or a resumed one without a
    checkpoint yet, else its latest checkpoint's (`read_checkpoint`), which --steps must not undercut."""
    found = read_checkpoint(out, "cpu") if cfg.resume else None
    if found is None:
        return 0, None, None
    if getattr(cfg, "steps", 0) and cfg.steps < found[0]:
        raise ValueError(f"--steps {cfg.steps}: the run already has {found[0]} {what} (give at least that)")
    return found


def restore_optimizers(state: dict, optimizers: dict) -> None:
    """A resumed run's optimizer states (`state`, from its checkpoint) into `optimizers` (name -> optimizer or
    None), saved under the same names."""
    for name, opt in optimizers.items():
        if opt is not None:
            opt.load_state_dict(state[name])


def read_metrics(path: Path, upto: int, flag: str = "--resume") -> list[str]:
    """The metrics lines of steps 1..upto (a resumed run continues after them)."""
    if not path.is_file():
        raise ValueError(f"{flag} {path.parent}: {path} is missing; its checkpoint is at step {upto}, but "
                         f"resuming would leave no record of the steps before it")
    kept = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip():
            try:
                step = json.loads(text)["step"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{flag} {path.parent}: {path} line {n} is not a metrics line") from None
            if step <= upto:
                kept.append(text)
    return kept


def resume_config(cls, cfg, explicit: set[str], allowed: set[str], dropped: tuple[str, ...] = ()):
    """--resume RUN: the run's own Config from RUN/config.json, with the `allowed` flags as typed (any other
    typed flag would be ignored, so it is an error). `dropped`: keys of removed fields, ignored (a field
    added since the run was saved takes its default, which is what the run ran with)."""
    run = Path(cfg.resume)
    if not cli.is_run(run):
        what = "a model folder, not a run" if (run / "config.json").is_file() else "not a run folder"
        raise ValueError(f"--resume {cfg.resume}: {what} (a run folder holds config.json and metrics.jsonl)")
    saved = cli.read_json(run / "config.json", f"--resume {cfg.resume}")
    saved = {k: v for k, v in saved.items() if k not in dropped}
    unknown = sorted(set(saved) - {f.name for f in fields(cls)})
    if len(unknown) > len(saved) / 2:
        raise ValueError(f"--resume {cfg.resume}: a run of another script (most of its config.json's keys "
                         f"are not this script's: {', '.join(unknown[:3])}, ...)")
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ValueError(f"--resume {cfg.resume}: its config.json has keys this script does not know: "
                         f"{', '.join(unknown[:3])}{more}")
    ignored = sorted(explicit - allowed - {"resume"})
    if ignored:
        raise ValueError(f"--resume keeps the run's own config; it cannot change "
                         f"{', '.join('--' + k.replace('_', '-') for k in ignored)} (allowed with --resume: "
                         f"{', '.join('--' + k.replace('_', '-') for k in sorted(allowed))})")
    return cls(**{**saved, **{k: getattr(cfg, k) for k in explicit}, "out": cfg.resume})


def restore_models(ck: Path, state: dict, policy, critic, lora: bool, flag: str) -> None:
    """A resumed run's weights from its checkpoint `ck`: a LoRA run's adapters from state.pt (its frozen base
    is the --model's; the critic's head beside its merged backbone), else the whole saved models."""
    from engine.models import load_critic, load_policy
    device = policy.device
    if lora:
        policy.load_state_dict(state["policy_lora"], strict=False)
    else:
        policy.load_state_dict(load_policy(str(ck / "policy"), device, flag)[0].state_dict())
    if critic is not None and lora:
        critic.value_head.load_state_dict(torch.load(ck / "critic" / "value_head.pt", map_location=device))
        critic.load_state_dict(state["critic_lora"], strict=False)
    elif critic is not None:  # a critic is a backbone and a value head (starpo.Critic)
        backbone, head = load_critic(str(ck / "critic"), device)
        critic.backbone.load_state_dict(backbone.state_dict())
        critic.value_head.load_state_dict(head)


def open_run(out: Path, config: dict, start: int, kept_metrics: list[str], replace: bool,
             resumed: Path | None = None, what: str = "iteration") -> Path:
    """Start writing a run folder, once every input is checked: an earlier run is cleared first (`replace`:
    --overwrite, only the files a run writes), config.json written, the metrics lines of the steps before the
    checkpoint kept and the text dumps after it removed; the config and where the run starts printed.
    `resumed`: the checkpoint a resumed run continues from. -> metrics.jsonl's path."""
    if replace:
        cli.clear_run_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for old in out.glob("trajectories-*.txt"):  # dumps of steps after the checkpoint are written again
        if old.stem.split("-")[1].isdigit() and int(old.stem.split("-")[1]) > start:
            old.unlink()
    metrics = out / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in kept_metrics))
    print("config:", json.dumps(config))
    if resumed is not None:
        print(f"resumed from {resumed} at {what} {start}")
    elif config.get("resume"):
        print(f"no checkpoint in {out} yet: starting the run afresh")
    else:
        print(f"writing {out}")
    return metrics


def append_metrics(path: Path, m: dict) -> None:
    """One iteration's (or step's) metrics dict, a line at the end of metrics.jsonl (docs/metrics.md)."""
    with open(path, "a") as f:
        f.write(json.dumps(m) + "\n")


def saved_settings(path: str | None, keys, flag: str) -> dict:
    """The settings `keys` in the train_config.json that train.py or sft_baseline.py saved beside a policy."""
    if path is None or not (Path(path) / "train_config.json").exists():
        return {}
    saved = cli.read_json(Path(path) / "train_config.json", flag)
    return {k: saved[k] for k in keys if k in saved}


def save_final(out: Path, policy, tok, cfg) -> None:
    """A plain save_pretrained folder (+ train_config.json: eval.py renders prompts the same way)."""
    final = out / "final"
    policy.save_pretrained(final, state_dict=plain_state_dict(policy))
    tok.save_pretrained(final)
    (final / "train_config.json").write_text(json.dumps(cli.as_dict(cfg), indent=2))
