"""The rollout engine: every live episode's reply of a turn decoded in one batch, on one static KV cache.

The engine under rollout.py's multi-turn rollouts (paper section 2.1; RAGEN runs vLLM here): it changes the
speed of a rollout, not its distribution (tested). `Engine` (Qwen2 and Llama, the paper's family) keeps one
cache [rows, H_kv, capacity, D] per layer for all the episodes, across their turns and across rollouts (one
engine per model and process); a turn prefills only what is new, and rows that share a whole first prompt (a
group) are prefilled once. A decode step is a hand-written forward over the model's own weights (`forward`,
bf16 copies refreshed in place once per rollout on CUDA) with static shapes: finished rows are fed a pad and
masked, sampling and the stop test run on the device, and on CUDA each step is one CUDA graph per (batch,
length) bucket, the host looking at the rows every `sync_every` steps. Plain softmax sampling at a
temperature (`draw_rule`: how each device draws). `reference_generate` is the Hugging Face forward, every
turn re-prefilled: the tests hold the engine to it, and it runs the architectures the engine does not know.
Adding one: docs/engine.md.
"""
from __future__ import annotations

import functools
import sys
import weakref

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engine.logprobs import cache_keyword, shared_prefix_len
from engine.models import autocast_dtype

STOP_TEXT = "</answer>"
ARCHS = ("qwen2", "llama")  # decoder layers that `forward` reproduces (tested against their HF forward)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
LENGTH_BUCKET = 256  # a CUDA graph attends over a multiple of this many cache columns


# ---- stopping and sampling

@functools.cache  # per tokenizer object (tokenizers hash by identity; the cache holds them)
def stop_table(tokenizer, vocab: int | None = None) -> torch.Tensor:
    """[len(STOP_TEXT) + 1, V] automaton: state s = how many characters of "</answer>" the reply's text ends
    with (all of them: stopped, absorbing); table[s, t] = the state after token t, from token pieces. `vocab`:
    the model's output size when it exceeds the tokenizer's (Qwen2.5 pads): those ids reset the automaton."""
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


def cache_dtype(model) -> torch.dtype:
    """The dtype of the engine's KV cache for `model`: the autocast dtype on its device, else its weights'."""
    p = next(model.parameters())
    return autocast_dtype(p.device) or p.dtype


SMALL_VOCAB = 4096  # the tiny prior's 668 words; hub vocabularies are 32k-152k


def draw_rule(device: torch.device, vocab: int) -> str:
    """How `sample` draws on this device for this vocabulary, decided here once for the engine and the
    reference path alike (all three draw from the same distribution; they spend the generator differently):
    CUDA `exponential` (no host sync); a CPU `multinomial` for small vocabularies (the tiny prior: its numbers
    stay those of every run so far) and `inverse_cdf` for hub-size ones. torch.multinomial's CPU kernel draws
    one Exp(1) number per vocabulary entry: measured 62-69 ms at [64, 49152] against 1.4-2.4 ms for one
    uniform a row through the cumulative probabilities, the largest part of a CPU decode step of SmolLM2."""
    if device.type == "cuda":
        return "exponential"
    return "multinomial" if vocab < SMALL_VOCAB else "inverse_cdf"


def sample(logits: torch.Tensor, temperature: float, generator, rows: torch.Tensor | None = None,
           draw: str = "multinomial") -> torch.Tensor:
    """One token per row of logits [b, V] (only `rows`, if given; the others get 0); argmax at temperature 0.
    `draw` (see draw_rule): `multinomial`; `exponential`, argmax of p / Exp(1) noise; `inverse_cdf`, the first
    token whose cumulative probability exceeds a uniform draw u * (the row's total)."""
    x = logits if rows is None else logits[rows]
    if temperature <= 0:
        t = x.argmax(-1)
    elif draw == "exponential":
        noise = torch.empty(x.shape, dtype=torch.float32, device=x.device).exponential_(generator=generator)
        t = (torch.softmax(x.float() / temperature, dim=-1) / noise).argmax(-1)
    elif draw == "inverse_cdf":
        c = torch.softmax(x.float() / temperature, dim=-1).cumsum(-1)  # [b, V]
        total = c[:, -1:]
        u = torch.rand(total.shape, generator=generator, device=x.device) * total  # [b, 1], in [0, total)
        # right=True: c[t - 1] <= u < c[t], so p[t] > 0; u rounded up to the total would pick past the end
        u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
        t = torch.searchsorted(c, u, right=True)[:, 0]
    else:
        t = torch.multinomial(torch.softmax(x / temperature, dim=-1), 1, generator=generator)[:, 0]
    if rows is None:
        return t
    return torch.zeros(len(logits), dtype=t.dtype, device=t.device).index_copy(0, rows, t)


def token_logp(logits: torch.Tensor, t: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(t) [b] of each row's sampled token at the sampling temperature (greedy: at 1)."""
    x = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(x, dim=-1).gather(1, t[:, None])[:, 0]


# ---- the forward

def unsupported(model) -> str | None:
    """Why the engine cannot run this model (None: it can)."""
    cfg, base = model.config, getattr(model, "model", None)
    if cfg.model_type not in ARCHS:
        return f"architecture {cfg.model_type!r} (the engine knows {', '.join(ARCHS)})"
    if getattr(cfg, "use_sliding_window", False) or not hasattr(base, "rotary_emb"):
        return f"this {cfg.model_type} configuration (sliding-window attention or an older transformers)"
    return None


def dynamic_rope(model) -> bool:
    """Whether the rotary scaling depends on the length (dynamic, longrope): HF decides it on the host at each
    call, which a CUDA graph cannot capture."""
    rope = getattr(model.config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope")


@functools.cache
def say_once(text: str) -> None:
    print(text, file=sys.stderr)


def rotate(x, cos, sin):  # rotary positions: x [b, t, H, D], cos/sin [b, t, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, :, None] + torch.cat((-x2, x1), dim=-1) * sin[:, :, None]


class Weights:
    """bf16 copies of a model's linear weights (LoRA merged) for the engine's forward on CUDA: under autocast
    every replay would otherwise cast the fp32 weights again (the cast cache is off in a CUDA graph).
    `refresh` copies the current weights in place, so the graphs keep their addresses."""

    NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, model, dtype):
        self.model, self.dtype = model, dtype
        self.layers = [{n: self.effective(self.module(layer, n), copy=True) for n in self.NAMES}
                       for layer in model.model.layers]
        self.head = model.get_output_embeddings().weight.detach().to(dtype).clone()

    @staticmethod
    def module(layer, name: str):
        return getattr(layer.mlp if name in ("gate_proj", "up_proj", "down_proj") else layer.self_attn, name)

    def effective(self, m, copy: bool = False):
        """(weight, bias) of a linear layer as it computes, in `dtype` (a LoRA layer: W + scale * B A)."""
        base = getattr(m, "base", m)
        w = base.weight.detach()
        if base is not m and not m.off:
            w = w + m.scale * (m.lora_B.detach().float() @ m.lora_A.detach().float()).to(w.dtype)
        b = None if base.bias is None else base.bias.detach()
        return (w.to(self.dtype).clone(), None if b is None else b.to(self.dtype).clone()) if copy else (w, b)

    @torch.no_grad()
    def refresh(self):
        for layer, copies in zip(self.model.model.layers, self.layers):
            for n, (w, b) in copies.items():
                nw, nb = self.effective(self.module(layer, n))
                w.copy_(nw)
                if b is not None:
                    b.copy_(nb)
        self.head.copy_(self.model.get_output_embeddings().weight.detach())


def linear(x, layer, name: str, weights: Weights | None, i: int):
    """The layer's linear `name`: its module (fp32, as trained), or the engine's bf16 copy."""
    if weights is None:
        return Weights.module(layer, name)(x)
    w, b = weights.layers[i][name]
    return F.linear(x, w, b)


def forward(model, ids: torch.Tensor, pos: torch.Tensor, K: list, V: list,
            weights: Weights | None = None) -> torch.Tensor:
    """Hidden states [b, t, H] of tokens ids [b, t] at positions pos [b, t] (= their cache columns): writes
    their keys and values into K[l], V[l] ([b, H_kv, L, D] per layer) and attends, per query, to columns <=
    its own (one additive mask a step, shared by every layer)."""
    m = model.model
    b, t = ids.shape
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, pos)
    rows = torch.arange(b, device=ids.device)[:, None].expand(b, t)
    L = K[0].shape[2]
    visible = torch.arange(L, device=ids.device)[None, None] <= pos[:, :, None]  # [b, t, L]
    bias = torch.zeros(visible.shape, dtype=K[0].dtype, device=ids.device).masked_fill_(~visible, -torch.inf)
    for i, (layer, k_cache, v_cache) in enumerate(zip(m.layers, K, V)):
        a = layer.self_attn
        D = a.head_dim
        x = layer.input_layernorm(h)
        q = rotate(linear(x, layer, "q_proj", weights, i).view(b, t, -1, D), cos, sin)  # [b, t, Hq, D]
        k = rotate(linear(x, layer, "k_proj", weights, i).view(b, t, -1, D), cos, sin)  # [b, t, Hkv, D]
        k_cache[rows, :, pos] = k.to(k_cache.dtype)
        v_cache[rows, :, pos] = linear(x, layer, "v_proj", weights, i).view(b, t, -1, D).to(v_cache.dtype)
        Hkv = k_cache.shape[1]
        g = q.shape[2] // Hkv  # query heads per KV head (HF's repeat_kv: query head i reads KV head i // g)
        q = q.transpose(1, 2).reshape(b, Hkv, g * t, D)  # [b, Hkv, g*t, D]
        mask = bias[:, None, None].expand(b, 1, g, t, L).reshape(b, 1, g * t, L)
        o = F.scaled_dot_product_attention(q.to(k_cache.dtype), k_cache, v_cache, attn_mask=mask,
                                           scale=getattr(a, "scaling", D ** -0.5))
        h = h + linear(o.reshape(b, -1, t, D).transpose(1, 2).reshape(b, t, -1), layer, "o_proj", weights, i)
        x = layer.post_attention_layernorm(h)
        if weights is None:
            h = h + layer.mlp(x)
        else:  # Qwen2's and Llama's MLP
            gate = layer.mlp.act_fn(linear(x, layer, "gate_proj", weights, i))
            h = h + linear(gate * linear(x, layer, "up_proj", weights, i), layer, "down_proj", weights, i)
    return m.norm(h)


# ---- the engine

_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its engine (one a process)


def make_sampler(model, tokenizer, rows: int, cfg):
    """rollout.py's sampler of a turn's replies -> fn(live, prompts, generator) -> (ids, log-probs) per reply:
    the model's engine (RAGEN: vLLM; kept across rollouts, its slots freed and its weights refreshed here)
    or, with `cfg.kv_cache=False` or an architecture it does not know, the Hugging Face forward."""
    why = unsupported(model) if cfg.kv_cache else None
    if cfg.kv_cache and not why:
        engine = _ENGINES.get(model)
        if engine is None or engine.rows < rows or engine.tokenizer is not tokenizer or \
                engine.graphs_asked != cfg.cuda_graphs:
            engine = _ENGINES[model] = Engine(model, tokenizer, rows, graphs=cfg.cuda_graphs)
        engine.start()
        return lambda live, prompts, gen: engine.generate(live, prompts, cfg.max_new_tokens, cfg.temperature,
                                                          gen)
    if why:
        say_once(f"note: the rollout engine does not know {why}: sampling with the Hugging Face forward")
    return lambda live, prompts, gen: reference_generate(model, tokenizer, prompts, cfg.max_new_tokens,
                                                         cfg.temperature, gen)


class Engine:
    """Episodes on one static KV cache (the module docstring). `generate(slots, prompts, ...)` samples one
    reply per slot (episode); a slot that was in the previous call keeps its cache, slots left out are freed;
    `start()` begins a new rollout."""

    def __init__(self, model, tokenizer, rows: int, graphs: bool | None = None, sync_every: int | None = None,
                 weights_dtype: torch.dtype | None = None):
        p = next(model.parameters())
        self.model, self.tokenizer, self.device, self.rows = model, tokenizer, p.device, rows
        self.amp = autocast_dtype(p.device)
        self.dtype = cache_dtype(model)
        cuda = p.device.type == "cuda"
        self.graphs_asked = graphs
        self.graphs = cuda if graphs is None else graphs and cuda
        if self.graphs and dynamic_rope(model):
            say_once("note: dynamic rope scaling decides on the host at each length: no CUDA graphs")
            self.graphs = False
        # the host reads the rows every step on CPU (free there): sampling then draws for live rows only
        self.sync_every = sync_every or (16 if cuda else 1)
        vocab = model.get_output_embeddings().weight.shape[0]
        self.table = stop_table(tokenizer, vocab).to(p.device)
        self.draw = draw_rule(p.device, vocab)
        self.is_end = torch.zeros(self.table.shape[1], dtype=torch.bool, device=p.device)
        self.is_end[end_ids(model, tokenizer)] = True
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        wdtype = weights_dtype or self.amp  # None (the CPU): the model's own fp32 modules
        self.weights = Weights(model, wdtype) if wdtype else None
        self.K = self.V = None                     # per layer [rows, H_kv, capacity, D]
        self.capacity = 0
        self.ids = torch.full((rows, 1), self.pad, dtype=torch.long, device=p.device)  # a step's inputs
        self.pos = torch.zeros(rows, dtype=torch.long, device=p.device)               # each row's next column
        self.captured: dict = {}                   # (batch bucket, length) -> (graph, its logits [bucket, V])
        self.pool = None
        self.start()

    def start(self):
        """A new rollout: no row holds an episode's cache; the weights' copies are the current weights."""
        self.slot_at: list = [None] * self.rows    # the slot (episode) whose cache is in each row
        self.cached: dict[int, list[int]] = {}     # slot -> the token ids in its cache columns
        if self.weights is not None:
            self.weights.refresh()

    def head(self, h):
        if self.weights is None:
            return self.model.get_output_embeddings()(h).float()
        return F.linear(h, self.weights.head).float()

    def reserve(self, need: int):
        """Room for `need` columns; growing copies the cache and drops the graphs (they hold its address)."""
        if need <= self.capacity:
            return
        cfg, a = self.model.config, self.model.model.layers[0].self_attn
        cap = -(-(need + need // 2) // LENGTH_BUCKET) * LENGTH_BUCKET  # room for the next turns
        limit = getattr(cfg, "max_position_embeddings", None)
        cap = max(need, min(cap, limit)) if limit else cap
        shape = (self.rows, cfg.num_key_value_heads, cap, a.head_dim)
        old = (self.K or []) + (self.V or [])
        self.K = self.V = self.captured = self.pool = None  # the graphs hold the old buffers' addresses
        new = []
        for i in range(2 * cfg.num_hidden_layers):  # one layer's buffer at a time: the old one freed after it
            new.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            if old:
                new[-1][:, :, :self.capacity] = old[i]
                old[i] = None
        self.K, self.V = new[:cfg.num_hidden_layers], new[cfg.num_hidden_layers:]
        self.capacity, self.captured = cap, {}

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
        """Run each row's new tokens from its column `start`; -> the logits after its last [len(rows), V]."""
        M = max(len(t) for t in todo)
        out = []
        step = max(1, 8192 // M)  # rows per forward: bounds the attention scores' memory
        for a in range(0, len(rows), step):
            r, tt, s0 = rows[a:a + step], todo[a:a + step], start[a:a + step]
            width = max(s0) + M
            ids = torch.tensor([t + [self.pad] * (M - len(t)) for t in tt], device=self.device)  # [b, M]
            pos = torch.tensor(s0, device=self.device)[:, None] + torch.arange(M, device=self.device)
            if r == list(range(r[0], r[0] + len(r))):  # consecutive rows (all but a group's first turn)
                K = [buf[r[0]:r[0] + len(r), :, :width] for buf in self.K]
                V = [buf[r[0]:r[0] + len(r), :, :width] for buf in self.V]
                h = forward(self.model, ids, pos, K, V, self.weights)
            else:  # a copy of these rows' columns, written back
                idx = torch.tensor(r, device=self.device)
                K = [buf[idx, :, :width] for buf in self.K]
                V = [buf[idx, :, :width] for buf in self.V]
                h = forward(self.model, ids, pos, K, V, self.weights)
                for buf, new in zip(self.K + self.V, K + V):
                    buf[idx, :, :width] = new
            last = torch.tensor([len(t) - 1 for t in tt], device=self.device)
            out.append(self.head(h[torch.arange(len(r), device=self.device), last]))
        return torch.cat(out)

    def step(self, b: int, L: int) -> torch.Tensor:
        """One decode step of rows :b over cache columns :L: feed self.ids at self.pos; -> logits [b, V]."""
        K = [buf[:b, :, :L] for buf in self.K]
        V = [buf[:b, :, :L] for buf in self.V]
        h = forward(self.model, self.ids[:b], self.pos[:b, None], K, V, self.weights)
        return self.head(h[:, -1])

    def decode(self, b: int) -> torch.Tensor:
        if not self.graphs:
            return self.step(b, int(self.width))
        bucket = min(next((x for x in BATCH_BUCKETS if x >= b), self.rows), self.rows)
        L = min(self.capacity, -(-int(self.width) // LENGTH_BUCKET) * LENGTH_BUCKET)  # the columns in use, up
        if (bucket, L) not in self.captured:
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            amp = dict(device_type="cuda", dtype=self.amp, enabled=self.amp is not None, cache_enabled=False)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.autocast(**amp):
                for _ in range(2):  # a warm-up outside the graph (lazy inits), writing past each row's length
                    self.step(bucket, L)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), torch.autocast(**amp):
                logits = self.step(bucket, L)
            self.captured[(bucket, L)] = (graph, logits)
        graph, logits = self.captured[(bucket, L)]
        graph.replay()
        return logits[:b]  # overwritten by the next replay: the caller uses it before then

    @torch.no_grad()
    def generate(self, slots: list[int], prompts: list[list[int]], max_new_tokens: int, temperature: float,
                 generator: torch.Generator | None) -> tuple[list[list[int]], list[list[float]]]:
        """-> (each slot's reply, the log-probs of its tokens at `temperature`, as sampled)."""
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
        # the prompt header those rows share (system prompt, instructions) runs once, its columns copied
        fresh = [i for i in run if start[i] == 0]
        header = shared_prefix_len([prompts[i] for i in fresh]) if len(fresh) > 1 else 0
        if header:
            self.prefill(fresh[:1], [prompts[fresh[0]][:header]], [0])
            to = torch.tensor(fresh[1:], device=dev)
            for buf in self.K + self.V:
                buf[to, :, :header] = buf[fresh[0], :, :header]
            fresh = set(fresh)
            start = [header if i in fresh else n for i, n in enumerate(start)]
        logits = self.prefill(run, [prompts[i][start[i]:] for i in run], [start[i] for i in run])
        logits = logits[torch.tensor([run.index(j) for j in src], device=dev)]  # [B, V]
        copy = [i for i in range(B) if src[i] != i]
        if copy:
            w = max(len(prompts[i]) for i in copy)
            di, si = torch.tensor(copy, device=dev), torch.tensor([src[i] for i in copy], device=dev)
            for buf in self.K + self.V:
                buf[di, :, :w] = buf[si, :, :w]
        self.pos[:B] = torch.tensor([len(p) for p in prompts], device=dev)
        if not bool(torch.isfinite(logits).all()):  # one check per turn: diverged weights
            raise FloatingPointError("the policy's logits are not finite: its weights have diverged")
        # 4. decode: every row samples each step; a finished row is fed a pad at its next column and stays
        b, row = B, torch.arange(B, device=dev)  # row: each batch row's index in `slots`
        out = torch.full((B, max_new_tokens), self.pad, dtype=torch.long, device=dev)  # [B, max_new]
        out_lp = torch.zeros((B, max_new_tokens), device=dev)  # [B, max_new] their log-probs
        length = torch.zeros(B, dtype=torch.long, device=dev)  # tokens sampled per row
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        state = torch.zeros(B, dtype=torch.long, device=dev)  # the "</answer>" automaton
        live = list(range(B))
        self.width = int(self.pos[:B].max()) + 1
        for step in range(max_new_tokens):
            exact = self.sync_every == 1  # the host knows the live rows: draw for those only
            t = sample(logits, temperature, generator, torch.tensor(live, device=dev) if exact else None,
                       self.draw)
            t = torch.where(done, self.pad, t)
            out[row[:b], step] = t
            out_lp[row[:b], step] = token_logp(logits, t, temperature)
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
        out, out_lp, length = out.tolist(), out_lp.tolist(), length.tolist()
        replies = [o[:n] for o, n in zip(out, length)]
        for s, p, r in zip(slots, prompts, replies):
            self.cached[s] = p + r[:-1]
        return replies, [lp[:n] for lp, n in zip(out_lp, length)]


# ---- the reference path

@torch.no_grad()
def reference_generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                       generator: torch.Generator | None) -> tuple[list[list[int]], list[list[float]]]:
    """(replies, their tokens' log-probs), one per prompt, with the Hugging Face forward and cache:
    left-padded prompts, one batch, the same sampling (live rows only, in order) and stop test as the engine
    on the CPU; nothing kept between calls."""
    device = next(model.parameters()).device
    B, M = len(prompts), max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (M - len(p)) + p for p in prompts], device=device)  # [B, M]
    attn = torch.tensor([[0] * (M - len(p)) + [1] * len(p) for p in prompts], device=device)  # [B, M]
    kw = cache_keyword(model)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model.base_model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                           **{kw: DynamicCache()})
    head = model.get_output_embeddings()
    table = stop_table(tokenizer, head.weight.shape[0]).to(device)
    ends = set(end_ids(model, tokenizer))
    replies, logps, state, live = [[] for _ in prompts], [[] for _ in prompts], [0] * B, list(range(B))
    for step in range(max_new_tokens):
        logits = head(out.last_hidden_state[:, -1]).float()
        if step == 0 and not bool(torch.isfinite(logits).all()):
            raise FloatingPointError("the policy's logits are not finite: its weights have diverged")
        t_dev = sample(logits, temperature, generator, torch.tensor(live, device=device),
                       draw_rule(device, logits.shape[1]))
        t, lp = t_dev.tolist(), token_logp(logits, t_dev, temperature).tolist()
        still = []
        for i in live:
            replies[i].append(t[i])
            logps[i].append(lp[i])
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
    return replies, logps
