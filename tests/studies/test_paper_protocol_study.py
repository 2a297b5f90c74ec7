"""studies/paper_protocol.py: the miniature keeps the paper's rules (checked against Table 2's
numbers typed here, not read from the code), changing only the scale."""

from __future__ import annotations

import pytest

from studies import paper_protocol


@pytest.mark.parametrize("head", ["adamw", "rownorm"])
def test_the_miniature_is_the_paper_recipe_at_a_smaller_scale(head):
    cfg = paper_protocol.study_config(head, seed=1)
    m, o = cfg.model, cfg.optim
    # the paper's block
    assert (m.qk_norm, m.norm_gain, m.init_std, m.norm_eps, m.rope_theta) == (
        True, False, 0.02, 1e-6, 10_000.0)
    assert not m.tied_embeddings and m.d_model // m.num_heads == 64 and m.mlp_dim == 4 * m.d_model
    # Table 2, unchanged
    assert (o.learning_rate, o.embedding_learning_rate, o.weight_decay, o.grad_clip) == (
        8e-3, 4e-3, 0.1, 1.0)
    assert (o.muon_scale, o.muon_eps, o.adam_b2, o.adam_eps) == ("keller", 1e-5, 0.999, 1e-10)
    assert o.schedule == "cosine" and o.min_lr_ratio == 0.1
    assert o.warmup_steps == cfg.steps // 10 and cfg.optim.grad_accum_steps == 1
    # head rates scaled as the paper scales them: AdamW 4e-3 at d 512, proportional to 1/d;
    # RowNorm 0.8 x AdamW (3.2e-3 / 4.0e-3); RowNorm without decay, debiased EMA
    adamw = 4e-3 * 512 / m.d_model
    if head == "adamw":
        assert o.head_learning_rate == pytest.approx(adamw, rel=1e-12)
        assert o.head_weight_decay == 0.1
    else:
        assert o.head_learning_rate == pytest.approx(0.8 * adamw, rel=1e-12)
        assert o.head_weight_decay == 0.0 and o.head_bias_correction and o.head_eps == 1e-8
    assert cfg.head == head and cfg.seed == 1 and cfg.eval.diameter_every == 10


def test_the_head_rate_rule_reproduces_table_2_at_the_paper_widths():
    # Table 2: AdamW 4.0e-3 / 2.667e-3 / 2.0e-3 and RowNorm 3.2e-3 / 2.133e-3 / 1.6e-3 at d 512,
    # 768, 1024 (rounded to four figures in the paper)
    for d, adamw, rownorm in ((512, 4.0e-3, 3.2e-3), (768, 2.667e-3, 2.133e-3),
                              (1024, 2.0e-3, 1.6e-3)):
        assert paper_protocol.head_rate("adamw", d) == pytest.approx(adamw, rel=2e-4)
        assert paper_protocol.head_rate("rownorm", d) == pytest.approx(rownorm, rel=2e-4)
