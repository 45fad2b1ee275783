"""Tests for engine/models.py: device choice, the Hugging Face loading path on a small Qwen2 model saved with
save_pretrained, the shipped prior's loading and its errors, and the PPO critic.

Run from the repository root:  python -m pytest -q tests/test_models.py   (about 20 s on one core)

`small` (tests/conftest.py) is a SMALL tiny-policy build (2 envs, ~80k parameters, seconds to build).
"""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine import models as policy  # noqa: E402
from tools import prior  # noqa: E402
import rollout as R  # noqa: E402
from engine.logprobs import pad_segments  # noqa: E402

torch.set_num_threads(1)  # on 2-core machines, 2 threads made small-model forward+backward erratic and slower

# ----------------------------------------------------------------------------- device, dtype

def test_pick_device_and_autocast():
    assert policy.pick_device("cpu") == torch.device("cpu")
    assert policy.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", "CPU", "cuda0", ""):
        with pytest.raises(ValueError, match="allowed"):
            policy.pick_device(bad)
    if not torch.cuda.is_available():
        for name in ("cuda", "cuda:0"):
            with pytest.raises(ValueError, match="not available"):
                policy.pick_device(name)
    assert policy.autocast_dtype(torch.device("cpu")) is None
    assert policy.autocast_dtype(torch.device("cuda")) is torch.bfloat16


def test_setup_device_threads_on_cpu_and_no_cudnn_attention_on_cuda():
    threads, cudnn = torch.get_num_threads(), torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        policy.setup_device(torch.device("cpu"), 2)
        assert torch.get_num_threads() == 2 and torch.backends.cuda.cudnn_sdp_enabled()  # CPU: threads only
        policy.setup_device(torch.device("cuda"))  # a flag of torch's: set without a GPU
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def test_dtype_auto_bf16_on_cuda_and_hub_models_on_native_bf16_cpus(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(policy, "native_bf16", lambda native=native: native)
        assert policy.choose_dtype("auto", cuda, "tiny") == "bf16"
        assert policy.choose_dtype("auto", cpu, "tiny") == "fp32"  # the prior's numbers stay bit-identical
        assert policy.choose_dtype("auto", cpu, "hf") == ("bf16" if native else "fp32")
        assert policy.choose_dtype("fp32", cuda, "hf") == "fp32"
        assert policy.choose_dtype("bf16", cpu, "tiny") == "bf16"
    with pytest.raises(ValueError, match="--dtype 'fp16': allowed are auto, fp32, bf16"):
        policy.choose_dtype("fp16", cpu, "hf")
    policy.setup_device(cpu, torch.get_num_threads(), dtype="bf16")
    assert policy.autocast_dtype(cpu) is torch.bfloat16  # what rollouts and updates then use
    policy.setup_device(cpu, torch.get_num_threads(), dtype="fp32")
    assert policy.autocast_dtype(cpu) is None
    assert policy.default_threads("tiny") == 1 and policy.default_threads("hf") == (__import__("os").cpu_count() or 1)


@pytest.mark.parametrize("which", ["tiny", "llama"])
def test_bf16_logprobs_equal_fp32_within_tolerance(which, random_llama):
    """bf16 autocast (CUDA, and hub models on CPUs with native bf16) against fp32, both log-prob paths: on the
    tiny prior's peaked distributions the mean |difference| stays under 0.05 nats and the largest under 0.5
    (measured: 0.015-0.019 and 0.09-0.13); on a random Llama's near-uniform ones under 0.01."""
    from starpo import token_logprobs
    name = "tiny" if which == "tiny" else random_llama
    model, tok, _ = policy.load_policy(name)
    ids = torch.randint(5, len(tok), (4, 40), generator=torch.Generator().manual_seed(1))
    mean_tol, max_tol = (0.05, 0.5) if which == "tiny" else (0.01, 0.01)
    for fused in (True, False):
        with torch.no_grad():
            lp32, ent32 = token_logprobs(model, ids, torch.ones_like(ids), 1.0, fused)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                lp16, ent16 = token_logprobs(model, ids, torch.ones_like(ids), 1.0, fused)
        assert lp16.dtype == torch.float32  # the loss math stays fp32 whatever the forward's dtype
        diff = (lp32 - lp16).abs()[:, 1:]
        assert diff.mean() < mean_tol and diff.max() < max_tol, (fused, diff.mean(), diff.max())
        assert (ent32 - ent16).abs()[:, 1:].mean() < mean_tol


# ----------------------------------------------------------------------------- the Hugging Face path

def _qwen_like_folder(folder: Path):
    """A small Qwen2 checkpoint + a byte-level BPE tokenizer that declares itself a Qwen2Tokenizer, as a hub
    model folder does; saved with save_pretrained. -> the saved model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from envs import make_env
    texts = []
    for name in ("bandit", "sokoban"):
        env = make_env(name)
        texts += [env.instruction, env.reset(1000), R.format_prompt(True), "Reward: -0.1\nTurn 2:\nState:\n"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = prior.CHAT_TEMPLATE
    tok.save_pretrained(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"                  # as Qwen/Qwen2.5-0.5B-Instruct declares
    cfg_file.write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id))
    model.save_pretrained(folder)
    return model, tok


def test_hf_loading_path_on_saved_qwen2(tmp_path):
    saved, saved_tok = _qwen_like_folder(tmp_path)
    model, tok, path = policy.load_policy(str(tmp_path))
    assert path == str(tmp_path) and type(model).__name__ == "Qwen2ForCausalLM"
    assert type(tok).__name__.startswith("Qwen2Tokenizer")     # AutoTokenizer chose the declared class
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    text = "Turn 1:\nState:\n#_OX#\n<think> x </think> <answer> Up || Down </answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == saved_tok(text, add_special_tokens=False)["input_ids"] and tok.decode(ids) == text
    # a rollout through the BPE tokenizer: its ids are the chat template's rendering of the conversation
    cfg = R.RolloutConfig(max_new_tokens=12, max_turns=2)
    gen = torch.Generator().manual_seed(0)
    for traj in R.rollout("sokoban", [123, 124], [0, 1], cfg, tokenizer=tok, model=model, generator=gen):
        seg, = traj.segments
        assert tok.decode(seg.input_ids) == tok.apply_chat_template(traj.messages, tokenize=False)
        assert sum(seg.loss_mask) == sum(t.response_tokens for t in traj.turns)


def test_load_policy_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="no such folder"):
        policy.load_policy(str(tmp_path / "no-such-model"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline and not cached: fails at once, says what to do
    with pytest.raises(ValueError, match="download it first"):
        policy.load_policy("nobody-has/this-model")
    _qwen_like_folder(tmp_path)
    cfg_file = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="chat template"):
        policy.load_policy(str(tmp_path))


# ----------------------------------------------------------------------------- the critic

def test_critic_shape_alignment_and_round_trip(small, small_path, tmp_path):
    (model, tok), path = small, small_path
    from starpo import Critic
    critic = Critic(*policy.load_critic(path))
    # the backbone is a separate copy of the policy's: same weights, different tensors
    pol = dict(model.base_model.named_parameters())
    for name, p in critic.backbone.named_parameters():
        assert torch.equal(p, pol[name]) and p.data_ptr() != pol[name].data_ptr()
    assert torch.count_nonzero(critic.value_head.weight) == 0           # first values are 0, not noise
    torch.manual_seed(0)
    torch.nn.init.normal_(critic.value_head.weight)
    torch.nn.init.normal_(critic.value_head.bias)
    ids = torch.randint(5, len(tok), (3, 9))                                    # [B, T]
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0                                                             # right padding
    values = critic(ids, attn)
    assert values.shape == (3, 9) and values.dtype == torch.float32
    with torch.no_grad():
        h = critic.backbone(input_ids=ids, attention_mask=attn).last_hidden_state   # [B, T, H]
        head = critic.value_head(h).squeeze(-1)                                      # [B, T]
    assert torch.all(values[:, 0] == 0)
    # values[:, t] is read from the hidden state at t-1: the state before token t is sampled
    torch.testing.assert_close(values[:, 1:], head[:, :-1])
    # padding after position 5 does not change the real positions of row 1
    alone = critic(ids[1:2, :6], attn[1:2, :6])
    torch.testing.assert_close(values[1:2, :6], alone, rtol=1e-5, atol=1e-5)
    # round trip: save_pretrained + load_critic gives the same values
    critic.save_pretrained(str(tmp_path))
    again = Critic(*policy.load_critic(str(tmp_path)))
    torch.testing.assert_close(again(ids, attn), values)
    # the critic trains: a gradient reaches the head and the backbone
    values[attn.bool()].sum().backward()
    assert critic.value_head.weight.grad is not None
    assert critic.backbone.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


def test_pad_segments():
    segs = [R.Segment([5, 6, 7], [0, 1, 1]), R.Segment([8], [0])]
    ids, attn, mask = pad_segments(segs, pad_id=1)
    assert ids.tolist() == [[5, 6, 7], [8, 1, 1]]
    assert attn.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]] and mask.dtype == torch.float32


def test_model_kind_follows_the_model_size(tmp_path):
    """Per-model defaults: "tiny" and folders of its size get the tiny ones, everything else the paper's."""
    assert policy.model_kind("tiny") == "tiny"
    assert policy.model_kind("Qwen/Qwen2.5-0.5B-Instruct") == "hf"  # a hub id: no local config
    for hidden, kind in [(128, "tiny"), (896, "hf")]:
        folder = tmp_path / f"h{hidden}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden}))
        assert policy.model_kind(str(folder)) == kind
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert policy.model_kind(str(tmp_path / "broken")) == "hf"


def test_memory_cap_passes_the_current_cuda_index_and_empties_the_cache_first(monkeypatch):
    """Issue 50: `--memory-cap` on `cuda` (no index, as pick_device("auto") gives it) raised "Expected a
    torch.device with a specified index" in torch. The cap is set for the current device's index, after
    emptying the caching allocator (what earlier work left there is not this run's)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2 ** 30}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "a card")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda frac, device: calls.append((round(frac, 6), device)))
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        policy.setup_device(torch.device("cuda"), memory_cap=22.5)
        policy.setup_device(torch.device("cuda", 1), memory_cap=40)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    assert calls == ["empty", (round(22.5 / 80, 6), 3), "empty", (0.5, 1)]
    assert all(isinstance(c[1], int) for c in calls if c != "empty")
    with pytest.raises(ValueError, match="larger than this card's 80.0 GiB"):
        policy.setup_device(torch.device("cuda"), memory_cap=81)
