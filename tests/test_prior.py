"""Tests for prior.py and the shipped prior (`prior/`): the word-level tokenizer, the cached deterministic build, the
warm-up's loss on observations, offline loading, the rebuild command, and the shipped weights themselves.

    python -m pytest -q tests/test_prior.py          (+ -m slow: the full rebuild, ~3 min)
"""
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine import models as policy  # noqa: E402
from tools import prior  # noqa: E402
import rollout as R  # noqa: E402
from eval import random_agent  # noqa: E402
from engine.logprobs import pad_segments  # noqa: E402
from conftest import MICRO  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- the shipped prior

def test_the_shipped_prior_is_the_tiny_policy_and_answers_in_format():
    """`--model tiny` loads prior/ (no build, no cache): ~1M parameters, the word-level tokenizer, a config that
    transformers 4.x reads with the same meaning (prior.portable), and well-formed replies on Bandit."""
    from eval import evaluate
    model, tok, path = policy.load_policy("tiny")
    assert path == str(policy.PRIOR_DIR) and type(model).__name__ == "Qwen2ForCausalLM"
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000
    cfg = json.loads((policy.PRIOR_DIR / "config.json").read_text())
    assert cfg["rope_theta"] == prior.TINY_MODEL["rope_theta"] and cfg["hidden_size"] == prior.TINY_MODEL["hidden_size"]
    assert json.loads((policy.PRIOR_DIR / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast" and "Qwen2" not in type(tok).__name__
    m, _ = evaluate("bandit", R.RolloutConfig(temperature=0.5), model, tok, prompts=16)
    assert m["format"] > 0.95 and m["valid_action"] > 0.9, m


def test_a_missing_prior_says_how_to_get_it_back(monkeypatch, tmp_path):
    monkeypatch.setattr(policy, "PRIOR_DIR", tmp_path / "prior")
    with pytest.raises(ValueError, match="shipped prior is missing.*python tools/prior.py"):
        policy.load_policy("tiny")


def test_the_rebuild_command_makes_a_working_prior(tmp_path):
    """`python prior.py` is the recipe: here with a smaller corpus and fewer steps (~30 s; 24 steps gave a format
    rate of 0.97-1.0 on every env here). A rebuild on another CPU rounds differently, so it is checked as a prior
    (format rate on every env), not bit for bit."""
    out = tmp_path / "rebuilt"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "prior.py"), "--out", str(out), "--steps", "24",
                        "--episodes-per-env", "32", "--format-prompts", "8"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    rates = json.loads(p.stdout.split("format rate per env: ")[1])
    assert set(rates) >= {"bandit", "sokoban", "frozenlake"} and min(rates.values()) > 0.8, rates
    again = subprocess.run([sys.executable, str(ROOT / "tools" / "prior.py"), "--out", str(out)], capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "--out" in again.stderr and "--overwrite" in again.stderr  # never overwritten
    assert len(again.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_full_rebuild_is_a_prior_like_the_shipped_one(tmp_path):
    """The shipped recipe, whole (~3 min): every env answers in format in >= 95% of turns, as prior/ does."""
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "prior.py"), "--out", str(tmp_path / "p")], capture_output=True,
                       text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    rates = json.loads(p.stdout.split("format rate per env: ")[1])
    assert min(rates.values()) >= 0.95, rates


# ----------------------------------------------------------------------------- the tiny tokenizer

def test_tiny_tokenizer_is_word_level_and_exact(small):
    _, tok = small
    assert "Qwen2" not in type(tok).__name__   # the saved word-level tokenizer, not transformers 5's Qwen2 BPE
    text = ("Turn 2:\nState:\n######\n#_OX√#\n#P___#\n######\nYou have 6 actions left.\n"
            "<think> I pick my moves at random. </think> <answer> Up || Down </answer>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.unk_token_id not in ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces.count("\n") == text.count("\n")            # grid rows stay apart
    for tag in (" </think>", " <answer>", " </answer>", " ||"):
        assert tag in pieces                                  # one token each, leading space included
    assert tok.convert_ids_to_tokens(tok("<think>", add_special_tokens=False)["input_ids"]) == ["<think>"]
    # the chat template round-trips through save/load
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


def test_default_tiny_config_is_1_to_5M_parameters():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=700, **prior.TINY_MODEL))
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 5_000_000


# ----------------------------------------------------------------------------- the cached build

def _weights(path):
    from safetensors.torch import load_file
    return load_file(str(Path(path) / "model.safetensors"))


def test_tiny_build_is_cached_deterministic_and_keyed(tmp_path, monkeypatch):
    a = prior.ensure_tiny(str(tmp_path / "a"), progress=False, **MICRO)
    stamp = (Path(a) / "model.safetensors").stat().st_mtime_ns
    assert prior.ensure_tiny(str(tmp_path / "a"), progress=False, **MICRO) == a          # a cache hit ...
    assert (Path(a) / "model.safetensors").stat().st_mtime_ns == stamp                   # ... not a rebuild
    b = prior.ensure_tiny(str(tmp_path / "b"), progress=False, **MICRO)
    assert Path(a).name == Path(b).name
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)          # same seed, same bits
    # the key follows the config, the warm-up, the vocabulary (env texts) and the warm-up code's version
    keyed = [
        dict(MICRO, warmup={**MICRO["warmup"], "seed": 1}),
        dict(MICRO, model_cfg={**MICRO["model_cfg"], "hidden_size": 32}),
        dict(MICRO, envs=["bandit-rev"]),
    ]
    paths = {Path(prior.ensure_tiny(str(tmp_path / "a"), progress=False, **o)).name for o in keyed}
    monkeypatch.setattr(prior, "TINY_VERSION", prior.TINY_VERSION + 1)
    paths.add(Path(prior.ensure_tiny(str(tmp_path / "a"), progress=False, **MICRO)).name)
    assert len(paths) == 4 and Path(a).name not in paths
    # a different vocabulary: bandit-rev only swaps the roles, so add an env with other words
    ws = prior.ensure_tiny(str(tmp_path / "a"), progress=False, **dict(MICRO, envs=["bandit", "sokoban"]))
    assert json.loads((Path(ws) / "config.json").read_text())["vocab_size"] > \
        json.loads((Path(a) / "config.json").read_text())["vocab_size"]


def test_warm_up_also_models_the_observations(tmp_path):
    """tools/prior.py (the loss on the boards too): with obs_weight the warm-up also lowers the loss on the boards, not only the replies."""
    cfg = dict(envs=["sokoban"], warmup=dict(episodes_per_env=16, steps=30, batch_tokens=1024, lr=2e-2),
               model_cfg=MICRO["model_cfg"])
    nll = {}
    for w in (0.0, 1.0):
        warmup = {**cfg["warmup"], "obs_weight": w}
        path = prior.ensure_tiny(str(tmp_path), progress=False, **{**cfg, "warmup": warmup})
        model, tok, _ = policy.load_policy(path)
        segs = [s for t in R.rollout("sokoban", list(range(5000, 5008)), list(range(8)), R.RolloutConfig(),
                                     tokenizer=tok, agent=random_agent(random.Random(0)))
                for s in t.segments]
        ids, attn, mask = pad_segments(segs, tok.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        tok_nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        obs = attn[:, 1:] * (1 - mask[:, 1:])
        reply = mask[:, 1:]
        nll[w] = ((tok_nll * obs).sum() / obs.sum()).item(), ((tok_nll * reply).sum() / reply.sum()).item()
    assert nll[1.0][0] < nll[0.0][0] - 1.0, nll   # the observations: learned only with the term
    assert nll[1.0][1] < nll[0.0][1] + 0.2, nll   # ... at no cost to the replies


def test_tiny_builds_and_loads_offline(tmp_path):
    """No network: the hub is switched off and every socket connect raises; build, then load the cached copy; the
    shipped prior loads too."""
    code = textwrap.dedent(f"""
        import json, socket, sys
        def no_network(*a, **k):
            raise OSError("network access attempted")
        socket.socket.connect = no_network
        socket.create_connection = no_network
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from engine import models as policy
        from tools import prior
        torch.set_num_threads(1)
        tiny = json.loads({json.dumps(json.dumps(MICRO))})
        m1, tok, p1 = policy.load_policy(prior.ensure_tiny({str(tmp_path)!r}, progress=False, **tiny))
        m2, tok2, p2 = policy.load_policy(prior.ensure_tiny({str(tmp_path)!r}, progress=False, **tiny))
        m3, tok3, p3 = policy.load_policy("tiny")  # the shipped prior, offline
        same = all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
        print(json.dumps(dict(p1=p1, p2=p2, same=same, cls=type(m2).__name__, tok=type(tok2).__name__, p3=p3)))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["p1"] == res["p2"] and res["same"]
    assert res["cls"] == "Qwen2ForCausalLM" and "Qwen2" not in res["tok"] and res["p3"] == str(policy.PRIOR_DIR)


