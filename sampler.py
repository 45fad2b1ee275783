"""Batched sampling with a KV cache: the replies of every live episode of a turn, decoded in one batch.

This is the engine under rollout.py's multi-turn rollouts (paper section 2.1; RAGEN runs vLLM here). Its own
file because it is engineering, not the paper's method: the caches change the speed of a rollout, not its
distribution (the same math up to float rounding). Optional reading, like the fused loss path in starpo.py.

`generate` runs `model.base_model` and the LM head itself (no `model.generate`): every row of a batch is a
different episode, each row's cache can come from its previous turn (`EpisodeCache`), rows that share a
prompt header run it once, identical first prompts of a group are prefilled once, and finished rows leave the
batch. `ReplyCache` is a DynamicCache that writes each decode step in place. rollout.py's `kv_cache=False`
(re-prefill every turn) is the reference the cached path is tested against.

Deviations from RAGEN (deliberate):
1. Our own decoding loop (RAGEN: vLLM): plain softmax sampling at a temperature, no top-p or top-k; a reply ends
   at an end token or once its text holds "</answer>".
2. Each episode's KV cache is kept across its turns; a history window (context_turns > 0) re-prefills instead.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from starpo import cache_keyword, shared_prefix_len

STOP_TEXT = "</answer>"


@functools.cache  # per tokenizer object (tokenizers hash by identity; the cache holds them)
def closing_tokens(tokenizer) -> frozenset:
    """Ids of the tokens whose text contains ">" (only these can complete "</answer>")."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, p in enumerate(pieces) if p is not None and ">" in p)


@dataclass
class EpisodeCache:
    """The keys and values of the first `length` tokens of one episode's conversation, kept between its turns."""
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [H_kv, t, D]

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[1]


class ReplyCache(DynamicCache):
    """A DynamicCache with room for `capacity` positions per layer, allocated once per reply: a decode step writes
    its column in place, where DynamicCache.update concatenates (a copy of the whole cache at every step).
    The parent class holds views of the filled part, so its length and mask bookkeeping stays its own."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.buffers, self.filled = capacity, [], []  # per layer: (keys, values) [B, H_kv, cap, D]

    def allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, rows: int):
        """Append one layer's empty buffers, shaped like these keys and values ([*, H_kv, *, D])."""
        self.buffers.append(tuple(x.new_empty((rows, x.shape[1], self.capacity, x.shape[3])) for x in (like_k, like_v)))
        self.filled.append(0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == len(self.buffers):
            self.allocate(key_states, value_states, key_states.shape[0])
        (k, v), n, m = self.buffers[layer_idx], self.filled[layer_idx], key_states.shape[2]
        k[:, :, n:n + m], v[:, :, n:n + m] = key_states, value_states
        self.filled[layer_idx] = n + m
        return self._expose(layer_idx)

    def _expose(self, layer_idx):
        (k, v), n = self.buffers[layer_idx], self.filled[layer_idx]
        k, v = k[:, :, :n], v[:, :, :n]
        if hasattr(self, "layers"):  # transformers 5.x keeps one DynamicLayer per layer
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
            layer = self.layers[layer_idx]
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        elif len(self.key_cache) <= layer_idx:  # transformers 4.x keeps two lists
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer_idx], self.value_cache[layer_idx] = k, v
        return k, v

    def batch_select_indices(self, indices: torch.Tensor):
        """Keep rows `indices` (repeats allowed), copying only the filled columns."""
        for layer_idx, ((k, v), n) in enumerate(zip(self.buffers, self.filled)):
            self.buffers[layer_idx] = tuple(x.new_empty((len(indices), *x.shape[1:])) for x in (k, v))
            for new, old in zip(self.buffers[layer_idx], (k, v)):
                new[:, :, :n] = old[indices, :, :n]
            self._expose(layer_idx)


def batch_cache(rows: list[EpisodeCache | None], width: int, capacity: int) -> ReplyCache:
    """The rows' caches as one ReplyCache with room for `capacity` positions, each row left-padded to `width`:
    [B, H_kv, width, D] filled per layer. The pads are zeros; the caller's attention mask hides them."""
    cache = ReplyCache(capacity)
    some = next((r for r in rows if r is not None), None)
    if some is None or width == 0:
        return cache
    for layer, (k0, v0) in enumerate(some.kv):
        cache.allocate(k0[None], v0[None], len(rows))
        for buf, i in zip(cache.buffers[layer], (0, 1)):
            buf[:, :, :width].zero_()
            for j, r in enumerate(rows):
                if r is not None and r.length:
                    buf[j, :, width - r.length:width] = r.kv[layer][i]
        cache.filled[layer] = width
        cache._expose(layer)
    return cache


def row_cache(cache, j: int, spans: list[tuple[int, int]]) -> EpisodeCache:
    """Row j of a batch cache, keeping only the column ranges `spans` (its real tokens, in order)."""
    kv = []
    for layer in cache:  # transformers 4.x yields (keys, values), 5.x (keys, values, sliding window)
        k, v = layer[0][j], layer[1][j]  # [H_kv, T, D]
        kv.append((torch.cat([k[:, a:b] for a, b in spans], dim=1), torch.cat([v[:, a:b] for a, b in spans], dim=1)))
    return EpisodeCache(kv)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
             generator: torch.Generator | None, share_prefix: bool = True, past: list | None = None,
             keep_cache: bool = False, dedupe: bool = False) -> tuple[list[list[int]], list]:
    """Sample one reply per prompt, all rows in one batch with a KV cache; -> (sampled ids per row, caches).

    `past[i]` (EpisodeCache or None) holds row i's keys and values for `prompts[i][:past[i].length]`: only the
    rest runs. With `keep_cache` the second output holds each row's cache after its reply (all but the last
    sampled token, which no forward pass has read yet), to pass as `past` next turn. `dedupe`: identical rows
    without a past (a group's first prompt) are prefilled once and copied. Layout: [each row's past, left-padded
    | its new tokens, left-padded | one column per decode step]; pads are masked, position ids count real tokens.
    A row ends at an end token (EOS or the generation_config's) or when its text holds "</answer>".
    """
    device = next(model.parameters()).device
    B = len(prompts)
    past = list(past) if past is not None else [None] * B
    # distinct rows: with `dedupe`, rows with the same prompt and no past run once, then are copied (src)
    uniq, src, seen = [], [], {}  # seen: key -> its distinct row, numbered by first appearance
    for i, (p, c) in enumerate(zip(prompts, past)):
        key = tuple(p) if (dedupe and c is None) else i
        if key not in seen:
            seen[key] = len(uniq)
            uniq.append(i)
        src.append(seen[key])
    U = len(uniq)
    ctx = [past[i] for i in uniq]
    lens = [0 if c is None else c.length for c in ctx]                  # tokens each row has a cache for
    todo = [prompts[i][n:] for i, n in zip(uniq, lens)]                 # tokens to run now
    cache_kw = cache_keyword(model)  # the KV cache's name differs between transformers versions
    # The prompt header that every row shares (system prompt, instructions) runs once, as a batch of 1, and its
    # cache is repeated to the U rows; it becomes their cache columns.
    P = shared_prefix_len(todo) if (share_prefix and U > 1 and not any(lens)) else 0
    if P:
        header = model.base_model(input_ids=torch.tensor([todo[0][:P]], device=device), use_cache=True,
                                  **{cache_kw: ReplyCache(P)})[cache_kw]
        ctx, lens, todo = [row_cache(header, 0, [(0, P)])] * U, [P] * U, [t[P:] for t in todo]
    C, M = max(lens), max(len(t) for t in todo)
    cache = batch_cache(ctx, C, C + M + max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((U, M), pad, dtype=torch.long)                     # [U, M] new tokens, left-padded
    pos = torch.zeros((U, M), dtype=torch.long)                         # [U, M] their positions
    attn = torch.zeros((U, C + M), dtype=torch.long)                    # [U, C + M] cache + new columns
    for j, (n, t) in enumerate(zip(lens, todo)):
        ids[j, M - len(t):] = torch.tensor(t)
        pos[j, M - len(t):] = torch.arange(n, n + len(t))
        attn[j, C - n:C] = 1
        attn[j, C + M - len(t):] = 1
    spans = [[(C - n, C), (C + M - len(t), None)] for n, t in zip(lens, todo)]  # a row's real columns
    out = model.base_model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=pos.to(device),
                           use_cache=True, **{cache_kw: cache})
    cache = out[cache_kw]
    hidden = out.last_hidden_state[:, -1]                               # [U, H]
    attn = attn.to(device)
    if U < B:  # copy the distinct rows back out to all B
        idx = torch.tensor(src, device=device)
        cache.batch_select_indices(idx)
        hidden, attn, spans = hidden[idx], attn[idx], [spans[s] for s in src]
    head = model.get_output_embeddings()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)  # Qwen2.5: 2 end tokens
    stop_ids = {tokenizer.eos_token_id} | (set(gen_eos) if isinstance(gen_eos, (list, tuple)) else {gen_eos})
    closers = closing_tokens(tokenizer)
    out_ids: list[list[int]] = [[] for _ in range(B)]
    caches: list = [None] * B
    rows = list(range(B))                                               # the original row at each batch position
    live = list(range(B))                                               # batch positions still sampling
    pad = torch.full((B, 1), pad, dtype=torch.long, device=device)      # the token fed to finished positions
    for step in range(max_new_tokens):
        sel = torch.tensor(live, device=device)
        logits = head(hidden[sel]).float()                              # [b, V], live positions only
        if step == 0 and not bool(torch.isfinite(logits).all()):  # one check per reply: diverged weights
            raise FloatingPointError("the policy's logits are not finite: its weights have diverged")
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)      # [b, 1]
        else:
            nxt = logits.argmax(-1, keepdim=True)
        still = []
        for j, t in zip(live, nxt[:, 0].tolist()):                      # one host sync per token step
            r = rows[j]
            out_ids[r].append(t)
            # decode the tail only when this token can close "</answer>" (its text holds a ">"): decoding every
            # row at every step dominated the rollout time of small models
            done = t in stop_ids or (t in closers and STOP_TEXT in tokenizer.decode(out_ids[r][-8:],
                                                                                     skip_special_tokens=False))
            if not done and step < max_new_tokens - 1:  # `in` above: a BPE token may carry text past the ">"
                still.append(j)
            elif keep_cache:  # everything run so far: its prompt and every sampled token but this last one
                caches[r] = row_cache(cache, j, [(a, b if b is not None else attn.shape[1]) for a, b in spans[r]])
        if not still:
            break
        feed = pad[:len(rows)].index_copy(0, sel, nxt)                  # [b, 1]
        # Finished rows leave the batch (and the cache) once they are half of it: dropping rows copies the whole
        # cache, which costs more than carrying a few finished rows through the remaining steps.
        if len(still) <= len(rows) // 2:
            k = torch.tensor(still, device=device)
            cache.batch_select_indices(k)
            rows, feed, attn, still = [rows[j] for j in still], feed[k], attn[k], list(range(len(still)))
        live = still
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
        out = model.base_model(input_ids=feed, attention_mask=attn, position_ids=attn.sum(-1, keepdim=True) - 1,
                               use_cache=True, **{cache_kw: cache})
        cache = out[cache_kw]
        hidden = out.last_hidden_state[:, -1]
    return out_ids, caches
