"""Muon (tasks/train/muon.py): the same algorithm as torch.optim.Muon, the split speculators uses, and a checkpoint
that resumes both halves of the optimizer exactly."""

from __future__ import annotations

import pytest
import torch

from tasks.model.draft import DraftConfig, Eagle3Draft
from tasks.train.muon import Muon, OptimizerPair, orthogonalize
from tasks.train.steps import FROZEN, TrainState, load_checkpoint, make_optimizer, save_checkpoint

H = 32


def _draft(seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    return Eagle3Draft(DraftConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, hidden_act="silu",
        target_vocab_size=100, draft_vocab_size=40, aux_layer_ids=(0, 2, 4), target_num_layers=6))


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_orthogonalize_flattens_the_spectrum_and_keeps_the_singular_vectors(shape):
    g = torch.Generator().manual_seed(0)
    # singular values spread over two orders of magnitude (five steps lift about 1:500 of the largest into the band)
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g))
    k = min(shape)
    s = torch.logspace(-2, 0, k)
    m = u[:, :k] @ torch.diag(s) @ v[:, :k].T
    o = orthogonalize(m.bfloat16())
    assert o.dtype == torch.float32 and o.shape == m.shape
    got = torch.linalg.svdvals(o)
    assert got.min() > 0.5 and got.max() < 1.3, got  # the quintic's band, from a 100:1 spread
    # the same singular vectors: U^T O V is diagonal (up to the band's values)
    core = u[:, :k].T @ o @ v[:, :k]
    off = core - torch.diag(torch.diagonal(core))
    assert off.abs().max() < 0.05 * torch.diagonal(core).abs().min()


def test_muon_steps_as_torch_muon_does():
    """Momentum, Nesterov, AdamW-matched step size and decoupled weight decay as torch.optim.Muon (whose
    orthogonalization runs in bf16, ours in f32: equal within bf16's rounding)."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(48, 80, generator=g)
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt_ours = Muon([ours], lr=0.02, weight_decay=0.1)
    opt_theirs = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw")
    for _ in range(4):
        grad = torch.randn(48, 80, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    moved = (theirs.detach() - w0).abs().mean()
    assert moved > 0.01  # the comparison below is about the step, not the starting point
    assert (ours.detach() - theirs.detach()).abs().mean() < 0.02 * moved
    with pytest.raises(ValueError, match="2-D weights only"):
        Muon([torch.nn.Parameter(torch.ones(4))], lr=0.1)


def test_make_optimizer_puts_the_hidden_matrices_under_muon_and_the_rest_under_adamw():
    draft = _draft(0)
    draft.lm_head.weight.requires_grad_(False)  # a frozen head is in neither
    opt = make_optimizer(draft, 1e-3, 0.0, "muon")
    assert isinstance(opt, OptimizerPair)
    muon, adamw = opt.optimizers
    names = {id(p): n for n, p in draft.named_parameters()}
    under_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    under_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert under_muon == {"fc.weight", *(f"midlayer.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))}
    assert under_adamw and all("norm" in n for n in under_adamw)
    trained = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert under_muon | under_adamw == trained and not under_muon & under_adamw
    assert isinstance(make_optimizer(draft, 1e-3, 0.0), torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer"):
        make_optimizer(draft, 1e-3, 0.0, "sgd")


def _steps(draft: Eagle3Draft, opt, seeds: range) -> None:
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        for p in draft.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=g)
        for group in opt.param_groups:
            group["lr"] = 1e-2
        opt.step()


def test_a_checkpoint_resumes_muon_and_adamw_exactly(tmp_path):
    """Three steps, a checkpoint, three more; against a fresh draft and optimizer that load the checkpoint and take
    the same three: the same bits (both halves' state, the momentum buffers and AdamW's moments, restored)."""
    identity = {"run_name": "t", "optimizer": "muon"}
    a = _draft(0)
    opt_a = make_optimizer(a, 1e-2, 0.01, "muon")
    _steps(a, opt_a, range(3))
    folder = save_checkpoint(tmp_path, a, opt_a, TrainState(step=3), identity, keep=2)
    _steps(a, opt_a, range(3, 6))

    b = _draft(1)  # other starting weights: everything must come from the checkpoint
    opt_b = make_optimizer(b, 1e-2, 0.01, "muon")
    assert load_checkpoint(folder, b, opt_b, identity).step == 3
    _steps(b, opt_b, range(3, 6))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert name in FROZEN or torch.equal(x, y), name  # the target's embeddings are reloaded, never saved

    # an AdamW checkpoint does not load into the pair (nor the pair's into AdamW): refused, not half-loaded
    c = _draft(0)
    with pytest.raises(ValueError, match="another optimizer|parameter group"):
        load_checkpoint(folder, c, make_optimizer(c, 1e-2, 0.01, "adamw"), identity)
