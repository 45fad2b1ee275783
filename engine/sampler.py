"""The rollout engine: every live episode's reply of a turn decoded in one batch, on one static KV cache.

The engine under rollout.py's multi-turn rollouts (paper section 2.1; RAGEN runs vLLM here): it changes the
speed of a rollout, not its distribution (tested). `Engine` (Qwen2 and Llama, the paper's family) keeps one
preallocated cache [rows, H_kv, capacity, D] per layer for all the episodes of a rollout, across their turns;
a turn prefills only what is new (a changed prompt keeps its common prefix; rows that share a whole first
prompt, a group, are prefilled once). A decode step is a hand-written forward over the model's own modules
(`forward`) with static shapes: finished rows are fed a pad and masked, sampling and the stop test (an
automaton over token pieces for "</answer>") run on the device, and on CUDA each step is one CUDA graph per
batch bucket, the host looking at the rows every `sync_every` steps. Plain softmax sampling, no top-p/top-k.
`reference_generate` is the Hugging Face forward, every turn re-prefilled: the tests hold the engine to it,
and it runs the architectures the engine does not know (said once). Adding one: docs/engine.md.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engine.logprobs import cache_keyword
from engine.models import autocast_dtype

STOP_TEXT = "</answer>"
ARCHS = ("qwen2", "llama")  # decoder layers that `forward` reproduces (tested against their HF forward)


# ------------------------------------------------------------------------------------- stopping
@functools.cache  # per tokenizer object (tokenizers hash by identity; the cache holds them)
def stop_table(tokenizer, vocab: int | None = None) -> torch.Tensor:
    """[len(STOP_TEXT) + 1, V] automaton: state s = how many characters of "</answer>" the reply's text ends with
    (all of them = stopped, absorbing); table[s, t] = the state after token t. Built from token pieces (the
    characters of "</answer>" are themselves in byte-level and sentencepiece vocabularies). `vocab`: the model's
    output size when it exceeds the tokenizer's (Qwen2.5 pads its embeddings): those ids reset the automaton."""
    S, m = STOP_TEXT, len(STOP_TEXT)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = torch.zeros(m + 1, max(len(pieces), vocab or 0), dtype=torch.long)
    table[m] = m

    def run(s: int, text: str) -> int:  # "</answer>" has no border but "<": a mismatch restarts at 0 or 1
        for c in text:
            s = s + 1 if S[s] == c else int(c == "<")
            if s == m:
                return m
        return s

    for t, p in enumerate(pieces):
        if not p or not any(c in S for c in p):
            continue  # no character of "</answer>": every state goes to 0 (the table's zeros)
        for s in range(m):
            table[s, t] = run(s, p)
    return table


def end_ids(model, tokenizer) -> list[int]:
    """The tokens that end a reply: EOS and the generation_config's (Qwen2.5 has two)."""
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set(gen if isinstance(gen, (list, tuple)) else [gen])
    return sorted(i for i in ids if i is not None)


def sample(logits: torch.Tensor, temperature: float, generator, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of logits [b, V] (only `rows`, if given; the others get 0): argmax at temperature 0."""
    x = logits if rows is None else logits[rows]
    if temperature > 0:
        t = torch.multinomial(torch.softmax(x / temperature, dim=-1), 1, generator=generator)[:, 0]
    else:
        t = x.argmax(-1)
    return t if rows is None else torch.zeros(len(logits), dtype=t.dtype, device=t.device).index_copy(0, rows, t)


# ------------------------------------------------------------------------------------- the engine
def unsupported(model) -> str | None:
    """Why the engine cannot run this model (None: it can)."""
    cfg, base = model.config, getattr(model, "model", None)
    if cfg.model_type not in ARCHS:
        return f"architecture {cfg.model_type!r} (the engine knows {', '.join(ARCHS)})"
    if getattr(cfg, "use_sliding_window", False) or not hasattr(base, "rotary_emb"):
        return f"this {cfg.model_type} configuration (sliding-window attention or an older transformers)"
    return None


@functools.cache
def say_once(text: str) -> None:
    print(text, file=sys.stderr)


def rotate(x, cos, sin):  # rotary positions: x [b, t, H, D], cos/sin [b, t, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, :, None] + torch.cat((-x2, x1), dim=-1) * sin[:, :, None]


def forward(model, ids: torch.Tensor, pos: torch.Tensor, K: list, V: list) -> torch.Tensor:
    """Hidden states [b, t, H] of tokens ids [b, t] at positions pos [b, t] (= their cache columns): writes their
    keys and values into K[l], V[l] ([b, H_kv, L, D] per layer) and attends, per query, to columns <= its own."""
    m = model.model
    b, t = ids.shape
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, pos)
    rows = torch.arange(b, device=ids.device)[:, None].expand(b, t)
    L = K[0].shape[2]
    visible = torch.arange(L, device=ids.device)[None, None] <= pos[:, :, None]   # [b, t, L]
    for layer, k_cache, v_cache in zip(m.layers, K, V):
        a = layer.self_attn
        D = a.head_dim
        x = layer.input_layernorm(h)
        q = rotate(a.q_proj(x).view(b, t, -1, D), cos, sin)                        # [b, t, Hq, D]
        k = rotate(a.k_proj(x).view(b, t, -1, D), cos, sin)                        # [b, t, Hkv, D]
        k_cache[rows, :, pos] = k.to(k_cache.dtype)
        v_cache[rows, :, pos] = a.v_proj(x).view(b, t, -1, D).to(v_cache.dtype)
        Hkv = k_cache.shape[1]
        g = q.shape[2] // Hkv  # query heads per KV head: HF's repeat_kv pairs query head i with KV head i // g
        q = q.transpose(1, 2).reshape(b, Hkv, g * t, D)                            # [b, Hkv, g*t, D]
        mask = visible[:, None, None].expand(b, 1, g, t, L).reshape(b, 1, g * t, L)
        o = F.scaled_dot_product_attention(q.to(k_cache.dtype), k_cache, v_cache, attn_mask=mask,
                                           scale=getattr(a, "scaling", D ** -0.5))
        h = h + a.o_proj(o.reshape(b, -1, t, D).transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return m.norm(h)


class Engine:
    """One rollout's episodes on one static KV cache (module docstring). `generate(slots, prompts, ...)` samples
    one reply per slot (episode); a slot that was in the previous call keeps its cache, slots left out are freed."""

    def __init__(self, model, tokenizer, rows: int, graphs: bool | None = None, sync_every: int | None = None):
        p = next(model.parameters())
        self.model, self.device, self.rows = model, p.device, rows
        self.amp = autocast_dtype(p.device)
        self.dtype = self.amp or p.dtype
        cuda = p.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs and cuda
        # the host reads the rows every step on CPU (free there): sampling then draws for live rows only
        self.sync_every = sync_every or (16 if cuda else 1)
        self.table = stop_table(tokenizer, model.get_output_embeddings().weight.shape[0]).to(p.device)
        self.is_end = torch.zeros(self.table.shape[1], dtype=torch.bool, device=p.device)
        self.is_end[end_ids(model, tokenizer)] = True
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.K = self.V = None                     # per layer [rows, H_kv, capacity, D]
        self.capacity = 0
        self.slot_at: list = [None] * rows         # the slot (episode) whose cache is in each row
        self.cached: dict[int, list[int]] = {}     # slot -> the token ids in its cache columns
        self.ids = torch.full((rows, 1), self.pad, dtype=torch.long, device=p.device)  # the decode step's inputs
        self.pos = torch.zeros(rows, dtype=torch.long, device=p.device)               # each row's next column
        self.captured: dict = {}                   # bucket -> (graph, its logits [bucket, V])
        self.pool = None

    def reserve(self, need: int):
        """Room for `need` columns; growing copies the cache (and drops the graphs, which hold its address)."""
        if need <= self.capacity:
            return
        cfg, a = self.model.config, self.model.model.layers[0].self_attn
        cap = -(-(need + need // 2) // 256) * 256  # room for the next turns: fewer copies and captures
        limit = getattr(cfg, "max_position_embeddings", None)
        cap = max(need, min(cap, limit)) if limit else cap
        shape = (self.rows, cfg.num_key_value_heads, cap, a.head_dim)
        K = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        V = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        if self.K is not None:
            for new, old in zip(K + V, self.K + self.V):
                new[:, :, :self.capacity] = old
        self.K, self.V, self.capacity, self.captured, self.pool = K, V, cap, {}, None

    def permute(self, order: list[int], width: int, state: list[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Row i takes old row order[i] (cache columns < width, position, slot, and each per-row `state`)."""
        if order == list(range(len(order))):
            return list(state)
        idx = torch.tensor(order, device=self.device)
        n = len(order)
        for buf in self.K + self.V:
            buf[:n, :, :width] = buf[idx, :, :width]
        self.pos[:n] = self.pos[idx]
        self.slot_at[:n] = [self.slot_at[i] for i in order]
        return [s[idx] for s in state]

    def prefill(self, rows: list[int], todo: list[list[int]], start: list[int]) -> torch.Tensor:
        """Run each row's new tokens from its column `start`; -> the logits after its last one [len(rows), V]."""
        M = max(len(t) for t in todo)
        out = []
        step = max(1, 8192 // M)  # rows per forward: bounds the attention scores' memory
        for a in range(0, len(rows), step):
            r, tt, s0 = rows[a:a + step], todo[a:a + step], start[a:a + step]
            width = max(s0) + M
            ids = torch.tensor([t + [self.pad] * (M - len(t)) for t in tt], device=self.device)         # [b, M]
            pos = torch.tensor(s0, device=self.device)[:, None] + torch.arange(M, device=self.device)  # [b, M]
            if r == list(range(r[0], r[0] + len(r))):  # consecutive rows (every turn but a group's first): views
                K = [buf[r[0]:r[0] + len(r), :, :width] for buf in self.K]
                V = [buf[r[0]:r[0] + len(r), :, :width] for buf in self.V]
                h = forward(self.model, ids, pos, K, V)
            else:  # a copy of these rows' columns, written back
                idx = torch.tensor(r, device=self.device)
                K = [buf[idx, :, :width] for buf in self.K]
                V = [buf[idx, :, :width] for buf in self.V]
                h = forward(self.model, ids, pos, K, V)
                for buf, new in zip(self.K + self.V, K + V):
                    buf[idx, :, :width] = new
            last = torch.tensor([len(t) - 1 for t in tt], device=self.device)
            out.append(self.model.get_output_embeddings()(h[torch.arange(len(r)), last]).float())
        return torch.cat(out)

    def step(self, b: int, full: bool) -> torch.Tensor:
        """One decode step of rows :b: feed self.ids at self.pos; -> logits [b, V]. `full`: attend over the whole
        capacity (static shapes, for a graph), else over the columns in use (eager)."""
        L = self.capacity if full else int(self.width)
        K = [buf[:b, :, :L] for buf in self.K]
        V = [buf[:b, :, :L] for buf in self.V]
        h = forward(self.model, self.ids[:b], self.pos[:b, None], K, V)
        return self.model.get_output_embeddings()(h[:, -1]).float()

    def decode(self, b: int) -> torch.Tensor:
        if not self.graphs:
            return self.step(b, full=False)
        bucket = next((x for x in (1, 2, 4, 8, 16, 32, 64, 128) if x >= b), self.rows)
        bucket = min(bucket, self.rows)
        if bucket not in self.captured:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            amp = dict(device_type="cuda", dtype=self.amp, enabled=self.amp is not None, cache_enabled=False)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.autocast(**amp):
                for _ in range(2):  # warm-up outside the graph (lazy inits); writes only beyond each row's length
                    self.step(bucket, full=True)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), torch.autocast(**amp):
                logits = self.step(bucket, full=True)
            self.captured[bucket] = (graph, logits)
        graph, logits = self.captured[bucket]
        graph.replay()
        return logits[:b]  # overwritten by the next replay: the caller uses it before then

    @torch.no_grad()
    def generate(self, slots: list[int], prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 generator: torch.Generator | None) -> list[list[int]]:
        B, dev = len(slots), self.device
        # 1. the asked slots move to rows 0..B-1 in order (their caches with them); the other slots are over
        where = {s: i for i, s in enumerate(self.slot_at) if s is not None}
        spare = [i for i in range(self.rows) if self.slot_at[i] not in slots]
        order = [where[s] if s in where else spare.pop() for s in slots]
        for s in list(self.cached):
            if s not in slots:
                del self.cached[s]
        # 2. what each row keeps (the longest common prefix with what it holds; at least one token runs now)
        start = []
        for s, p in zip(slots, prompts):
            c, n = self.cached.get(s, []), 0
            while n < min(len(c), len(p) - 1) and c[n] == p[n]:
                n += 1
            start.append(n)
        self.reserve(max(start) + max(len(p) - n for p, n in zip(prompts, start)) + max_new_tokens)
        self.permute(order[:B], max(int(self.pos.max()), 1))
        self.slot_at = list(slots) + [None] * (self.rows - B)
        # 3. prefill, once per distinct whole prompt among rows that start from nothing (a group's first turn)
        first: dict = {}
        src = [first.setdefault(tuple(p), i) if n == 0 else i for i, (p, n) in enumerate(zip(prompts, start))]
        run = sorted(set(src))
        logits = self.prefill(run, [prompts[i][start[i]:] for i in run], [start[i] for i in run])
        logits = logits[torch.tensor([run.index(j) for j in src], device=dev)]           # [B, V]
        copy = [i for i in range(B) if src[i] != i]
        if copy:
            w = max(len(prompts[i]) for i in copy)
            di, si = torch.tensor(copy, device=dev), torch.tensor([src[i] for i in copy], device=dev)
            for buf in self.K + self.V:
                buf[di, :, :w] = buf[si, :, :w]
        self.pos[:B] = torch.tensor([len(p) for p in prompts], device=dev)
        if not bool(torch.isfinite(logits).all()):  # one check per turn: diverged weights
            raise FloatingPointError("the policy's logits are not finite: its weights have diverged")
        # 4. decode: every row samples each step; a finished row is fed a pad at its next column and stays there
        b, row = B, torch.arange(B, device=dev)                       # row: each batch row's index in `slots`
        out = torch.full((B, max_new_tokens), self.pad, dtype=torch.long, device=dev)   # [B, max_new]
        length = torch.zeros(B, dtype=torch.long, device=dev)        # tokens sampled per row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        state = torch.zeros(B, dtype=torch.long, device=dev)          # the "</answer>" automaton
        live = list(range(B))
        self.width = int(self.pos[:B].max()) + 1
        for step in range(max_new_tokens):
            exact = self.sync_every == 1  # the host knows the live rows: draw for those only (as a re-batch would)
            t = sample(logits, temperature, generator, torch.tensor(live, device=dev) if exact else None)
            t = torch.where(done, self.pad, t)
            out[row[:b], step] = t
            length[row[:b]] += (~done).long()
            state = self.table[state, t]
            done = done | self.is_end[t] | (state == len(STOP_TEXT))
            if step == max_new_tokens - 1:
                break
            if exact or step % self.sync_every == self.sync_every - 1:
                live = (~done).nonzero()[:, 0].tolist()
                if not live:
                    break
                if len(live) <= b // 2:  # finished rows move behind the live ones: a smaller batch (bucket)
                    keep = live + [i for i, x in enumerate(done.tolist()) if x]
                    done, state, t, row_b = self.permute(keep, self.width, [done, state, t, row[:b]])
                    row = torch.cat([row_b, row[b:]])
                    done, state, t = done[:len(live)], state[:len(live)], t[:len(live)]
                    b, live = len(live), list(range(len(live)))
            self.ids[:b, 0] = torch.where(done, self.pad, t)
            logits = self.decode(b)
            self.pos[:b] += (~done).long()
            self.width += 1
        # 5. back to the host once: each row's reply, and what its cache now holds (all but the last token)
        out, length = out.tolist(), length.tolist()
        replies = [o[:n] for o, n in zip(out, length)]
        for s, p, r in zip(slots, prompts, replies):
            self.cached[s] = p + r[:-1]
        return replies


# ------------------------------------------------------------------------------------- the reference path
@torch.no_grad()
def reference_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                       generator: torch.Generator | None) -> list[list[int]]:
    """One reply per prompt with the Hugging Face forward and cache: left-padded prompts, one batch, the same
    sampling (live rows only, in order) and stop test as the engine; nothing kept between calls."""
    device = next(model.parameters()).device
    B, M = len(prompts), max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (M - len(p)) + p for p in prompts], device=device)          # [B, M]
    attn = torch.tensor([[0] * (M - len(p)) + [1] * len(p) for p in prompts], device=device)  # [B, M]
    kw = cache_keyword(model)
    out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                           use_cache=True, **{kw: DynamicCache()})
    head = model.get_output_embeddings()
    table = stop_table(tokenizer, head.weight.shape[0]).to(device)
    ends = set(end_ids(model, tokenizer))
    replies, state, live = [[] for _ in prompts], [0] * B, list(range(B))
    for step in range(max_new_tokens):
        logits = head(out.last_hidden_state[:, -1]).float()
        if step == 0 and not bool(torch.isfinite(logits).all()):
            raise FloatingPointError("the policy's logits are not finite: its weights have diverged")
        t = sample(logits, temperature, generator, torch.tensor(live, device=device)).tolist()
        still = []
        for i in live:
            replies[i].append(t[i])
            state[i] = int(table[state[i], t[i]])
            if t[i] not in ends and state[i] < len(STOP_TEXT):
                still.append(i)
        live = still
        if not live or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, attn.new_ones(B, 1)], dim=1)
        out = model.base_model(input_ids=torch.tensor(t, device=device)[:, None], attention_mask=attn,
                               position_ids=attn.sum(-1, keepdim=True) - 1, use_cache=True,
                               **{kw: out[kw]})
    return replies


def make_sampler(model, tokenizer, rows: int, cfg):
    """rollout.py's sampler of a turn's replies: the engine (RAGEN: vLLM) or, with `cfg.kv_cache=False` or an
    architecture it does not know, the Hugging Face forward (the reference path, said once)."""
    why = unsupported(model) if cfg.kv_cache else None
    if cfg.kv_cache and not why:
        engine = Engine(model, tokenizer, rows, graphs=cfg.cuda_graphs)
        return lambda live, prompts, gen: engine.generate(live, prompts, cfg.max_new_tokens, cfg.temperature,
                                                          gen)
    if why:
        say_once(f"note: the rollout engine does not know {why}: sampling with the Hugging Face forward")
    return lambda live, prompts, gen: reference_generate(model, tokenizer, prompts, cfg.max_new_tokens,
                                                         cfg.temperature, gen)
