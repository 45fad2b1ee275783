"""The warm start (`tools/prior.py --model M --out OUT`) end to end on a small random Llama with the tiny
prior's word-level tokenizer, in seconds: a plain model folder that loads as a policy, a falling loss on the
replies, a resume after Ctrl-C that equals the uninterrupted run, and bad inputs as one line, nothing written.

    python -m pytest -q tests/test_warm_start.py          (~15 s)

The real run: python tools/prior.py --model models/smollm2-135m-instruct --out models/smollm2-warm
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.models import PRIOR_DIR, load_policy, tokenizer_class  # noqa: E402
from tools import prior  # noqa: E402

torch.set_num_threads(1)
FAST = ["--threads", "1", "--format-prompts", "1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random 2-layer Llama (grouped KV heads, tied head) saved with a tokenizer that has a chat template: a
    pretrained instruct LM's folder in miniature. Its weights are drawn 10x wider than Llama's 0.02: with the
    default, logits through the tied random embeddings stay within about +-0.6, and no adapter could move
    the loss far from log(vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = tmp_path_factory.mktemp("llama")
    tok = tokenizer_class(PRIOR_DIR).from_pretrained(str(PRIOR_DIR))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def test_the_warm_start_writes_a_plain_policy_and_its_loss_falls(base, tmp_path, capsys):
    out = tmp_path / "warm"
    prior.main(["--model", str(base), "--out", str(out), "--steps", "16", "--lr", "3e-2", *FAST])
    printed = capsys.readouterr().out
    losses = [float(line.split("| loss ")[1].split(" |")[0]) for line in printed.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.5, losses
    # a plain model folder: the adapters merged (no LoRA keys), fp32, the tokenizer and its chat template,
    # and the reply budget eval.py reads; the checkpoint folder is gone
    assert json.loads((out / "train_config.json").read_text()) == {"max_new_tokens": 60}
    assert not Path(str(out) + ".partial").exists()
    saved = weights(out)
    assert not any("lora" in k for k in saved) and all(v.dtype == torch.float32 for v in saved.values())
    model, tok, _ = load_policy(str(out))
    assert type(model).__name__ == "LlamaForCausalLM" and tok.chat_template
    trained = [k for k in saved if not torch.equal(saved[k], weights(base)[k])]
    assert trained and all(k.endswith("proj.weight") for k in trained)  # the adapters' layers, nothing else
    assert "on 1 eval prompts" in printed


def test_reply_nll_is_the_models_own_loss_batched_or_not_and_the_merge_keeps_it(base):
    """reply_nll (right-padded micro-batches, no attention mask, the LM head on the reply positions only)
    equals the model's full forward one sequence at a time; merging the trained adapters into the weights
    changes no output."""
    from engine.lora import merge_lora
    model, tok, path = load_policy(str(base))
    cfg = prior.Config(model=str(base), steps=3, lr=3e-2, lora_rank=4, lora_alpha=8.0)
    settings = prior.warm_settings(cfg, path, None)
    prior.warm_start(model, tok, settings, None, Path("unused"), save_every=100)
    segs = prior.warm_batch(tok, 0, 99)
    batches = prior.micro_batches(segs)
    assert sorted(len(s.input_ids) for b in batches for s in b) == sorted(len(s.input_ids) for s in segs)
    assert 1 <= len(batches) <= 2
    full = torch.zeros(())
    with torch.no_grad():
        for seg in segs:
            ids = torch.tensor([seg.input_ids])
            mask = torch.tensor(seg.loss_mask[1:]).bool()
            logits = model(input_ids=ids).logits[0, :-1]
            full += torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum")
        nll = sum(prior.reply_nll(model, b, tok.pad_token_id, None) for b in batches)
        merge_lora(model)
        merged = sum(prior.reply_nll(model, b, tok.pad_token_id, None) for b in batches)
    assert torch.allclose(nll, full, rtol=1e-5), (nll, full)
    assert torch.allclose(nll, merged, rtol=1e-4), (nll, merged)


def test_ctrl_c_then_the_same_command_continues_to_the_same_weights(base, tmp_path, monkeypatch, capsys):
    whole = tmp_path / "whole"
    # bf16 autocast by hand (auto is fp32 for a model this small): the frozen weights cast once, kept, merged
    same = ["--model", str(base), "--steps", "6", "--save-every", "2", "--dtype", "bf16", *FAST]
    prior.main([*same, "--out", str(whole)])
    out = tmp_path / "resumed"
    args = [*same, "--out", str(out)]
    real = prior.warm_batch

    def ctrl_c_at_step_3(tok, seed, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(tok, seed, step)
    monkeypatch.setattr(prior, "warm_batch", ctrl_c_at_step_3)
    with pytest.raises(KeyboardInterrupt, match="at step 4 of 6; the same command continues from step 2"):
        prior.main(args)
    assert not out.exists() and (tmp_path / "resumed.partial" / "state.pt").is_file()  # no final folder yet
    monkeypatch.setattr(prior, "warm_batch", real)
    capsys.readouterr()
    prior.main(args)
    assert "resuming from step 2" in capsys.readouterr().out
    a, b = weights(whole), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("args, needle", [
    (["--model", "TMP/none", "--out", "TMP/w"], "--model"),
    (["--model", "BASE"], "--out: a warm start needs"),
    (["--model", "BASE", "--out", "TMP/full"], "--out TMP/full: exists and is not empty"),
    (["--model", "BASE", "--out", "BASE"], "exists and is not empty"),
    (["--model", "BASE", "--out", "TMP/w", "--overwrite"], "--overwrite: only for the tiny prior"),
    (["--model", "BASE", "--out", "TMP/w", "--episodes-per-env", "8"], "--episodes-per-env: only for"),
    (["--lr", "1e-3", "--out", "TMP/w"], "--lr: only for a warm start"),
    (["--model", "BASE", "--out", "TMP/w", "--lr", "0"], "--lr 0.0: must be > 0"),
    (["--model", "BASE", "--out", "TMP/w", "--lora-rank", "64"], "--lora-rank 64: must be <= the model's"),
    (["--model", "BASE", "--out", "TMP/w", "--dtype", "fp16"], "--dtype"),
    (["--model", "BASE", "--out", "TMP/w", "--steps", "0"], "--steps 0"),
    (["--model", "BASE", "--out", "TMP/w", "--device", "tpu"], "--device"),
    (["--model", "BASE", "--out", "TMP/other", "--seed", "1"], "other settings (seed: 0 there, 1 now)"),
    (["--model", "BASE", "--out", "TMP/broken"], "cannot read"),
])
def test_bad_input_is_one_line_and_writes_nothing(base, tmp_path, capsys, args, needle):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    # the defaults' settings: on a model of the tiny prior's size --dtype auto is fp32 (amp None) on any CPU
    settings = prior.warm_settings(prior.Config(model=str(base), seed=0, steps=60, lr=5e-4, lora_rank=16,
                                                lora_alpha=32.0), str(base), None)
    (tmp_path / "other.partial").mkdir()
    torch.save({"step": 5, "settings": settings}, tmp_path / "other.partial" / "state.pt")
    (tmp_path / "broken.partial").mkdir()
    (tmp_path / "broken.partial" / "state.pt").write_bytes(b"not a checkpoint")
    before = snapshot(tmp_path), snapshot(base)
    argv = [a.replace("BASE", str(base)).replace("TMP", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as exit_:
        prior.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and "error:" in lines[0], lines
    assert needle.replace("BASE", str(base)).replace("TMP", str(tmp_path)) in lines[0], lines[0]
    assert (snapshot(tmp_path), snapshot(base)) == before  # nothing written, nothing changed
