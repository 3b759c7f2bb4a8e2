"""Shared pieces of the Gated DeltaNet tests: tiny configs and the per-block brute-force oracle."""
import torch
import torch.nn.functional as F



def l2norm_oracle(x, eps=1e-6):
    """flash-linear-attention's l2norm (fla.modules.l2norm: x / sqrt(sum x^2 + eps), eps = 1e-6; the
    norm megatron-core's GatedDeltaNet imports from FLA), written here, not the plugin's."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_oracle(q, k, v, g, beta, state):
    """The gated delta rule by its definition, token by token (Yang et al., Gated Delta Networks,
    eq. 10): S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T q_t.
    q, k [N, H, T, d_k], v [N, H, T, d_v], g (log decay) and beta [N, H, T], S [N, H, d_k, d_v].
    Written here (einsum), independently of the plugin's recurrent and chunked rules."""
    outs = []
    for t in range(q.shape[-2]):
        decayed = torch.exp(g[..., t])[..., None, None] * state
        err = v[..., t, :] - torch.einsum("nhkv,nhk->nhv", decayed, k[..., t, :])
        state = decayed + beta[..., t, None, None] * torch.einsum("nhk,nhv->nhkv", k[..., t, :], err)
        outs.append(torch.einsum("nhkv,nhk->nhv", state, q[..., t, :]))
    return torch.stack(outs, dim=-2), state


def gdn_config(num_layers=1, hidden=32, dtype=torch.float32, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=num_layers, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=64, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
              bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, params_dtype=dtype)
    kw.update(overrides)
    return TransformerConfig(**kw)


def randomize_gdn(layer, seed=0):
    """Draw every GDN parameter (megatron leaves the norm at 1 and A_log/dt_bias near their init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.5, generator=g))
            elif name.endswith("dt_bias") or "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / max(p.shape[-1], 1) ** 0.5)


def reference_gdn(layer, x):
    """Megatron GDN semantics on ONE causal sequence x [T, b, h], written independently of the
    layer's forward: zero-padded causal conv, token-by-token recurrence from a zero state."""
    T, b, _ = x.shape
    tp = 1
    w_in = layer.in_proj.weight
    y = x @ w_in.t()
    mixed, z, beta, alpha = torch.split(
        y, [layer.qk_dim * 2 + layer.v_dim, layer.v_dim, layer.num_value_heads, layer.num_value_heads], dim=-1)
    K = layer.conv_kernel_dim
    conv = F.conv1d(mixed.permute(1, 2, 0), layer.conv1d.weight, layer.conv1d.bias, padding=K - 1,
                    groups=mixed.shape[-1])[..., :T]
    conv = F.silu(conv).permute(0, 2, 1)  # [b, T, conv]
    q, k, v = torch.split(conv, [layer.qk_dim, layer.qk_dim, layer.v_dim], dim=-1)
    q = l2norm_oracle(q.reshape(b, T, -1, layer.key_head_dim))
    k = l2norm_oracle(k.reshape(b, T, -1, layer.key_head_dim))
    v = v.reshape(b, T, -1, layer.value_head_dim)
    rep = layer.num_value_heads // layer.num_key_heads
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    q = q * layer.key_head_dim ** -0.5
    g = -layer.A_log.exp() * F.softplus(alpha.transpose(0, 1) + layer.dt_bias)
    bt = beta.transpose(0, 1).sigmoid()
    H, dk, dv = layer.num_value_heads, layer.key_head_dim, layer.value_head_dim
    o, _ = delta_rule_oracle(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                          bt.transpose(1, 2), torch.zeros(b, H, dk, dv, dtype=x.dtype))
    o = o.transpose(1, 2)  # [b, T, H, dv]
    var = o.pow(2).mean(-1, keepdim=True)
    o = o * torch.rsqrt(var + layer.config.layernorm_epsilon) * layer.out_norm.weight
    o = o * F.silu(z.transpose(0, 1).reshape(b, T, H, dv))
    return (o.reshape(b, T, -1) @ layer.out_proj.weight.t()).transpose(0, 1)


def per_block_oracle(layer, x, rows, block_size):
    """Outputs for rows [noisy ; clean] (x [rows, b, h]) from the brute force: clean rows from the
    clean sequence; noisy block j from the layer run on [clean prefix ; noisy block j]."""
    out = torch.zeros(x.shape[0], x.shape[1], layer.config.hidden_size, dtype=x.dtype)
    clean_idx = torch.nonzero(rows.is_clean).flatten()
    clean_idx = clean_idx[torch.argsort(rows.position[clean_idx])]
    assert torch.equal(rows.position[clean_idx], torch.arange(len(clean_idx)))
    out = out.index_copy(0, clean_idx, reference_gdn(layer, x[clean_idx]))
    noisy_idx = torch.nonzero(~rows.is_clean).flatten()
    blocks = sorted(set((rows.position[noisy_idx] // block_size).tolist()))
    for j in blocks:
        idx = noisy_idx[rows.position[noisy_idx] // block_size == j]
        idx = idx[torch.argsort(rows.position[idx])]
        seq = torch.cat([x[clean_idx[: j * block_size]], x[idx]], 0)
        out = out.index_copy(0, idx, reference_gdn(layer, seq)[j * block_size:])
    return out


def build_hybrid_gpt(pattern=(1, 0, 1), vocab=64, seq_length=32, tp=1, sequence_parallel=False, seed=1234,
                     recompute=False):
    """A megatron-core GPTModel whose layers follow `pattern` (1: Gated DeltaNet, 0: block-aware
    attention), with every GDN parameter drawn (see `randomize_gdn`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_csbp.compat.cpu import install_cpu_compat
    from megatron_csbp.model.hybrid import hybrid_block_spec

    install_cpu_compat()  # Megatron's named RNG states name CUDA
    extra = {}
    if recompute:
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    config = gdn_config(num_layers=len(pattern), tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                        **extra)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    gpt = GPTModel(config, hybrid_block_spec(list(pattern)), vocab_size=vocab, max_sequence_length=seq_length,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False)
    for i, layer in enumerate(gpt.decoder.layers):
        if pattern[i]:
            randomize_gdn(layer.self_attention, seed + i)
    return gpt


def gdn_tp_slice(name, full, param, tp_rank, tp, layer):
    """The TP shard of a full (TP = 1) parameter as megatron's GatedDeltaNet holds it: in_proj rows
    are [q, k, v, z, beta, alpha] per rank, conv1d channels [q, k, v] per rank."""
    if full.shape == param.shape:
        return full
    if name.endswith("mlp.linear_fc1.weight"):  # SwiGLU: [gate_r ; up_r] per rank
        return torch.cat([half.chunk(tp, dim=0)[tp_rank] for half in full.chunk(2, dim=0)], dim=0)
    if name.endswith("in_proj.weight") or name.endswith("conv1d.weight") or name.endswith("conv1d.bias"):
        sizes = [layer.qk_dim, layer.qk_dim, layer.v_dim]
        if "in_proj" in name:
            sizes += [layer.v_dim, layer.num_value_heads, layer.num_value_heads]
        parts = torch.split(full, sizes, dim=0)
        return torch.cat([p.chunk(tp, dim=0)[tp_rank] for p in parts], dim=0)
    dim = getattr(param, "partition_dim", 0)
    size = param.shape[dim]
    return full.narrow(dim, tp_rank * size, size)
