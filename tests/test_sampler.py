"""Tests for sampler.py, the engine under rollouts: batched sampling equals one episode at a time, each episode's
KV cache kept across turns equals re-prefilling, the caches it returns, and where a reply stops.

    python -m pytest -q tests/test_sampler.py
"""
import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout as R  # noqa: E402
import sampler as S  # noqa: E402
from envs import make_env  # noqa: E402
from starpo import cache_keyword, shared_prefix_len  # noqa: E402
from test_rollout import SEEDS, chaotic_model, runs, sample  # noqa: E402

torch.set_num_threads(1)


def test_batched_equals_one_at_a_time_under_greedy(small):
    """Identical trajectories under greedy decoding, on models whose batches are ragged: rows stop at different
    lengths within a turn and leave at different turns. Random models are tried in turn until one shows both
    (typically the first or second); every one tried must give identical trajectories. The batched rollout
    also takes the shared-header path (the prompt header prefilled once and its cache repeated), the single
    one does not, so this checks that path too."""
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


def test_generate_returns_each_rows_cache_of_what_it_ran(small):
    """generate(keep_cache=True) hands back, per row, the keys and values of its prompt and all sampled tokens but
    the last; running the same tokens from scratch gives the same keys and values. Identical prompts (dedupe)
    and a shared header are both on."""
    model, tok = small
    cfg, header = R.RolloutConfig(), R.header_text(make_env("sokoban"), R.RolloutConfig())
    prompts = [R.render_ids(tok, R.window_messages(header, [R.turn_text(1, make_env("sokoban").reset(s), 10, cfg)],
                                                    [], 0), cfg) for s in (1000, 1000, 1001)]
    sampled, caches = S.generate(model, tok, prompts, 12, 1.0, torch.Generator().manual_seed(0), keep_cache=True,
                                 dedupe=True)
    for p, s, c in zip(prompts, sampled, caches):
        ids = torch.tensor([p + s[:-1]])
        assert c.length == ids.shape[1]
        kw = cache_keyword(model)
        ref = model.base_model(input_ids=ids, use_cache=True, **{kw: DynamicCache()})[kw]
        for (k, v), (rk, rv, *_) in zip(c.kv, ref):
            assert torch.allclose(k, rk[0], atol=1e-5) and torch.allclose(v, rv[0], atol=1e-5)


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
