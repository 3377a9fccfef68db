"""Folded image rows: an image's temporal slots hold the same frame, so its rows can hold it once (``C * p * p``
values, qvl.vit.encode.prepare's ``fold_images``) and the patch embedding use its weight's temporal slices summed
(qvl.vit.layers.embed_patches). The towers' features from folded rows are transformers' features from the
processor's (unfolded) rows within the tolerance rule, for both tower kinds; whole rows keep their path; a video
cannot come folded; the summed weight follows the weight; a compiled embedding traces without a graph break.
"""

import dataclasses
import pickle

import pytest
import torch

from qvl.kernels import force_backend
from qvl.vit import Qwen2VisionTransformer, VisionTransformer
from qvl.vit.encode.prepare import Preparer
from qvl.vit.layers import embed_patches, folded_patch_weight
from qvl.vit.processing import QWEN2_VL_PROCESSING, QWEN3_VL_PROCESSING
from tolerance import assert_error_within
from towers import (
    MODEL_STAGES,
    float64_qwen2_family_outputs,
    float64_vision_outputs,
    hf_qwen2_family_tower,
    hf_vision_model,
    vision_outputs,
)

IMAGE_SHAPES = [(40, 70), (33, 33)]  # (height, width)


def image_rows(processing, config, fold: bool):
    """Two random images prepared for ``config``'s tower: ``(rows, grids)``."""
    processing = dataclasses.replace(processing.for_checkpoint(config), min_pixels=32 * 32, max_pixels=96 * 96)
    prepare = Preparer(processing, "cpu", fold_images=fold)
    generator = torch.Generator().manual_seed(1)
    prepared = [prepare.image(torch.randint(0, 256, (*shape, 3), dtype=torch.uint8, generator=generator))
                for shape in IMAGE_SHAPES]  # fmt: skip
    return torch.cat([rows for rows, _ in prepared]), [grid for _, grid in prepared]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_qwen3_vl_images_give_transformers_features(dtype):
    hf = hf_vision_model(seed=2).to(dtype)
    tower = VisionTransformer.from_hf(hf)
    folded, grids = image_rows(QWEN3_VL_PROCESSING, tower.config, fold=True)
    rows, unfolded_grids = image_rows(QWEN3_VL_PROCESSING, tower.config, fold=False)
    assert grids == unfolded_grids and folded.shape[1] * tower.config.temporal_patch_size == rows.shape[1]
    rows = rows.to(dtype)
    with force_backend("torch"), torch.no_grad():
        merged, deepstack = tower(folded, grids)
        whole = tower(rows, grids)
    truth = float64_vision_outputs(hf, rows, grids)
    assert_error_within(
        [merged, *deepstack], truth, vision_outputs(hf, rows, grids), what="folded", stages=MODEL_STAGES
    )
    assert_error_within(
        [whole[0], *whole[1]], truth, vision_outputs(hf, rows, grids), what="whole rows", stages=MODEL_STAGES
    )


def test_folded_qwen2_vl_images_give_transformers_features():
    hf = hf_qwen2_family_tower("qwen2_vl", seed=3)
    tower = Qwen2VisionTransformer.from_hf(hf)
    assert tower.patch_embed.proj.bias is None
    folded, grids = image_rows(QWEN2_VL_PROCESSING, tower.config, fold=True)
    rows, _ = image_rows(QWEN2_VL_PROCESSING, tower.config, fold=False)
    with force_backend("torch"), torch.no_grad():
        merged, _ = tower(folded, grids)
        baseline = hf(rows, grid_thw=torch.tensor(grids)).pooler_output
    assert_error_within(
        merged, float64_qwen2_family_outputs("qwen2_vl", hf, rows, grids), baseline, stages=MODEL_STAGES
    )


def test_folded_rows_of_a_video_are_refused():
    tower = VisionTransformer.from_hf(hf_vision_model(seed=4))
    width = tower.config.folded_patch_dim
    with pytest.raises(ValueError, match="folded image rows, but the batch holds a video"):
        tower(torch.zeros(2 * 4 * 4, width), [[2, 4, 4]])
    with pytest.raises(ValueError, match="pixel_values must have shape"):
        tower(torch.zeros(16, width + 1), [[1, 4, 4]])


def test_the_summed_weight_follows_the_weight():
    """Summed once, then again only when the weight changes (written in place, or replaced): the summed weight kept is
    the current weight's (the same sum of the same tensor, bit for bit), and the embedding is the current weight's
    within the tolerance rule against float64 (a stale sum is off by the whole change). Not bit for bit against
    ``rows @ w.t() + bias``: the embedding's fused ``addmm`` rounds otherwise than a product and an add on some
    CPUs' BLAS."""
    proj = VisionTransformer.from_hf(hf_vision_model(seed=5)).patch_embed.proj.requires_grad_(False)
    rows = torch.randn(6, proj.in_channels * proj.kernel_size[1] * proj.kernel_size[2])

    def assert_embeds_the_current_weight(what: str) -> torch.Tensor:
        summed = folded_patch_weight(proj)
        assert torch.equal(summed, proj.weight.sum(2).flatten(1)), what
        truth = rows.double() @ proj.weight.double().sum(2).flatten(1).t() + proj.bias.double()
        baseline = rows @ proj.weight.sum(2).flatten(1).t() + proj.bias  # torch's product and add, in fp32
        assert_error_within(embed_patches(proj, rows), truth, baseline, what=what)
        return summed

    first = assert_embeds_the_current_weight("the weight as loaded")
    assert folded_patch_weight(proj) is first
    with torch.no_grad():
        proj.weight.mul_(2)
    written = assert_embeds_the_current_weight("the weight written in place")
    assert written is not first and folded_patch_weight(proj) is written
    proj.weight = torch.nn.Parameter(proj.weight.detach() + 1, requires_grad=False)
    assert assert_embeds_the_current_weight("a new weight") is not written
    # The module holds no cache of its own: it pickles as it did.
    assert not any(name.startswith("_qvl") for name in vars(proj))
    pickle.loads(pickle.dumps(proj))


def test_folded_embedding_traces_whole_and_has_gradients():
    proj = VisionTransformer.from_hf(hf_vision_model(seed=6)).patch_embed.proj
    rows = torch.randn(6, proj.in_channels * proj.kernel_size[1] * proj.kernel_size[2])
    compiled = torch.compile(embed_patches, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(proj, rows), embed_patches(proj, rows), rtol=0, atol=0)
    embed_patches(proj, rows).sum().backward()
    # Each temporal slice of the weight gets the gradient of the summed weight.
    expected = rows.sum(0).view(1, proj.in_channels, 1, *proj.kernel_size[1:]).expand_as(proj.weight)
    torch.testing.assert_close(proj.weight.grad, expected)
