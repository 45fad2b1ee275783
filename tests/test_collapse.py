"""Tests for monitor.collapse_metrics (RAGEN-2's template-collapse estimator): against a slow per-pair loop, and
its invariants: a policy that ignores its prompt gives MI ~ 0 and chance retrieval, identical prompts give MI 0.

Run from the repository root:  python -m pytest -q tests/test_collapse.py   (a few seconds on one core)
"""
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extras.collapse import collapse_metrics, cross_scores, think_text  # noqa: E402

torch.set_num_threads(1)
V, THINK = 64, 5  # vocabulary; the token every prompt ends with (RAGEN's prompts end with "<think>")


def tiny_qwen(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64)
    return transformers.Qwen2ForCausalLM(cfg).eval()


class Bigram(torch.nn.Module):
    """A policy whose next-token distribution depends on the current token only: past the prompt's last token
    (the same for every prompt) it ignores its input. model(input_ids, attention_mask).logits, like HF."""

    def __init__(self, table=None, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=gen) if table is None else table)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


def sample(seed, n_prompts=4, per_prompt=3):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    prompts = [[rand(6, V) for _ in range(rand(2, 9))] + [THINK] for _ in range(n_prompts)]
    xs, zs = [], []
    for p in prompts:
        for _ in range(per_prompt):
            xs.append(p)
            zs.append([rand(6, V) for _ in range(rand(1, 8))])
    return xs, zs


def slow_collapse(model, prompts, thoughts, temperature=1.0, group_ids=None):
    """One forward per (thought, column) pair, statistics on Python floats, as RAGEN's collapse_metrics.py."""
    keep = [i for i in range(len(thoughts)) if thoughts[i]]
    keys = [tuple(prompts[i]) if group_ids is None else group_ids[i] for i in keep]
    columns = sorted(set(keys)) if group_ids is not None else list(dict.fromkeys(keys))
    col_prompt = [next(prompts[i] for i, k in zip(keep, keys) if k == c) for c in columns]
    N = len(columns)
    l = []  # noqa: E741
    with torch.no_grad():
        for i in keep:
            row = []
            for p in col_prompt:
                ids = torch.tensor([p + thoughts[i]])
                logp = torch.log_softmax(model(ids, torch.ones_like(ids)).logits[0].float() / temperature, dim=-1)
                row.append(sum(float(logp[len(p) + k - 1, z]) for k, z in enumerate(thoughts[i])) / len(thoughts[i]))
            l.append(row)
    own = [columns.index(k) for k in keys]
    matched = [l[r][own[r]] for r in range(len(l))]
    marginal = [math.log(sum(math.exp(x) for x in row)) - math.log(N) for row in l]
    same = lambda a, b: col_prompt[a] == col_prompt[b]  # noqa: E731
    predicted = [max(range(N), key=lambda j: (row[j], -j)) for row in l]  # first maximum
    n = len(l)
    return l, {
        "mi": sum(matched) / n - sum(marginal) / n,
        "cond_entropy": -sum(matched) / n,
        "reasoning_entropy": -sum(marginal) / n,
        "retrieval_acc": sum(same(predicted[r], own[r]) for r in range(n)) / n,
        "retrieval_chance": sum(sum(same(j, own[r]) for j in range(N)) / N for r in range(n)) / n,
        "mi_upper_bound": math.log(N), "n_prompts": N, "n_samples": n,
    }


@pytest.mark.parametrize("fused,micro,temperature", [(True, 5, 1.0), (False, 4, 0.7), (True, 64, 0.7)])
def test_collapse_metrics_equal_a_slow_per_pair_loop(fused, micro, temperature):
    model = tiny_qwen()
    prompts, thoughts = sample(0)
    prompts.append(prompts[0])
    thoughts.append([])  # an empty reasoning is skipped, as RAGEN does
    out = collapse_metrics(model, prompts, thoughts, micro=micro, temperature=temperature, fused=fused)
    l, want = slow_collapse(model, prompts, thoughts, temperature)
    distinct = [list(p) for p in dict.fromkeys(map(tuple, prompts))]
    torch.testing.assert_close(cross_scores(model, distinct, thoughts[:-1], micro, temperature, fused),
                               torch.tensor(l), atol=1e-5, rtol=1e-5)
    assert set(out) == set(want)
    for k, v in want.items():
        assert out[k] == pytest.approx(v, abs=1e-5), k
    assert out["n_prompts"] == 4 and out["n_samples"] == 12
    assert out["mi"] <= out["mi_upper_bound"] + 1e-9  # matched <= logsumexp: MI <= log N, sample by sample


def test_group_ids_are_ragen_columns_duplicated_prompts_included():
    model = tiny_qwen(1)
    prompts, thoughts = sample(1, n_prompts=3)
    groups = [i // 3 for i in range(9)]
    prompts[6:9] = [prompts[0]] * 3  # group 2 has group 0's prompt: two columns, one signature
    out = collapse_metrics(model, prompts, thoughts, group_ids=groups, micro=4)
    _, want = slow_collapse(model, prompts, thoughts, group_ids=groups)
    for k, v in want.items():
        assert out[k] == pytest.approx(v, abs=1e-5), k
    assert out["n_prompts"] == 3 and out["retrieval_chance"] == pytest.approx((2 / 3 * 6 + 1 / 3 * 3) / 9)
    # without group ids the duplicated prompt is one column
    assert collapse_metrics(model, prompts, thoughts)["n_prompts"] == 2


def test_a_policy_that_ignores_its_prompt_has_mi_zero_and_chance_retrieval():
    prompts, thoughts = sample(2, n_prompts=4, per_prompt=4)
    out = collapse_metrics(Bigram(), prompts, thoughts, micro=3, fused=False)
    assert abs(out["mi"]) < 1e-6
    # every column scores alike, so argmax picks the first: right for the first prompt's 4 samples of 16
    assert out["retrieval_acc"] == out["retrieval_chance"] == 0.25
    assert out["cond_entropy"] > 0 and out["reasoning_entropy"] == pytest.approx(out["cond_entropy"], abs=1e-6)
    # a real transformer with its attention and MLP outputs zeroed: only the current token reaches the head
    model = tiny_qwen(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    assert abs(collapse_metrics(model, prompts, thoughts, micro=5)["mi"]) < 1e-5


def test_a_policy_that_reads_its_prompt_has_high_mi_and_retrieval():
    # prompt j ends with token 10 + j and its thoughts start with 30 + j, which only that token makes likely
    table = torch.zeros(V, V)
    for j in range(4):
        table[10 + j, 30 + j] = 8.0
    prompts = [[7, 8, 10 + j] for j in range(4) for _ in range(2)]
    thoughts = [[30 + j, 40] for j in range(4) for _ in range(2)]
    out = collapse_metrics(Bigram(table), prompts, thoughts, fused=False)
    assert out["retrieval_acc"] == 1.0 and out["retrieval_chance"] == 0.25
    assert math.log(4) - 0.2 < out["mi"] <= math.log(4)


def test_identical_prompts_give_mi_exactly_zero():
    model = tiny_qwen(4)
    _, thoughts = sample(4, n_prompts=2, per_prompt=3)
    prompts = [[9, 9, 12, THINK]] * len(thoughts)
    out = collapse_metrics(model, prompts, thoughts, micro=4)
    assert out["mi"] == 0.0 and out["n_prompts"] == 1
    assert out["retrieval_acc"] == out["retrieval_chance"] == 1.0
    assert out["cond_entropy"] == out["reasoning_entropy"] > 0
    # RAGEN's columns (one per group, all the same prompt): MI 0 up to rounding, every retrieval correct
    out = collapse_metrics(model, prompts, thoughts, group_ids=[0, 0, 0, 1, 1, 1], micro=4)
    assert abs(out["mi"]) < 1e-6 and out["n_prompts"] == 2
    assert out["retrieval_acc"] == out["retrieval_chance"] == 1.0


def test_bad_inputs_and_no_reasoning():
    model = Bigram()
    assert collapse_metrics(model, [[1, THINK], [2, THINK]], [[], []], fused=False) == {}
    with pytest.raises(ValueError, match="one prompt and one thought per sample"):
        collapse_metrics(model, [[1, THINK]], [[3], [4]], fused=False)
    with pytest.raises(ValueError, match="a prompt is empty"):
        collapse_metrics(model, [[], [1]], [[3], [4]], fused=False)
    with pytest.raises(ValueError, match="group 0 holds two different prompts"):
        collapse_metrics(model, [[1, THINK], [2, THINK]], [[3], [4]], group_ids=[0, 0], fused=False)


def test_think_text_is_ragens_extraction():
    assert think_text("<think> go left\n then up </think> <answer>Left</answer>") == "go left\n then up"
    assert think_text("<think>a</think><think>b</think>") == "a"
    assert think_text("<answer>Left</answer>") == ""
    assert think_text("<think> x<|im_end|> </think>", ("<|im_end|>",)) == "x"
