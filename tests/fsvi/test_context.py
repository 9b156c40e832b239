"""Each context distribution samples what it claims."""

from __future__ import annotations

import pytest
import torch

from ntkgp.fsvi import (
    BatchMixedContext,
    DatasetContext,
    MonochromeContext,
    SamplerContext,
    UniformBoxContext,
)


def test_uniform_box_bounds_and_coverage():
    g = torch.Generator().manual_seed(0)
    x = torch.stack([torch.rand(50, generator=g) * 2 - 1, torch.rand(50, generator=g) * 10 + 5], 1).double()
    box = UniformBoxContext.from_data(x)
    s = box.sample(4000, torch.Generator().manual_seed(1))
    assert s.shape == (4000, 2) and s.dtype == torch.float64
    lo, hi = x.min(0).values, x.max(0).values
    assert (s >= lo).all() and (s <= hi).all()
    # uniform: mean at the centre, variance width²/12 (4000 draws: 5 standard errors)
    width = hi - lo
    assert ((s.mean(0) - (lo + hi) / 2).abs() < 5 * width / (12 * 4000) ** 0.5).all()
    torch.testing.assert_close(s.var(0), width**2 / 12, rtol=0.1, atol=0)
    wide = UniformBoxContext.from_data(x, margin=0.5).sample(4000, torch.Generator().manual_seed(1))
    assert (wide.min(0).values < lo - 0.4 * width).all() and (wide.max(0).values > hi + 0.4 * width).all()
    assert (wide >= lo - 0.5 * width).all() and (wide <= hi + 0.5 * width).all()


def test_uniform_box_is_seeded_and_validated():
    box = UniformBoxContext(torch.zeros(3), torch.ones(3))
    a = box.sample(5, torch.Generator().manual_seed(3))
    b = box.sample(5, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="upper"):
        UniformBoxContext(torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match="same shape"):
        UniformBoxContext(torch.zeros(2), torch.ones(3))
    with pytest.raises(ValueError, match="num_points"):
        box.sample(0)
    with pytest.raises(ValueError, match="margin"):
        UniformBoxContext.from_data(torch.randn(4, 2), margin=-1.0)


def test_monochrome_images_have_constant_channels_from_training_pixels():
    g = torch.Generator().manual_seed(0)
    # three channels with disjoint pixel ranges: channel c takes values in {10c + k/10}
    x = torch.stack([10 * c + torch.randint(0, 10, (20, 4, 5), generator=g) / 10 for c in range(3)], 1).double()
    ctx = MonochromeContext.from_data(x)
    s = ctx.sample(200, torch.Generator().manual_seed(2))
    assert s.shape == (200, 3, 4, 5)
    flat = s.flatten(2)
    assert torch.equal(flat, flat[:, :, :1].expand_as(flat)), "each channel is one colour"
    for c in range(3):
        pool = set(x[:, c].flatten().tolist())
        assert set(flat[:, c, 0].tolist()) <= pool
    # channels are drawn independently: the colours are not tied across channels
    assert (flat[:, 1, 0] - flat[:, 0, 0] != 10).any()
    assert len(set(flat[:, 0, 0].tolist())) > 5


def test_monochrome_flat_inputs_and_single_channel():
    x = torch.rand(30, 1, 3, 3)
    ctx = MonochromeContext.from_data(x.flatten(1), image_shape=(1, 3, 3))
    s = ctx.sample(10)
    assert s.shape == (10, 9)
    assert torch.equal(s, s[:, :1].expand_as(s))
    gray = MonochromeContext.from_data(torch.rand(30, 3, 3))  # (N, H, W): one channel
    assert gray.sample(4).shape == (4, 3, 3)
    sub = MonochromeContext.from_data(x, max_pixels=7)
    assert sub.pixels.shape == (1, 7)
    with pytest.raises(ValueError, match="image"):
        MonochromeContext.from_data(x.flatten(1), image_shape=(2, 3, 3))
    with pytest.raises(ValueError, match="max_pixels"):
        MonochromeContext.from_data(x, max_pixels=0)


def test_dataset_context_returns_distinct_rows():
    data = torch.arange(40.0).reshape(20, 2)
    s = DatasetContext(data).sample(20, torch.Generator().manual_seed(0))
    assert sorted(s[:, 0].tolist()) == data[:, 0].tolist()  # without replacement: a permutation
    big = DatasetContext(data).sample(50)
    assert big.shape == (50, 2) and set(big[:, 0].tolist()) <= set(data[:, 0].tolist())
    with pytest.raises(TypeError, match="data"):
        DatasetContext([[1.0]])


def test_sampler_context_checks_the_sampler():
    ctx = SamplerContext(lambda k, g: torch.full((k, 2), 3.0))
    assert torch.equal(ctx.sample(4), torch.full((4, 2), 3.0))
    with pytest.raises(ValueError, match="shape"):
        SamplerContext(lambda k, g: torch.zeros(k + 1, 2)).sample(3)
    with pytest.raises(TypeError, match="callable"):
        SamplerContext(3)


def test_batch_mixed_context_takes_its_fraction_from_the_batch():
    base = UniformBoxContext(torch.full((2,), -1.0), torch.full((2,), 0.0))  # negative coordinates
    batch = torch.arange(1.0, 21.0).reshape(10, 2)  # positive, distinct rows
    mixed = BatchMixedContext(base, fraction=0.5)
    s = mixed.sample(8, torch.Generator().manual_seed(0), batch_x=batch)
    from_batch = s[(s > 0).all(1)]
    assert from_batch.shape[0] == 4 and ((s <= 0).all(1)).sum() == 4
    rows = {tuple(r) for r in batch.tolist()}
    assert all(tuple(r) in rows for r in from_batch.tolist())
    assert len({tuple(r) for r in from_batch.tolist()}) == 4  # without replacement
    only_batch = BatchMixedContext(base, fraction=1.0).sample(30, batch_x=batch)
    assert only_batch.shape[0] == 30 and ((only_batch > 0).all(1)).sum() == 10  # capped at the batch size
    with pytest.raises(ValueError, match="batch_x"):
        mixed.sample(4)
    with pytest.raises(ValueError, match="fraction"):
        BatchMixedContext(base, fraction=1.5)
