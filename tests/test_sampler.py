"""Tests for sampler.py, the engine under rollouts: batched sampling equals one episode at a time, the engine equals
the re-prefill reference (greedy, sampled, with the host checking every k steps), its forward equals Hugging Face's,
it samples the model's distribution, its cache holds what it ran, and where a reply stops.

    python -m pytest -q tests/test_sampler.py
"""
import copy
import functools
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout as R  # noqa: E402
from engine import sampler as S  # noqa: E402
from envs import make_env  # noqa: E402
from engine.logprobs import cache_keyword, shared_prefix_len  # noqa: E402
from test_rollout import SEEDS, chaotic_model, runs, sample  # noqa: E402

torch.set_num_threads(1)


def test_batched_equals_one_at_a_time_under_greedy(small):
    """Identical trajectories under greedy decoding, on models whose batches are ragged: rows stop at different
    lengths within a turn and leave at different turns. Random models are tried in turn until one shows both
    (typically the first or second); every one tried must give identical trajectories. The batched rollout
    also moves rows within the engine's cache as episodes end, which the single one never does."""
    tok = small[1]
    seeds = SEEDS[:8]
    for model_seed in range(6):
        model = chaotic_model(tok, model_seed)
        lengths, turns = set(), set()
        for think in ((True, False) if model_seed == 0 else (False,)):
            cfg = R.RolloutConfig(think=think, temperature=0.0, max_new_tokens=30, max_actions=3)
            batched = R.rollout("sokoban", seeds, list(range(8)), cfg, tokenizer=tok, model=model)
            alone = [R.rollout("sokoban", [s], [g], cfg, tokenizer=tok, model=model)[0] for g, s in enumerate(seeds)]
            for a, b in zip(batched, alone):
                assert (a.seed, a.group_id) == (b.seed, b.group_id)
                assert a.segments[0].input_ids == b.segments[0].input_ids
                assert a.segments[0].loss_mask == b.segments[0].loss_mask
                assert [(t.reply, t.actions, t.reward) for t in a.turns] == \
                    [(t.reply, t.actions, t.reward) for t in b.turns]
            assert shared_prefix_len([tr.segments[0].input_ids for tr in batched]) > 20  # the header is shared
            lengths |= {t.response_tokens for tr in batched for t in tr.turns}
            turns |= {len(tr.turns) for tr in batched}
        if len(lengths) > 3 and len(turns) > 1:
            break
    else:
        pytest.fail("no random model gave a ragged batch: the identity above was checked on trivial batches only")


@pytest.mark.parametrize("temperature, context_turns", [(0.0, 0), (1.0, 0), (1.0, 1)])
def test_kv_cache_across_turns_gives_the_re_prefill_trajectories(small, temperature, context_turns):
    """Keeping each episode's KV cache across turns (and prefilling a group's shared first prompt once) samples
    the same trajectories as re-prefilling every prompt (kv_cache=False): token ids, loss masks, rewards. Both
    run the same decode loop on one generator; only the prefill differs, so logits agree up to float rounding.
    The models run in float64 here, so that rounding cannot flip a sampled token (in float32 the logits differ
    by ~1e-6: identical samples are then observed, not guaranteed). P = 3 prompts x N = 4 rollouts, on the prior
    and on a random model whose rows stop at different lengths and turns."""
    tok = small[1]
    seeds = [s for s in SEEDS[:3] for _ in range(4)]
    groups = [g for g in range(3) for _ in range(4)]
    samples = [k for _ in range(3) for k in range(4)]
    for model in (small[0], chaotic_model(tok, 0)):
        model = copy.deepcopy(model).double()
        out = {}
        for kv in (False, True):
            cfg = R.RolloutConfig(temperature=temperature, max_new_tokens=30, context_turns=context_turns, kv_cache=kv)
            out[kv] = R.rollout("sokoban", seeds, groups, cfg, tokenizer=tok, model=model, samples=samples,
                                generator=torch.Generator().manual_seed(3))
        for a, b in zip(out[False], out[True]):
            assert [s.input_ids for s in a.segments] == [s.input_ids for s in b.segments]
            assert [s.loss_mask for s in a.segments] == [s.loss_mask for s in b.segments]
            assert [t.reward for t in a.turns] == [t.reward for t in b.turns]
        assert sum(len(t.turns) > 1 for t in out[True]) >= 2  # the cache really lived across turns


def first_prompts(tok, seeds, env="sokoban"):
    cfg = R.RolloutConfig()
    out = []
    for s in seeds:
        e = make_env(env)
        out.append(R.render_ids(tok, R.window_messages(R.header_text(e, cfg), [R.turn_text(1, e.reset(s), 10, cfg)],
                                                       [], 0), cfg))
    return out


def llama_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})).eval()


def test_engine_forward_equals_hugging_face(small):
    """The engine's hand-written decoder forward gives the Hugging Face logits, on Qwen2 (the prior, a random
    model with grouped KV heads) and Llama (llama3 rotary scaling): a ragged prefill, then one decode step."""
    tok = small[1]
    prompts = first_prompts(tok, [1000, 1001, 1002])
    prompts[1] = prompts[1][:-7]  # ragged rows
    for model in (small[0], chaotic_model(tok, 0), llama_model(tok)):
        assert S.unsupported(model) is None
        eng = S.Engine(model, tok, rows=3)
        with torch.no_grad():
            eng.reserve(max(map(len, prompts)) + 4)
            got = eng.prefill([0, 1, 2], prompts, [0, 0, 0])                  # [3, V]
            eng.pos[:3] = torch.tensor([len(p) for p in prompts])
            eng.ids[:3, 0] = torch.tensor([5, 6, 7])
            eng.width = max(map(len, prompts)) + 1
            step = eng.step(3, eng.width)                                        # [3, V]
            for i, p in enumerate(prompts):
                ref = model(torch.tensor([p + [5 + i]])).logits[0].float()       # [t, V]
                assert torch.allclose(got[i], ref[-2], atol=1e-4), (type(model).__name__, i)
                assert torch.allclose(step[i], ref[-1], atol=1e-4), (type(model).__name__, i)
                full = eng.step(3, eng.capacity)[i]                             # a graph's: more columns
                assert torch.allclose(full, ref[-1], atol=1e-4)
                eng.pos[:3] = torch.tensor([len(q) for q in prompts])           # it wrote the same column


def test_engine_cache_holds_its_episodes_tokens(small):
    """After a reply, each row's cache columns hold the keys and values of its prompt and all its sampled tokens
    but the last (the Hugging Face cache of the same tokens), and the engine remembers those ids per slot."""
    model, tok = small
    prompts = first_prompts(tok, [1000, 1000, 1001])
    eng = S.Engine(model, tok, rows=3)
    replies, _ = eng.generate([0, 1, 2], prompts, 12, 1.0, torch.Generator().manual_seed(0))
    kw = cache_keyword(model)
    for row, (p, r) in enumerate(zip(prompts, replies)):
        ids = p + r[:-1]
        assert eng.cached[row] == ids and int(eng.pos[row]) == len(ids)
        ref = model.base_model(input_ids=torch.tensor([ids]), use_cache=True, **{kw: DynamicCache()})[kw]
        for layer, (rk, rv, *_) in enumerate(ref):
            assert torch.allclose(eng.K[layer][row, :, :len(ids)], rk[0], atol=1e-5)
            assert torch.allclose(eng.V[layer][row, :, :len(ids)], rv[0], atol=1e-5)


@pytest.mark.parametrize("sync_every", [3, 16])
def test_host_checks_every_k_steps_gives_the_reference_under_greedy(small, monkeypatch, sync_every):
    """The GPU setting: the host looks at the rows every k steps (rows finish on the device, finished rows are fed
    pads and compacted at those checks only), every row samples every step. Under greedy decoding the
    trajectories equal the re-prefill reference path's (float64: rounding cannot flip a token)."""
    tok = small[1]
    model = copy.deepcopy(chaotic_model(tok, 1)).double()
    monkeypatch.setattr(S, "Engine", functools.partial(S.Engine, sync_every=sync_every))
    seeds = [s for s in SEEDS[:4] for _ in range(3)]
    out = {}
    for kv in (False, True):
        cfg = R.RolloutConfig(temperature=0.0, max_new_tokens=30, kv_cache=kv)
        out[kv] = R.rollout("sokoban", seeds, list(range(12)), cfg, tokenizer=tok, model=model)
    for a, b in zip(out[False], out[True]):
        assert [s.input_ids for s in a.segments] == [s.input_ids for s in b.segments]
    assert len({t.response_tokens for tr in out[True] for t in tr.turns}) > 3  # rows stopped at different steps
    assert sum(len(t.turns) > 1 for t in out[True]) >= 2


def chi2_pvalue_above(counts: list[int], probs: list[float], z: float = 3.09) -> bool:
    """Pearson's chi-square goodness of fit below its 1 - 0.001 quantile (Wilson-Hilferty approximation)."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    k = len(counts) - 1
    return stat < k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def test_engine_samples_the_models_distribution_at_temperature(small):
    """At temperature 2 the engine in its GPU setting (every row draws each step, the host checks every 8) draws
    its first two tokens from the model's own distribution p(t1) p(t2 | t1): a chi-square test on 3000 replies
    of one prompt, pairs with an expected count under 5 pooled (fixed seed: the test is deterministic)."""
    model, tok = small
    prompt = first_prompts(tok, [1000])[0]
    n, temp = 3000, 2.0
    eng = S.Engine(model, tok, rows=n, sync_every=8)
    replies, _ = eng.generate(list(range(n)), [prompt] * n, 2, temp, torch.Generator().manual_seed(0))
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temp, -1)            # [V]
        firsts = sorted({r[0] for r in replies} | set(p1.topk(20).indices.tolist()))
        p2 = {t: torch.softmax(model(torch.tensor([prompt + [t]])).logits[0, -1] / temp, -1) for t in firsts}
    counts: dict = {}
    for r in replies:
        key = tuple(r) if len(r) == 2 else (r[0],)  # a first token that ends the reply has no second
        counts[key] = counts.get(key, 0) + 1
    ends = set(S.end_ids(model, tok))
    expected = {}
    for t in firsts:
        if t in ends or S.stop_table(tok)[0, t] == len(S.STOP_TEXT):
            expected[(t,)] = float(p1[t])
        else:
            for u in p2[t].topk(30).indices.tolist():
                expected[(t, u)] = float(p1[t] * p2[t][u])
    big = [k for k, p in expected.items() if p * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    probs = [expected[k] for k in big] + [1 - sum(expected[k] for k in big)]
    assert len(big) >= 10, "the test needs a spread distribution"
    assert chi2_pvalue_above(obs, probs)
    # and the test can fail: the same counts against the temperature-1 distribution
    with torch.no_grad():
        p1_cold = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
    cold = [float(p1_cold[k[0]]) * (expected[k] / float(p1[k[0]])) for k in big]
    assert not chi2_pvalue_above(obs, cold + [max(1e-9, 1 - sum(cold))])


def test_stop_automaton_equals_searching_the_text(small):
    """The device-side stop test (an automaton over token pieces) fires at the first token whose text completes
    "</answer>", on random piece sequences rich in its characters."""
    tok = small[1]
    table = S.stop_table(tok)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    rich = [i for i, p in enumerate(pieces) if p and any(c in S.STOP_TEXT for c in p)]
    rng = random.Random(0)
    fired = 0
    for _ in range(3000):
        seq = [rng.choice(rich) for _ in range(12)]
        state, at = 0, None
        for j, t in enumerate(seq):
            state = int(table[state, t])
            if state == len(S.STOP_TEXT) and at is None:
                at = j
        text = "".join(pieces[t] for t in seq)
        first = text.find(S.STOP_TEXT)
        want = None if first < 0 else next(j for j in range(12) if
                                           len("".join(pieces[t] for t in seq[:j + 1])) >= first + len(S.STOP_TEXT))
        assert at == want, [pieces[t] for t in seq]
        fired += at is not None
    assert fired > 20


def test_an_unknown_architecture_samples_with_hugging_face_and_says_so_once(small, capfd):
    from transformers import GPT2Config, GPT2LMHeadModel
    tok = small[1]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=4096,
                                       eos_token_id=tok.eos_token_id)).eval()
    assert "gpt2" in S.unsupported(model)
    cfg = R.RolloutConfig(max_new_tokens=8)
    for _ in range(2):
        trajs = R.rollout("bandit", [1, 2], [0, 1], cfg, tokenizer=tok, model=model)
        assert all(t.turns for t in trajs)
    err = capfd.readouterr().err
    assert err.count("does not know architecture 'gpt2'") == 1


def test_generation_stops_at_answer_eos_or_budget(small):
    _, tok = small
    cfg = R.RolloutConfig(max_new_tokens=24)
    for tr in sample(small, "sokoban", cfg):
        seg = tr.segments[0]
        for a, b in runs(seg.loss_mask):
            text = tok.decode(seg.input_ids[a:b])
            if seg.input_ids[b - 1] == tok.eos_token_id:
                assert S.STOP_TEXT not in text[:-len(tok.eos_token)]
            elif b - a < cfg.max_new_tokens:
                assert text.endswith(S.STOP_TEXT) and text.count(S.STOP_TEXT) == 1
            else:
                assert S.STOP_TEXT not in tok.decode(seg.input_ids[a:b - 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_engines_replies(small):
    """On CUDA the decode step replays a captured graph per batch bucket; greedy replies equal the eager step's."""
    tok = small[1]
    model = chaotic_model(tok, 1).cuda()
    prompts = first_prompts(tok, SEEDS[:6])
    out = {}
    for graphs in (False, True):
        eng = S.Engine(model, tok, rows=6, graphs=graphs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out[graphs] = eng.generate(list(range(6)), prompts, 40, 0.0, None)[0]
    assert out[True] == out[False]


# ---- issue 50: the engine kept across rollouts, its log-probs, bf16 weight copies, sync-free sampling

def test_one_engine_serves_every_rollout_as_a_fresh_one_would(small):
    """The engine is kept per model (one a process, its capacity and graphs reserved once): two rollouts
    after each other, on other prompts, give what a fresh engine per rollout gives, token for token."""
    model, tok = small
    cfg = R.RolloutConfig(max_new_tokens=20, temperature=1.0)
    kept = [R.rollout("sokoban", SEEDS[a:a + 8], list(range(8)), cfg, tokenizer=tok, model=model,
                      generator=torch.Generator().manual_seed(a)) for a in (0, 8)]
    assert S._ENGINES.get(model) is not None
    fresh = []
    for a in (0, 8):
        S._ENGINES.pop(model, None)
        fresh.append(R.rollout("sokoban", SEEDS[a:a + 8], list(range(8)), cfg, tokenizer=tok, model=model,
                               generator=torch.Generator().manual_seed(a)))
    for x, y in zip(kept, fresh):
        assert [t.segments[0].input_ids for t in x] == [t.segments[0].input_ids for t in y]


def test_the_samplers_log_probs_are_the_models(small):
    """Each sampled token's log-prob, as the engine and the reference path record it (Segment.logp), is the
    model's own at the sampling temperature (the train-inference mismatch is ~0 in fp32 on a CPU)."""
    from starpo import token_logprobs
    model, tok = small
    for kv in (True, False):
        cfg = R.RolloutConfig(max_new_tokens=16, temperature=0.7, kv_cache=kv, max_turns=2)
        trajs = R.rollout("sokoban", SEEDS[:4], list(range(4)), cfg, tokenizer=tok, model=model,
                          generator=torch.Generator().manual_seed(0))
        for t in trajs:
            seg = t.segments[0]
            ids = torch.tensor([seg.input_ids])
            with torch.no_grad():
                want = token_logprobs(model, ids, torch.ones_like(ids), 0.7, fused=False)[0][0]
            got = torch.tensor(seg.logp)
            sampled = torch.tensor(seg.loss_mask) > 0
            assert torch.isnan(got[~sampled]).all() and not torch.isnan(got[sampled]).any()
            assert torch.allclose(got[sampled], want[sampled], atol=1e-4), kv


def test_bf16_weight_copies_compute_what_autocast_computes(small):
    """On CUDA the engine runs on bf16 copies of the weights (refreshed once per rollout), not autocast's casts
    at every replay: the same rounding, so the same replies (here on a CPU, under CPU autocast)."""
    tok = small[1]
    model = chaotic_model(tok, 2)
    prompts = first_prompts(tok, SEEDS[:4])
    out = {}
    for dtype in (None, torch.bfloat16):
        eng = S.Engine(model, tok, rows=4, weights_dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out[dtype] = eng.generate(list(range(4)), prompts, 20, 0.0, None)[0]
    assert out[None] == out[torch.bfloat16]
    with torch.no_grad():  # the copies follow the weights: refreshed at the next rollout's start
        for p in model.parameters():
            p.mul_(1.5)
    eng.start()
    assert torch.equal(eng.weights.layers[0]["q_proj"][0], model.model.layers[0].self_attn.q_proj.weight.bfloat16())


def test_exponential_sampling_draws_the_distribution_without_host_syncs(small, monkeypatch):
    """The CUDA path samples argmax(p / Exp(1)): the same distribution as multinomial (chi-square), with no
    multinomial and no .item() / .tolist() in the sampling (they sync the host on CUDA)."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().repeat(20000, 1)
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: (_ for _ in ()).throw(AssertionError("synced")))
    for name in ("item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError(name)))
    t = S.sample(logits, 1.0, torch.Generator().manual_seed(0), draw="exponential")
    monkeypatch.undo()
    counts = torch.bincount(t, minlength=5).tolist()
    assert chi2_pvalue_above(counts, probs.tolist())
    assert not chi2_pvalue_above(counts, [0.2] * 5)  # and the test can tell another distribution


def test_inverse_cdf_sampling_draws_the_distribution_and_never_a_zero_probability_token():
    """The CPU draw for hub-size vocabularies: the same distribution as multinomial (chi-square), never a
    token of probability 0 (first, inside and last), only the rows asked for, the argmax at temperature 0; the
    tiny prior keeps multinomial, so its numbers stay those of every run so far."""
    probs = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.15, 0.1, 0.05, 0.0])
    logits = probs.log().repeat(20000, 1)  # log 0 = -inf: softmax gives exactly 0
    t = S.sample(logits, 1.0, torch.Generator().manual_seed(0), draw="inverse_cdf")
    counts = torch.bincount(t, minlength=8).tolist()
    assert counts[0] == counts[3] == counts[7] == 0
    kept = [1, 2, 4, 5, 6]
    assert chi2_pvalue_above([counts[i] for i in kept], [probs[i].item() for i in kept])
    assert not chi2_pvalue_above([counts[i] for i in kept], [0.2] * 5)
    x, rows = torch.randn(4, 50), torch.tensor([1, 3])
    t = S.sample(x, 0.7, torch.Generator().manual_seed(1), rows, draw="inverse_cdf")
    assert t[0] == t[2] == 0 and 0 <= int(t[1]) < 50 and 0 <= int(t[3]) < 50
    assert torch.equal(S.sample(x, 0.0, None, draw="inverse_cdf"), x.argmax(-1))
    cpu = torch.device("cpu")
    assert S.draw_rule(cpu, 668) == "multinomial" and S.draw_rule(cpu, 49152) == "inverse_cdf"


def test_dynamic_rope_is_refused_for_cuda_graphs(small):
    from transformers import Qwen2Config
    cfg = Qwen2Config(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert S.dynamic_rope(type("M", (), {"config": cfg})())
    assert not S.dynamic_rope(small[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_equal_eager_when_sampling_with_ragged_stops_and_growth(small):
    """The production setting (setup_device: no cuDNN attention): at temperature 1 with a seeded generator the
    graphs draw the tokens the eager engine draws; replies stop at different steps (rows compacted into smaller
    buckets); a second call needs more columns (the cache grows, the graphs are captured again)."""
    from engine.models import setup_device
    setup_device(torch.device("cuda"))
    tok = small[1]
    model = chaotic_model(tok, 3).cuda()
    prompts = first_prompts(tok, SEEDS[:12])
    out = {}
    for graphs in (False, True):
        eng = S.Engine(model, tok, rows=12, graphs=graphs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            first = eng.generate(list(range(12)), prompts, 24, 1.0, torch.Generator("cuda").manual_seed(0))[0]
            cap = eng.capacity
            longer = [p + r + p for p, r in zip(prompts, first)]  # the next turn: more than the capacity
            second = eng.generate(list(range(12)), longer, 24, 1.0, torch.Generator("cuda").manual_seed(1))[0]
        assert eng.capacity > cap
        out[graphs] = (first, second)
    assert len({len(r) for r in out[True][0]}) > 1  # ragged stops
    assert out[True] == out[False]
