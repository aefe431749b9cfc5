"""Analytic communication volumes against the papers' statements."""

import pytest

from flopwise.plan.comm import (
    dp_elements_per_step,
    pp_boundary_elements,
    ring_factor,
    ring_time,
    sp_regather_elements,
    tied_embedding_elements,
    tp_allreduce_elements,
)


def test_zero_volumes():
    psi = 7.5e9
    assert [dp_elements_per_step(psi, z) for z in (0, 1, 2, 3)] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]
    # ZeRO §7: stage 3 is 1.5× baseline data parallelism
    assert dp_elements_per_step(psi, 3) / dp_elements_per_step(psi, 0) == 1.5


def test_ring_factors_and_time():
    assert ring_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert ring_factor("all_reduce", 8) == ring_factor("reduce_scatter", 8) + ring_factor("all_gather", 8)
    assert ring_factor("all_gather", 1) == 0
    t = ring_time("all_reduce", 8, 1e9, 100e9, latency=0.0)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    with pytest.raises(ValueError):
        ring_factor("broadcast", 4)


def test_megatron_tp_and_pp_volumes():
    s, b, h, l, t = 2048, 1, 12288, 96, 8  # noqa: E741 l: the paper's layer count
    # Narayanan et al. 2021: per layer per micro-batch each device moves 8·b·s·h·(t−1)/t elements
    per_layer_on_wire = tp_allreduce_elements(s, b, h, 1) * ring_factor("all_reduce", t)
    assert per_layer_on_wire == pytest.approx(8 * b * s * h * (t - 1) / t)
    # Shoeybi et al. 2019 §3 (Fig. 4): two all-reduces (g) in each layer's forward and two (f) in its
    # backward, each of the b·s·h layer output: for GPT-3 175B's shape (Brown et al. 2020 Table 2.1:
    # 96 layers, d_model 12,288; context 2,048), 4 × 2,048 × 12,288 × 96 elements for a micro-batch of one sequence
    assert tp_allreduce_elements(s, b, h, l) == 9_663_676_416
    # Korthikanti et al. 2022 §4.2.2: under sequence parallelism the inputs of the two column-parallel
    # linears (Y of the attention and MLP blocks) are all-gathered again in backward, b·s·h each
    assert sp_regather_elements(s, b, h, l) == 2 * s * b * h * l
    assert pp_boundary_elements(s, b, h, t) == s * b * h / t
    assert pp_boundary_elements(s, b, h, t, scatter_gather=False) == s * b * h


def test_tied_embedding_all_reduce_is_the_output_matrix_shard():
    """The table the first and last stages all-reduce is the output layer's V×h matrix, tp-sliced."""
    from flopwise.config.schema import ModelConfig
    from flopwise.flops import count_params

    m = ModelConfig(arch="gpt2", n_layers=4, d_model=256, n_heads=4, vocab_size=51200, max_seq_len=256)
    assert tied_embedding_elements(m.vocab_size, m.d_model, 8) * 8 == count_params(m).head_matmul
