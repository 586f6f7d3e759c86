"""Plain-PyTorch Llama: the reference implementation (runs anywhere, including CPU).

Its module tree and parameter names mirror the TE implementation (te.TransformerLayer), so
both produce the same state-dict layout (docs/ARCHITECTURE.md, decision 1):

    embed.weight                                          (padded_vocab, dim)
    layers.<i>.self_attention.layernorm_qkv.layer_norm_weight   (dim,)
    layers.<i>.self_attention.layernorm_qkv.weight        ((n_heads + 2*n_kv_heads) * head_dim, dim)
    layers.<i>.self_attention.proj.weight                 (dim, n_heads * head_dim)
    layers.<i>.layernorm_mlp.layer_norm_weight            (dim,)
    layers.<i>.layernorm_mlp.fc1_weight                   (2 * ffn_dim, dim), rows = [gate; up]
    layers.<i>.layernorm_mlp.fc2_weight                   (dim, ffn_dim)
    norm.weight                                           (dim,)
    lm_head.weight                                        (padded_vocab, dim), absent when tied

The fused QKV weight is TE's interleaved layout (fuse_qkv_params=True,
qkv_weight_interleaved=True): its rows are n_kv_heads groups, one per KV head g, each holding
g's q_per_kv = n_heads / n_kv_heads query heads, then g's key head, then g's value head
(`interleave_qkv` builds it from separate Q, K, V). Query head h belongs to group
h // q_per_kv, as in Hugging Face's GQA. Tensor parallelism splits these rows into contiguous
blocks of whole groups, and fc1 keeps [gate; up] over the full ffn_dim (its TP plan maps the
per-rank halves), so no tensor's global layout depends on the tensor-parallel degree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.loss import fused_linear_cross_entropy
from model.rope import apply_rope, rope_freqs
from parallel.cp import ContextShard


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """Bias-free linear whose weight is called `weight` (TE's te.Linear naming)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x):
        return F.linear(x, self.weight)


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_kv_heads: int
) -> torch.Tensor:
    """Separate Q (n_heads*hd, ...), K and V (n_kv_heads*hd, ...) -> the fused interleaved
    tensor: per KV group, its query heads, its key head, its value head (along dim 0)."""
    rest = q.shape[1:]
    groups = [t.reshape(n_kv_heads, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_kv_heads: int):
    """Inverse of `interleave_qkv`: the fused tensor -> (Q, K, V), each contiguous."""
    q_per_kv, rest = n_heads // n_kv_heads, qkv.shape[1:]
    hd = qkv.shape[0] // (n_kv_heads * (q_per_kv + 2))
    grouped = qkv.reshape(n_kv_heads, q_per_kv + 2, hd, *rest)
    q, k, v = grouped.split([q_per_kv, 1, 1], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


class LayerNormQKV(nn.Module):
    """RMSNorm followed by the fused, interleaved QKV projection (TE LayerNormLinear with one
    `weight`); forward returns the projection, Attention splits it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.layer_norm_weight = nn.Parameter(torch.ones(cfg.dim))
        rows = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.weight = nn.Parameter(torch.empty(rows, cfg.dim))

    def forward(self, x):
        return F.linear(rms_norm(x, self.layer_norm_weight, self.eps), self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.q_per_kv, self.head_dim = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        self.layernorm_qkv = LayerNormQKV(cfg)
        self.proj = Linear(cfg.n_heads * cfg.head_dim, cfg.dim)

    def forward(self, x, freqs, positions=None, mask=None, context=None):
        """positions / mask: RoPE positions and the attention mask (document masking, or the
        context-parallel mask; both None: causal over the whole row). context: this rank's
        parallel.cp.ContextShard: keys and values are gathered from the whole sequence."""
        b, s, _ = x.shape
        # (b, s, groups, q_per_kv + 2, head_dim), split as TE does. Under tensor parallelism
        # the projection holds a contiguous run of whole KV groups: infer how many.
        qkv = self.layernorm_qkv(x).view(b, s, -1, self.q_per_kv + 2, self.head_dim)
        q, k, v = qkv.split([self.q_per_kv, 1, 1], dim=3)
        # Query head index = group * q_per_kv + j, so group g's queries read K/V head g.
        q, k, v = (t.reshape(b, s, -1, self.head_dim) for t in (q, k, v))
        q, k = apply_rope(q, freqs, positions), apply_rope(k, freqs, positions)
        if context is not None:
            k, v = context.gather_sequence(k), context.gather_sequence(v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class LayerNormMLP(nn.Module):
    """RMSNorm + SwiGLU MLP with fused [gate; up] fc1 (TE LayerNormMLP naming)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.eps = cfg.norm_eps
        self.layer_norm_weight = nn.Parameter(torch.ones(cfg.dim))
        self.fc1_weight = nn.Parameter(torch.empty(2 * cfg.ffn_dim, cfg.dim))
        self.fc2_weight = nn.Parameter(torch.empty(cfg.dim, cfg.ffn_dim))

    def forward(self, x):
        h = rms_norm(x, self.layer_norm_weight, self.eps)
        gate, up = F.linear(h, self.fc1_weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.fc2_weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attention = Attention(cfg)
        self.layernorm_mlp = LayerNormMLP(cfg)

    def forward(self, x, freqs, positions=None, mask=None, context=None):
        x = x + self.self_attention(x, freqs, positions, mask, context)
        return x + self.layernorm_mlp(x)


def document_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """(B, 1, S, S) boolean attention mask from per-document positions (B, S): query j sees
    key i when i <= j and i is in j's document, i.e. i >= j - positions[j]."""
    idx = torch.arange(positions.shape[1], device=positions.device)
    query, key = idx[:, None], idx[None, :]
    return ((key <= query) & (key >= query - positions[:, :, None]))[:, None]


def output_head(model: nn.Module, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """The head of both implementations: logits (B, S, padded_vocab) without labels; with
    labels, the mean next-token cross entropy over labels != -100, computed chunk by chunk
    without materialising the logits (model/loss.py). Under tensor parallelism the head weight
    is this rank's vocabulary rows and `model.head_tp_group` (set by parallel/tp.py) is the
    group the loss's softmax normaliser is reduced over."""
    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    if labels is None:
        return F.linear(x, head)
    return fused_linear_cross_entropy(
        x, head, labels, vocab_size=model.cfg.vocab_size, tp_group=model.head_tp_group
    )


class Llama(nn.Module):
    """Decoder-only Llama. forward(tokens (B, S) int64) -> logits (B, S, padded_vocab), or
    forward(tokens, labels) -> mean next-token loss (see `output_head`)."""

    #: The vocab-parallel group of the head, set by the tensor-parallel plan (parallel/tp.py).
    head_tp_group = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.padded_vocab_size)
        self.register_buffer("freqs", rope_freqs(cfg, cfg.max_seq_len), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers after meta-device construction + to_empty."""
        self.freqs = rope_freqs(self.cfg, self.cfg.max_seq_len, device=self.embed.weight.device)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        documents=None,
    ) -> torch.Tensor:
        """documents (data.documents.Documents: the model reads its fields only, and knows
        nothing else of data/): attention and RoPE positions restart at each document (a batch
        with no boundary inside its rows is plain causal attention); or, under context
        parallelism, this rank's parallel.cp.ContextShard of the rows (tokens and labels are
        its part)."""
        positions = mask = context = None
        if isinstance(documents, ContextShard):
            context, positions, mask = documents, documents.positions, documents.attention_mask()
        elif documents is not None and not documents.whole_rows:
            positions = documents.positions
            mask = document_causal_mask(positions)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.freqs, positions, mask, context)
        return output_head(self, self.norm(x), labels)
