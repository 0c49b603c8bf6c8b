import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm, Gemma3RotaryEmbedding, apply_rotary_pos_emb

from runtime.context import ForwardContext, forward_context
from runtime.layers.activation import gelu_tanh_and_mul
from runtime.layers.attention import Attention
from runtime.layers.norm import RMSNorm
from runtime.layers.rotary import RotaryEmbedding
from runtime.models.config import FULL, SLIDING, Gemma3Config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_applies_one_plus_weight_like_transformers(dtype):
    torch.manual_seed(0)
    x = (torch.randn(5, 64) * 3).to(dtype)
    ours, ref = RMSNorm(64, eps=1e-6).to(dtype), Gemma3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64) * 0.5)
        ref.weight.copy_(ours.weight)
    got = ours(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref(x), rtol=0, atol=0)
    expected = x.float() / x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + ours.weight.float())
    torch.testing.assert_close(got.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)


def test_rmsnorm_follows_every_change_of_its_weight():
    """`1 + w` is cached between calls: a load, an in-place edit, a dtype change must each be seen."""
    torch.manual_seed(1)
    norm, ref = RMSNorm(32), Gemma3RMSNorm(32)
    x = torch.randn(3, 32)

    def same() -> bool:
        with torch.no_grad():
            ref.weight.copy_(norm.weight.float())
        return torch.equal(norm(x.to(norm.weight.dtype)), ref.to(norm.weight.dtype)(x.to(norm.weight.dtype)))

    norm(x)  # fills the cache with the zero weight
    norm.load_state_dict({"weight": torch.randn(32)})
    assert same()
    with torch.no_grad():
        norm.weight.mul_(2.0)
    assert same()
    norm.bfloat16()
    assert same()


def test_zero_weight_rmsnorm_is_plain_normalisation():
    y = RMSNorm(16)(torch.full((2, 16), 3.0))
    torch.testing.assert_close(y, torch.ones(2, 16), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer_type", [SLIDING, FULL])
def test_rotary_matches_transformers_for_each_layer_kind(layer_type):
    cfg = Gemma3Config.tiny(max_position_embeddings=4096)
    layer_id = cfg.layer_types.index(layer_type)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_base(layer_id), cfg.max_position_embeddings)
    hf_rope = Gemma3RotaryEmbedding(Gemma3TextConfig(**cfg.to_hf_dict()))
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    got_q, got_k = rope(positions, q, k)
    cos, sin = hf_rope(q, positions[None], layer_type)  # (1, T, D)
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rotary_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, 10_000.0, 2048)
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(pq, pk):
        rq, _ = rope(torch.tensor([pq]), q, k)
        _, rk = rope(torch.tensor([pk]), q, k)
        return float((rq * rk).sum())

    assert score(10, 3) == pytest.approx(score(1010, 1003), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-2)


def test_local_and_global_bases_rotate_differently():
    q = torch.randn(1, 1, 16)
    local, _ = RotaryEmbedding(16, 10_000.0, 64)(torch.tensor([50]), q, q)
    glob, _ = RotaryEmbedding(16, 1_000_000.0, 64)(torch.tensor([50]), q, q)
    assert (local - glob).abs().max() > 1e-2


def test_linear_rope_scaling_divides_positions():
    q = torch.randn(1, 2, 16)
    scaled, _ = RotaryEmbedding(16, 1e6, 64, scaling_factor=8.0)(torch.tensor([40]), q, q)
    plain, _ = RotaryEmbedding(16, 1e6, 64)(torch.tensor([5]), q, q)
    torch.testing.assert_close(scaled, plain, rtol=1e-5, atol=1e-5)


def test_gated_gelu_matches_transformers_activation():
    gate, up = torch.randn(3, 10) * 3, torch.randn(3, 10)
    torch.testing.assert_close(gelu_tanh_and_mul(gate, up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


class _RecordingBackend:
    def __init__(self):
        self.seen = None

    def forward(self, q, k, v, layer):
        self.seen = (q, k, v, layer)
        return q * 2  # (T, H, D)


def test_attention_hands_qkv_and_itself_to_the_context_backend_and_flattens_heads():
    layer = Attention(layer_id=3, num_heads=4, num_kv_heads=2, head_dim=8, scaling=0.125, sliding_window=16)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    backend = _RecordingBackend()
    with forward_context(ForwardContext(forward_id=7, mode="eager_extend", attn_backend=backend)):
        out = layer(q, k, v)
    assert backend.seen[0] is q and backend.seen[1] is k and backend.seen[2] is v and backend.seen[3] is layer
    assert out.shape == (5, 32)
    torch.testing.assert_close(out, (q * 2).reshape(5, 32))
    assert layer.is_sliding and not Attention(0, 4, 2, 8, 0.125, None).is_sliding


def test_attention_outside_a_forward_context_fails_clearly():
    layer = Attention(layer_id=0, num_heads=1, num_kv_heads=1, head_dim=2, scaling=1.0)
    with pytest.raises(RuntimeError, match="no attention backend"):
        layer(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
