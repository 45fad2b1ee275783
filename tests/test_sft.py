"""Tests for sft_baseline.py: the hand-written LoRA (the frozen layer at init, gradients only on the adapter,
merged == unmerged), the expert data (rendered through the rollout template, loss mask exactly on the expert's
replies, seeds disjoint from the eval seeds), the accumulated loss against a slow per-sequence reference, and a
subprocess smoke run whose exported folder eval.py loads and scores as the run did.

Run from the repository root:  python -m pytest -q tests/test_sft.py   (about 20 s on one idle core, 60 s shared)
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import eval as eval_py  # noqa: E402
from engine import lora  # noqa: E402
from engine import models as policy  # noqa: E402
from tools import prior  # noqa: E402
import sft_baseline as sft  # noqa: E402
from envs import EVAL_SEEDS, make_env  # noqa: E402
from eval import expert_agent  # noqa: E402
from rollout import (RolloutConfig, header_text, prefill, rollout, turn_close,  # noqa: E402
                     window_messages)

torch.set_num_threads(1)


def small_qwen(seed=0, vocab=48):
    """A random 2-layer Qwen2 (q/k/v carry biases, tied head): every kind of linear layer LoRA must wrap."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def logits(model, ids):
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


# ----------------------------------------------------------------------------------------------------- LoRA

def test_lora_equals_frozen_layer_at_init():
    model = small_qwen()
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    before = logits(model, ids)
    names = lora.add_lora(model, rank=4, alpha=8.0)
    kinds = {n.rsplit(".", 1)[-1] for n in names}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(names) == 7 * 2 and "lm_head" not in names
    layer = model.get_submodule(names[0])
    assert isinstance(layer, lora.LoRALinear) and layer.scale == 2.0 and torch.all(layer.lora_B == 0)
    assert torch.equal(logits(model, ids), before)  # B = 0: exactly the pretrained function


def test_only_lora_parameters_get_gradients():
    model = small_qwen()
    lora.add_lora(model, rank=4, alpha=8.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    # train.py's and sft_baseline.py's AdamW: over the parameters that train
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # step 1 moves only B (A's gradient is 0 while B = 0), step 2 both
        logits(model, ids).logsumexp(-1).mean().backward()
        assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert all(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B"))


def test_adapters_off_is_the_initial_model_without_a_copy():
    """A LoRA run's KL reference (train.py deviation 6): the trained policy with its adapters off computes the
    initial model exactly, and the adapters come back on after the block, also when it raises."""
    model = small_qwen()
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(3))
    start = logits(model, ids)
    lora.add_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, lora.LoRALinear):
                m.lora_B.normal_(0, 0.5)  # as after training
    trained = logits(model, ids)
    assert not torch.allclose(trained, start)
    with lora.adapters_off(model):
        assert torch.equal(logits(model, ids), start)
    assert torch.equal(logits(model, ids), trained)
    with pytest.raises(RuntimeError), lora.adapters_off(model):
        raise RuntimeError("inside")
    assert torch.equal(logits(model, ids), trained)


def test_merged_equals_unmerged_and_saves_as_a_plain_model(tmp_path):
    model = small_qwen()
    plain_keys = set(model.state_dict())
    lora.add_lora(model, rank=4, alpha=8.0)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids = torch.randint(0, 48, (3, 11), generator=gen)
    with torch.no_grad():
        adapter = logits(model, ids)
        assert lora.merge_lora(model) == 14
        merged = logits(model, ids)
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())
    assert (adapter - logits(small_qwen(), ids)).abs().max() > 1e-3  # the adapter does change the function
    torch.testing.assert_close(merged, adapter, rtol=1e-5, atol=1e-5)
    assert set(model.state_dict()) == plain_keys
    model.save_pretrained(tmp_path)
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()  # fp32 checkpoint
    with torch.no_grad():
        torch.testing.assert_close(logits(reloaded, ids), adapter, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- data

def expert_tokenizer(envs, cfgs):
    """A word-level tokenizer (policy.build_tokenizer) whose vocabulary covers the experts' own texts."""
    texts = [f"{r}\n" for r in ("system", "user", "assistant")]
    for env in envs:
        for cfg in cfgs:
            for t in rollout(env, list(range(1000, 1012)), list(range(12)), cfg, agent=expert_agent(2)):
                texts += [m["content"] for m in t.messages]
    return prior.build_tokenizer(texts)


def runs(mask):
    """(start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("env", ["sokoban", "frozenlake"])
def test_expert_data_round_trips_with_the_mask_on_the_replies(env):
    cfgs = [RolloutConfig(think=th, context_turns=ctx) for th in (True, False) for ctx in (0, 1)]
    tok = expert_tokenizer([env], cfgs)
    close = turn_close(tok)
    for cfg in cfgs:
        trajs = sft.expert_trajectories(env, list(range(1000, 1012)), cfg, tok, 2)
        assert sft.unknown_words(tok, trajs) == []
        for t in trajs:
            replies = [x.reply for x in t.turns]
            hdr = header_text(make_env(env), cfg)
            users = [m["content"] for m in t.messages if m["role"] == "user"]
            users[0] = users[0][len(hdr):]
            segs = t.segments
            assert len(segs) == (len(t.turns) if cfg.context_turns else 1)
            for k, turn in enumerate(t.turns):
                seg = segs[k] if cfg.context_turns else segs[0]
                spans = runs(seg.loss_mask)
                a, b = spans[k if not cfg.context_turns else 0]
                # the trained tokens are exactly the expert's reply after the template's pre-filled tag
                assert tok.decode(seg.input_ids[a:b], skip_special_tokens=False) == turn.reply[len(prefill(cfg)):]
                assert tok.decode(seg.input_ids[b:b + 2], skip_special_tokens=False) == close
                if cfg.context_turns:  # one example per turn: the 1-turn window -> the reply, nothing else
                    assert len(spans) == 1
                    msgs = window_messages(hdr, users[:k + 1], replies[:k], cfg.context_turns)
                    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + prefill(cfg)
                    assert tok.decode(seg.input_ids[:a], skip_special_tokens=False) == prompt
                    assert b + 2 == len(seg.input_ids)
            if not cfg.context_turns:  # the whole conversation, one masked run per turn
                assert len(runs(segs[0].loss_mask)) == len(t.turns)
                assert tok.decode(segs[0].input_ids, skip_special_tokens=False) == \
                    tok.apply_chat_template(t.messages, tokenize=False)
            # every answer is the expert's: replay the episode and ask the expert at each turn
            e = make_env(env)
            e.reset(t.seed)
            for turn in t.turns:
                assert turn.parsed and turn.format_ok
                assert turn.actions[0] == e.expert_action()
                for act in turn.actions:
                    e.step(act)


@pytest.mark.parametrize("env", ["sokoban", "frozenlake"])
@pytest.mark.parametrize("think", [True, False])
def test_short_examples_are_each_state_alone_answered_by_the_experts_reply(env, think):
    cfg = RolloutConfig(context_turns=1, think=think)
    tok = expert_tokenizer([env], [cfg])
    trajs = sft.expert_trajectories(env, list(range(1000, 1006)), cfg, tok, 2)
    segs = sft.short_examples(trajs, tok, cfg)
    turns = [turn for t in trajs for turn in t.turns]
    assert len(segs) == len(turns)
    for seg, turn in zip(segs, turns):
        (a, b), = runs(seg.loss_mask)
        assert b == len(seg.input_ids)  # the reply is the last thing in the example, and the only one trained
        prompt = tok.decode(seg.input_ids[:a], skip_special_tokens=False)
        assert f"State:\n{turn.obs}\n" in prompt and "Turn" not in prompt and prompt.endswith(prefill(cfg))
        assert len(seg.input_ids) < 0.6 * min(len(s.input_ids) for s in trajs[0].segments)  # short
        said = tok.decode(seg.input_ids[a:b], skip_special_tokens=False)
        assert said.split() == turn.reply[len(prefill(cfg)):].split()


def test_data_seeds_are_disjoint_from_each_other_and_from_eval():
    train, test = sft.data_seeds(0, 1000, 100)
    assert len(set(train)) == 1000 and len(set(test)) == 100 and not set(train) & set(test)
    assert not (set(train) | set(test)) & set(EVAL_SEEDS)
    assert sft.data_seeds(0, 1000, 100) == (train, test) and sft.data_seeds(1, 1000, 100)[0] != train


def test_unknown_words_names_what_the_tokenizer_lacks():
    cfg = RolloutConfig(context_turns=1)
    trajs = rollout("sokoban", [1000, 1001], [0, 1], cfg, agent=expert_agent(2))
    texts = [f"{r}\n" for r in ("system", "user", "assistant")]
    texts += [m["content"].replace(" pick", "").replace(" my", "") for t in trajs for m in t.messages]
    tok = prior.build_tokenizer(texts)
    assert sft.unknown_words(tok, sft.expert_trajectories("sokoban", [1000, 1001], cfg, tok, 2)) == ["my", "pick"]


def test_accumulated_step_equals_one_big_batch_and_the_slow_loss():
    cfg_ = RolloutConfig(context_turns=0)
    tok = expert_tokenizer(["sokoban"], [cfg_])
    segs = [s for t in sft.expert_trajectories("sokoban", list(range(2000, 2006)), cfg_, tok, 2) for s in t.segments]
    base = small_qwen(vocab=len(tok))
    # slow reference: per sequence, full logits, cross-entropy summed over the masked positions
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in segs:
            ids = torch.tensor([s.input_ids])
            lg = logits(base, ids)[0]
            for t in range(1, len(s.input_ids)):
                if s.loss_mask[t]:
                    nll -= torch.log_softmax(lg[t - 1], -1)[s.input_ids[t]].item()
                    n += 1
    params = []
    for micro in (1, 4, len(segs)):
        model = copy.deepcopy(base).train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = sft.Config(micro_batch=micro, batch=len(segs))
        m = sft.sft_step(model, opt, segs, cfg, tok.pad_token_id, torch.device("cpu"), None)
        assert m["train/tokens"] == n and m["train/loss"] == pytest.approx(nll / n, rel=1e-5)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(params[0], params[2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(params[1], params[2], rtol=1e-5, atol=1e-6)


def test_lr_warms_up_then_decays_on_a_cosine():
    f = [sft.lr_factor(s, 100) for s in range(100)]
    assert f[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a > b for a, b in zip(f[4:], f[5:])) and 0 < f[-1] < 0.01


def test_per_model_defaults_fill_only_what_was_not_given():
    """Hub models get the paper's recipe and torch's beta2; the tiny policy its CPU recipe; a flag given wins."""
    tiny = sft.derive(sft.Config())
    assert (tiny.train_trajectories, tiny.batch, tiny.lr, tiny.adam_beta2, tiny.lora_rank) == (2800, 16, 2e-3, 0.95, 0)
    hub = sft.derive(sft.Config(model="Qwen/Qwen2.5-0.5B-Instruct"))
    assert (hub.train_trajectories, hub.epochs, hub.batch, hub.micro_batch, hub.lr, hub.adam_beta2,
            hub.lora_rank) == (1000, 5, 128, 4, 1e-4, 0.999, 64)
    assert sft.derive(sft.Config(adam_beta2=0.9, batch=32)).adam_beta2 == 0.9


@pytest.mark.parametrize("flag,value", [("--lora-rank", "-1"), ("--adam-beta2", "1.0")])
def test_bad_flag_is_one_line(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        sft.main([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{flag} {value}" in err[0]


# ----------------------------------------------------------------------------------------------------- smoke

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return prior.ensure_tiny(cache_dir=str(tmp_path_factory.mktemp("tiny")), progress=False,
                              warmup=dict(steps=30, episodes_per_env=40),
                              model_cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2),
                              envs=["sokoban", "frozenlake"])


def test_smoke_run_exports_the_lowest_test_loss_and_eval_loads_it(tiny_path, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "sft_baseline.py", "--env", "sokoban", "--model", tiny_path, "--train-trajectories",
           "16", "--test-trajectories", "4", "--epochs", "3", "--batch", "8", "--lora-rank", "4", "--lr", "3e-3",
           "--context-turns", "1", "--eval-prompts", "4", "--short-steps", "3", "--short-batch", "4", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    final = out / "final"
    assert {"config.json", "model.safetensors", "train_config.json"} <= {f.name for f in final.iterdir()}
    from safetensors import safe_open
    with safe_open(final / "model.safetensors", "pt") as f:
        assert f.keys() and not any("lora" in k for k in f.keys())  # merged: a plain checkpoint
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and rows[-1]["epoch"] == 3
    assert [r["epoch"] for r in rows[:3]] == [0, 0, 0] and rows[3]["epoch"] == 1  # the curriculum comes first
    tests = [r["test/loss"] for r in rows if "test/loss" in r]
    result = json.loads((out / "result.json").read_text())
    assert len(tests) == 3 and result["lora_layers_merged"] == 7 * 2
    assert result["best_test_loss"] == min([result["initial_test_loss"]] + tests)
    assert min(tests) < result["initial_test_loss"]  # it did learn something in 3 short epochs
    # the exported weights are the kept checkpoint: recompute its test loss from the folder
    model, tok, _ = policy.load_policy(str(final), "cpu")
    saved = json.loads((final / "train_config.json").read_text())
    cfg = sft.Config(**saved)
    rcfg = eval_py.rollout_config_for(str(final), eval_py.Config(temperature=0.5), "sokoban")
    assert rcfg.context_turns == 1
    _, test_seeds = sft.data_seeds(cfg.seed, cfg.train_trajectories, cfg.test_trajectories)
    segs = [s for t in sft.expert_trajectories("sokoban", test_seeds, rcfg, tok, cfg.expert_actions)
            for s in t.segments]
    assert sft.test_loss(model, segs, cfg, tok.pad_token_id, torch.device("cpu"), None) == \
        pytest.approx(result["best_test_loss"], rel=1e-4)
    # eval.py loads the folder with its training prompts and reproduces the run's own final eval
    eval_py.main(["--env", "sokoban", "--policy", str(final), "--prompts", "4", "--json", str(tmp_path / "e.json")])
    got = json.loads((tmp_path / "e.json").read_text())["results"]["sokoban"]
    assert got["success"] == result["eval/success"] and got["num_actions"] == result["eval/num_actions"]


@pytest.mark.parametrize("lora_rank", ["0", "4"])
def test_an_interrupted_run_resumes_exactly(tiny_path, tmp_path, monkeypatch, lora_rank):
    """Issue 53: Ctrl-C used to lose the whole run. A run stopped after its checkpoint at step 6 and resumed
    with --resume logs what the uninterrupted run logs, keeps the same epoch, exports the same weights."""
    common = ["--env", "sokoban", "--model", tiny_path, "--train-trajectories", "12", "--test-trajectories", "4",
              "--epochs", "2", "--batch", "6", "--lr", "3e-3", "--context-turns", "1", "--eval-prompts", "4",
              "--short-steps", "3", "--short-batch", "4", "--save-every", "3", "--lora-rank", lora_rank]
    sft.main(common + ["--out", str(tmp_path / "a")])
    calls, step = [0], sft.sft_step

    def interrupted(*a, **k):  # Ctrl-C during step 8, after the checkpoint of step 6
        calls[0] += 1
        if calls[0] == 8:
            raise KeyboardInterrupt
        return step(*a, **k)
    monkeypatch.setattr(sft, "sft_step", interrupted)
    with pytest.raises(KeyboardInterrupt, match="last checkpoint: step 6"):
        sft.main(common + ["--out", str(tmp_path / "b")])
    monkeypatch.setattr(sft, "sft_step", step)
    assert not (tmp_path / "b" / "final").exists()
    with pytest.raises(SystemExit):
        sft.main(["--resume", str(tmp_path / "b"), "--epochs", "3"])  # the schedule cannot change
    sft.main(["--resume", str(tmp_path / "b")])
    rows = {r: [json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in "ab"}
    assert [x["step"] for x in rows["b"]] == [x["step"] for x in rows["a"]]
    for x, y in zip(rows["a"], rows["b"]):
        assert {k: v for k, v in x.items() if not k.startswith("time/")} == \
            {k: v for k, v in y.items() if not k.startswith("time/")}
    ra, rb = (json.loads((tmp_path / r / "result.json").read_text()) for r in "ab")
    assert {k: v for k, v in ra.items() if not k.startswith("time/")} == \
        {k: v for k, v in rb.items() if not k.startswith("time/")}
    from safetensors.torch import load_file
    wa, wb = (load_file(tmp_path / r / "final" / "model.safetensors") for r in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
