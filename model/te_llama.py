"""TransformerEngine Llama: the same model as model/llama.py, built from TE's fused modules.

Each block is one `te.TransformerLayer` (RMSNorm fused into the QKV and fc1 GEMMs, SwiGLU,
fused RoPE, cuDNN/flash attention). Its parameter names and shapes equal the reference's
(model/llama.py docstring), so both load the same checkpoints and `init_weights` gives both the
same values; TE adds only `_extra_state` entries (quantization state) to the state dict.

What the TE names mean, checked against TE 2.20's source:
- `fuse_qkv_params=True` (with the default `qkv_weight_interleaved=True`) registers one QKV
  weight, `layernorm_qkv.weight` (LayerNormLinear with `parameters_split=None`; `bias=False`
  leaves no bias parameter), and MultiheadAttention views its output as
  (..., kv_groups, q_per_kv + 2, head_dim): per KV group its query heads, key, value. That
  row layout is model/llama.py's. Under TP each rank's QKV is a contiguous run of whole KV
  groups, so the global layout does not depend on TP.
- `swiglu` applies silu to the first half of fc1's output: fc1 rows are [gate; up]. Under TP a
  rank holds [gate_r; up_r], which is not a contiguous slice of the global [gate; up]: the
  tensor-parallel plan (parallel/) must map between the two.
- RoPE: `rotary_pos_emb` of shape (s, 1, 1, head_dim) holding [theta, theta] is TE's
  non-interleaved (rotate-half) format, which `model.rope.rope_freqs` produces.
- Meta-device construction: TE defers its own init only when `device` is the *string* "meta"
  (it tests `device == "meta"`), so the constructor passes that string.

Why one fused, interleaved QKV weight: quantized parameters (te.quantized_model_init, the
recipe's quantized_init) need each weight to be one whole buffer; with separate Q/K/V TE 2.20
refuses ("Splitting QuantizedTensor into multiple params is not supported"). Of TE's two fused
layouts, the interleaved one is the one whose per-rank blocks (whole KV groups) concatenate to
the same global tensor for every tp; the other stores [Q_r; K_r; V_r] per rank, so the global
row order would change with tp. Blocks in `bf16_layers` are built with quantized init turned
off; the final norm and the head are the reference's plain PyTorch modules (see __init__).

Precision comes from one place, the recipe (recipes/recipe.py `Recipe`), handed to the
constructor: it says which blocks are built with high-precision weights (`layer_init_context`),
and the forward enters its TE autocast around the blocks (`autocast`, `layer_autocast` for
bf16_layers). The model reads no global quantization state of its own.

Sequence parallel needs TE's "sbhd" activation layout (TE gathers and scatters along the first
dimension), so with `sequence_parallel=True` the blocks run on (seq, batch, dim) tensors. The
parallel plan then splits the embedding output along the sequence (dim 1 of its (B, S, D)
output) and gathers the final norm's output (dim 1) before the head; this module does no
communication itself.
"""

from __future__ import annotations

import torch
import transformer_engine.pytorch as te
from torch import nn

from model.config import ModelConfig
from model.llama import Linear, RMSNorm, output_head
from model.rope import rope_freqs
from parallel.cp import ContextShard
from recipes.config import RecipeConfig
from recipes.recipe import Recipe


def _attention_layout_hook(layer, args, kwargs):
    """A block called with `cu_seqlens_q` runs its attention on THD tensors (documents packed
    along the token dimension), otherwise in the layout it was built with. TE's
    MultiheadAttention reads its layout from `qkv_format` at each call (reshapes, fused RoPE,
    the attention call), so setting it from the call's own arguments keeps the two paths in
    one module, and a recompute under activation checkpointing (which calls the block again
    with the same arguments, hooks included) runs in the layout of its forward."""
    attention = layer.self_attention
    if not hasattr(attention, "built_qkv_format"):
        attention.built_qkv_format = attention.qkv_format
    thd = kwargs.get("cu_seqlens_q") is not None
    attention.qkv_format = "thd" if thd else attention.built_qkv_format


class TELlama(nn.Module):
    """Decoder-only Llama on TE. forward(tokens (B, S) int64) -> logits (B, S, padded_vocab), or
    forward(tokens, labels) -> mean next-token loss (model/llama.py `output_head`).

    recipe: the precision recipe (default: bf16, no quantization).
    tp_group / tp_size / sequence_parallel: TE's native tensor parallelism inside the blocks
    (QKV and fc1 column-parallel, proj and fc2 row-parallel). The embedding, final norm and
    head are left whole; parallel/ decides how to shard them.
    device: None uses the current default device (so `with torch.device("meta"):` works);
    a CPU default becomes the current CUDA device, since TE modules live on CUDA.
    """

    #: The vocab-parallel group of the head, set by the tensor-parallel plan (parallel/tp.py).
    head_tp_group = None
    #: Context-parallel degree, set by parallel.cp.apply_te_cp with the blocks' cp group.
    cp_size = 1

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        recipe: Recipe | None = None,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        device = torch.device(device) if device is not None else torch.get_default_device()
        if device.type == "cpu":
            device = torch.device("cuda", torch.cuda.current_device())
        # TE compares `device == "meta"` to defer its init; a torch.device would not match.
        te_device = "meta" if device.type == "meta" else device
        if tp_group is not None:
            tp_size = torch.distributed.get_world_size(tp_group)
        self.tp_size = tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.recipe = recipe if recipe is not None else Recipe(RecipeConfig(), cfg.n_layers)
        self.attn_input_format = "sbhd" if self.sequence_parallel else "bshd"

        v = cfg.padded_vocab_size
        self.embed = nn.Embedding(v, cfg.dim, device=device, dtype=params_dtype)
        layer_kwargs = dict(
            hidden_size=cfg.dim,
            ffn_hidden_size=cfg.ffn_dim,
            num_attention_heads=cfg.n_heads,
            num_gqa_groups=cfg.n_kv_heads,
            kv_channels=cfg.head_dim,
            layernorm_epsilon=cfg.norm_eps,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="causal",
            normalization="RMSNorm",
            activation="swiglu",
            bias=False,
            fuse_qkv_params=True,
            qkv_weight_interleaved=True,
            attn_input_format=self.attn_input_format,
            tp_group=tp_group,
            tp_size=tp_size,
            set_parallel_mode=tp_size > 1,
            sequence_parallel=self.sequence_parallel,
            params_dtype=params_dtype,
            device=te_device,
        )
        self.layers = nn.ModuleList()
        for i in range(cfg.n_layers):
            with self.recipe.layer_init_context(i):
                self.layers.append(te.TransformerLayer(layer_number=i + 1, **layer_kwargs))
        # The final norm and the head are the reference's plain modules (always high precision).
        # TE 2.20's te.RMSNorm is an operation-fuser module that reads its weight again in
        # backward; under tensor parallelism the weight is a DTensor outside the forward (the
        # local view exists only during it, parallel/tp.py), so its backward would be handed
        # the DTensor. Plain modules save what they use, and the TP plan treats them exactly as
        # it treats the reference model's.
        with torch.device(device):
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps).to(params_dtype)
            self.lm_head = None if cfg.tie_embeddings else Linear(cfg.dim, v).to(params_dtype)
        freqs = rope_freqs(cfg, cfg.max_seq_len, device=device)
        self.register_buffer("freqs", freqs, persistent=False)
        for layer in self.layers:
            layer.register_forward_pre_hook(_attention_layout_hook, with_kwargs=True)

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers after meta-device construction + to_empty."""
        self.freqs = rope_freqs(self.cfg, self.cfg.max_seq_len, device=self.embed.weight.device)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        documents=None,
    ) -> torch.Tensor:
        """The blocks run inside the recipe's TE autocast (bf16_layers with quantization off);
        the embedding, final norm and head are plain modules and run in high precision.
        `documents` (on this device; data.documents.Documents, whose fields are all the model
        reads of it, or a parallel.cp.ContextShard): attention and RoPE positions restart at
        each document, in TE's THD layout; a batch with no boundary inside its rows runs the
        causal path (the same mask, TE's faster kernel for it)."""
        if isinstance(documents, ContextShard):
            if documents.cu_seqlens is not None:  # this cp rank's part of padded documents
                return self._forward_thd(
                    tokens, labels, documents.cu_seqlens, documents.max_seqlen, cp_padded=True
                )
            documents = None  # causal rows: TE's context-parallel attention is causal
        if documents is not None and not documents.whole_rows:
            # TE sizes its attention kernels by max_seqlen and caches one cuDNN graph per
            # value (a build costs far more than a step's attention): a power of two (at most
            # the row length) keeps the values few whatever the documents' lengths.
            max_seqlen = min(max(64, 1 << (documents.max_seqlen - 1).bit_length()), tokens.shape[1])
            return self._forward_thd(tokens, labels, documents.cu_seqlens, max_seqlen)
        x = self.embed(tokens)
        # The frequencies of the whole sequence: TE's fused RoPE picks this rank's positions
        # itself under sequence and context parallelism.
        freqs = self.freqs[: tokens.shape[1] * self.cp_size]
        if self.attn_input_format == "sbhd":
            x = x.transpose(0, 1).contiguous()
        x = self._blocks(x, rotary_pos_emb=freqs)
        if self.attn_input_format == "sbhd":
            x = x.transpose(0, 1).contiguous()
        return output_head(self, self.norm(x), labels)

    def _forward_thd(self, tokens, labels, cu_seqlens, max_seqlen: int, cp_padded=False):
        """THD: the batch is one packed stream of B*S tokens (row after row), cut into the
        documents by `cu_seqlens`. The embedding runs on it as a (1, B*S) batch, so sequence
        parallelism splits that stream into contiguous pieces, the order TE's gathers along
        the token dimension restore. `cp_padded`: tokens are this cp rank's (1, N) part of
        documents padded to multiples of 2 x cp, `cu_seqlens` the whole padded stream's
        offsets (parallel/cp.py); the padding is part of its document (after its last real
        token, so no real token sees it), hence one tensor for every cu_seqlens argument and
        no padding between sequences for TE to skip."""
        b, s = tokens.shape
        x = self.embed(tokens.reshape(1, b * s)).squeeze(0)  # (T, D), or (T / tp, D) with SP
        padded = {}
        if cp_padded:
            padded = dict(
                cu_seqlens_q_padded=cu_seqlens,
                cu_seqlens_kv_padded=cu_seqlens,
                pad_between_seqs=False,
            )
        x = self._blocks(
            x,
            rotary_pos_emb=self.freqs,
            self_attn_mask_type="padding_causal",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            **padded,
        )
        out = output_head(
            self, self.norm(x.unsqueeze(0)), None if labels is None else labels.reshape(1, -1)
        )
        return out if labels is not None else out.view(b, s, -1)

    def _blocks(self, x: torch.Tensor, **attention) -> torch.Tensor:
        with self.recipe.autocast():
            for i, layer in enumerate(self.layers):
                with self.recipe.layer_autocast(i):
                    x = layer(x, **attention)
        return x
