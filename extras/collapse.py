"""Template collapse (RAGEN-2, ragen/trainer/collapse_metrics.py), beyond the paper: train.py's
`--collapse-every K`. The reasoning Z stays diverse (entropy looks healthy) but stops depending on the input.

`collapse_metrics` estimates the mutual information I(X; Z) with the policy itself, by cross-scoring: each
sampled reasoning z_i (a first turn's text between <think> and </think>) is scored under each distinct prompt
x_j of the sample, l_ij = mean log-prob per token of z_i given x_j (teacher forcing, at the sampling
temperature). With N prompts:
    mi = mean_i l_i,own(i) - mean_i (logsumexp_j l_ij - log N)  (<= log N),  cond_entropy = -mean_i l_i,own(i)
    retrieval_acc = how often argmax_j l_ij is z_i's own prompt (or one with its tokens), against its chance.
As RAGEN: 64 first turns sampled before the filter, columns per group, empty reasonings skipped; only RAGEN's
per-token estimates, in float64 (RAGEN: float32). Without group ids the columns are the distinct prompts;
one column gives mi = 0 and retrieval 1 = chance (RAGEN returns nothing below 2). The MI warning
(`mi_check`) is ours: MI below 0.5x its first 3 measurements twice in a row, when those were above 0.05 nats
(on Bandit MI stays at +-0.002 nats, where a ratio alone fired on noise); RAGEN only logs MI.
"""
from __future__ import annotations

import math
import random
import re
import statistics
import time

import torch

from engine import distributed as dist
from starpo import token_logprobs  # the training path's own log-probs


def mi_check(mon, mi: float, mi_baseline: int = 3, mi_ratio: float = 0.5, mi_patience: int = 2,
             mi_floor: float = 0.05) -> str | None:
    """monitor.echo_check's template-collapse signal, on an iteration that measured collapse/mi: the warning's
    text, or None."""
    mon.mi_history.append(mi)
    if len(mon.mi_history) <= mi_baseline:
        return None
    base = statistics.fmean(mon.mi_history[:mi_baseline])
    # an early MI at noise level has nothing to lose: the prompts carry no information the reasoning uses
    mon.low_mi_run = mon.low_mi_run + 1 if base > mi_floor and mi < mi_ratio * base else 0
    if mon.low_mi_run >= mi_patience:
        return (f"prompt-reasoning MI {mi:.4f} < {mi_ratio}x its early level {base:.4f} for {mon.low_mi_run} "
                f"measurements (template collapse)")
    return None


THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def think_text(reply: str, special_tokens: tuple[str, ...] = ()) -> str:
    """RAGEN's reasoning z of one reply: the first <think>..</think> body (the reply must include the opening
    tag, which this codebase pre-fills: prepend it), special tokens removed, stripped; "" when there is
    none."""
    match = THINK_RE.search(reply)
    text = match.group(1) if match else ""
    for tok in special_tokens:
        text = text.replace(tok, "")
    return text.strip()


def cross_scores(model: torch.nn.Module, prompts: list[list[int]], thoughts: list[list[int]], micro: int = 32,
                 temperature: float = 1.0, fused: bool = True) -> torch.Tensor:
    """l[i, j] = mean log-prob per token of thoughts[i] after prompts[j] -> [n, N] float32 (no grad).

    Every (thought, prompt) pair is one right-padded row [prompt | thought]; `micro` rows run per forward,
    through starpo.token_logprobs (its fused path runs the LM head on the thought tokens only;
    fused=False uses model(...).logits, for any module with that interface)."""
    n, N = len(thoughts), len(prompts)
    device = next(model.parameters()).device
    pairs = [(i, j) for j in range(N) for i in range(n)]
    scores = torch.empty(n, N)
    with torch.no_grad():
        for s in range(0, len(pairs), micro):
            chunk = pairs[s:s + micro]
            width = max(len(prompts[j]) + len(thoughts[i]) for i, j in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)  # [b, L], right padding
            attn = torch.zeros(len(chunk), width, dtype=torch.long)
            read = torch.zeros(len(chunk), width, dtype=torch.bool)  # the thought tokens
            starts = []
            for r, (i, j) in enumerate(chunk):
                row = prompts[j] + thoughts[i]
                ids[r, :len(row)] = torch.tensor(row)
                attn[r, :len(row)] = 1
                read[r, len(prompts[j]):len(row)] = True
                starts.append(len(prompts[j]))
            logp, _ = token_logprobs(model, ids.to(device), attn.to(device), temperature, fused,
                                     positions=read)
            # gather each thought's log-probs left-aligned before summing: the sum then runs in the same
            # order whatever the prompt's length, so a policy that ignores its prompt scores exactly alike in
            # every column
            z_len = torch.tensor([len(thoughts[i]) for i, _ in chunk])  # [b]
            offsets = torch.arange(int(z_len.max()))  # [Z]
            cols = (torch.tensor(starts)[:, None] + offsets).clamp(max=width - 1)  # [b, Z]
            inside = offsets < z_len[:, None]  # [b, Z]
            z_logp = torch.where(inside.to(device), logp.float().gather(1, cols.to(device)),
                                 0.0)  # [b, Z]
            rows, cols_j = zip(*chunk)
            scores[list(rows), list(cols_j)] = z_logp.sum(dim=1).cpu() / z_len
    return scores


def collapse_metrics(model: torch.nn.Module, prompts: list[list[int]], thoughts: list[list[int]],
                     group_ids: list | None = None, micro: int = 32, temperature: float = 1.0,
                     fused: bool = True) -> dict[str, float]:
    """RAGEN-2's template-collapse estimate on a sample of first turns (module docstring): prompts[i] and
    thoughts[i] are the token ids of sample i's prompt (through the opening <think>) and its reasoning.
    Samples with an empty reasoning are skipped, as in RAGEN; `group_ids` (optional, one per sample): columns
    per group as RAGEN (a duplicated prompt then counts once per group in the marginal). -> {mi,
    cond_entropy, reasoning_entropy, retrieval_acc, retrieval_chance, mi_upper_bound (log N), n_prompts (N),
    n_samples}; {} when no sample has a reasoning. Prefix the keys with "collapse/" to log them (echo_check
    reads collapse/mi)."""
    if len(prompts) != len(thoughts) or (group_ids is not None and len(group_ids) != len(prompts)):
        raise ValueError(f"collapse_metrics needs one prompt and one thought per sample (and one group id if "
                         f"given), got {len(prompts)}, {len(thoughts)}, "
                         f"{None if group_ids is None else len(group_ids)}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("collapse_metrics: a prompt is empty; the first reasoning token is predicted from "
                         "it")
    keep = [i for i in range(len(thoughts)) if len(thoughts[i]) > 0]
    if not keep:
        return {}
    prompts = [list(prompts[i]) for i in keep]
    thoughts = [list(thoughts[i]) for i in keep]
    keys = [tuple(p) for p in prompts] if group_ids is None else [group_ids[i] for i in keep]
    columns = sorted(set(keys)) if group_ids is not None else list(dict.fromkeys(keys))  # RAGEN: np.unique
    col_of = {k: j for j, k in enumerate(columns)}
    col_prompt = {}
    for k, p in zip(keys, prompts):
        if col_prompt.setdefault(col_of[k], p) != p:
            raise ValueError(f"collapse_metrics: group {k!r} holds two different prompts (RAGEN raises too)")
    column_prompts = [col_prompt[j] for j in range(len(columns))]
    own = torch.tensor([col_of[k] for k in keys])  # [n] each sample's column

    scores = cross_scores(model, column_prompts, thoughts, micro, temperature, fused).double()  # [n, N]
    n, N = scores.shape
    matched = scores[torch.arange(n), own]  # [n]
    marginal = torch.logsumexp(scores, dim=1) - math.log(N)  # [n]
    # retrieval: a column with the same prompt tokens as the own one counts as correct (RAGEN's signatures)
    signature = {}
    sig = torch.tensor([signature.setdefault(tuple(p), len(signature)) for p in column_prompts])  # [N]
    same = (sig[:, None] == sig[None, :]).sum(dim=1).double()  # [N] columns sharing each column's prompt
    predicted = scores.argmax(dim=1)  # first maximum on ties, as numpy's
    return {
        "mi": float(matched.mean() - marginal.mean()),
        "cond_entropy": float(-matched.mean()),
        "reasoning_entropy": float(-marginal.mean()),
        "retrieval_acc": float((sig[predicted] == sig[own]).double().mean()),
        "retrieval_chance": float((same[own] / N).mean()),
        "mi_upper_bound": math.log(N),
        "n_prompts": N,
        "n_samples": n,
    }


def measure_collapse(model, tok, trajs: list, samples: int, seed: int, amp=None,
                     temperature: float = 1.0) -> dict:
    """`collapse_metrics` on up to `samples` first turns of this iteration's rollouts, drawn uniformly
    without replacement (RAGEN: 64, before the filter), columns by group as RAGEN's; -> its keys under
    "collapse/", plus "time/collapse" (seconds). x = the first turn's prompt through the pre-filled <think>
    (the tokens before the first sampled one, from the loss mask), z = the reasoning of its reply,
    re-tokenised."""
    t0 = time.time()
    pick = sorted(random.Random(seed).sample(range(len(trajs)), min(samples, len(trajs))))
    first = [trajs[i] for i in pick if trajs[i].turns and trajs[i].segments]
    prompts = [t.segments[0].input_ids[:t.segments[0].loss_mask.index(1)] for t in first]
    special = tuple(tok.all_special_tokens)
    thoughts = [tok(think_text("<think>" + t.turns[0].reply.removeprefix("<think>"), special),
                    add_special_tokens=False)["input_ids"] for t in first]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        out = collapse_metrics(model, prompts, thoughts, group_ids=[t.group_id for t in first],
                               temperature=temperature)
    model.train(was_training)
    return {**{f"collapse/{k}": v for k, v in out.items()}, "time/collapse": time.time() - t0}


def plug(cfg, points: dict, run: dict) -> None:
    """train.py's --collapse-every K: a hook after the rollout measures iteration 1 and every K-th (rank 0,
    before the filter, as RAGEN)."""
    def measure(it: int, trajs: list, m: dict) -> None:
        if it % cfg.collapse_every == 0 and dist.is_main():
            m.update(measure_collapse(run["policy"], run["tok"], trajs, cfg.collapse_samples, run["seed"](it),
                                      run["amp"], cfg.temperature))
    points["after_rollout"].append(measure)
