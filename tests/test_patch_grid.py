"""One patch-grid function for every figure (harness.figures.upsample_patch_map), right for any grid: against
drawings done by hand (one hot patch at a known row and column must light exactly its pixel rectangle), in the
array, in the rendered pixels of heatmaps.png and harness.explain's figure, and harness.eval end to end on a
model with a 4x16 patch grid."""

from __future__ import annotations

import io

import datasets
import numpy as np
import pytest
import timm
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from PIL import Image
from timm.models import save_for_hf

import timm_rollout.explain as E
from harness import eval as harness_eval
from harness import figures
from harness.features import saliency_maps
from timm_rollout.data import load_image_set, normalize

# (image size, grid): a 4x16 grid of 4x4 patches; a 6x8 grid of non-square 8x6 patches (rows 8 high, columns 6 wide)
GRIDS = [((16, 64), (4, 16)), ((48, 48), (6, 8))]


def _hot(grid, row: int, col: int) -> torch.Tensor:
    values = torch.zeros(grid[0] * grid[1])
    values[row * grid[1] + col] = 1.0
    return values


def _by_hand(size, grid, row: int, col: int) -> np.ndarray:
    """The drawing: pixel (y, x) is hot when it lies in patch (row, col)'s rectangle, one pixel at a time."""
    (h, w), (rows, cols) = size, grid
    ph, pw = h // rows, w // cols
    return np.array([[float(row * ph <= y < (row + 1) * ph and col * pw <= x < (col + 1) * pw) for x in range(w)]
                     for y in range(h)])


@pytest.mark.parametrize(("size", "grid"), GRIDS)
def test_one_hot_patch_lights_exactly_its_pixel_rectangle(size, grid):
    for row in range(grid[0]):
        for col in range(grid[1]):
            drawn = figures.upsample_patch_map(_hot(grid, row, col), grid, size)
            assert drawn.shape == size and np.array_equal(drawn, _by_hand(size, grid, row, col)), (row, col)
    values = torch.arange(grid[0] * grid[1], dtype=torch.float32)
    assert np.array_equal(figures.upsample_patch_map(values, grid, grid), values.view(grid).numpy())  # the grid
    with pytest.raises(ValueError, match=f"63 patch values do not fill a {grid[0]}x{grid[1]} patch grid"):
        figures.upsample_patch_map(torch.zeros(63), grid, size)


def _hot_pixels(fig, ax, colour) -> tuple[int, int, int, int]:
    """(x0, y0, x1, y1) bounding box, in the rendered figure's pixels, of ``colour`` inside ``ax``."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    target = (np.asarray(to_rgba(colour)[:3]) * 255).round().astype(int)
    (x0, y0), (x1, y1) = ax.get_window_extent().get_points()
    height = rgba.shape[0]
    inside = np.zeros(rgba.shape[:2], dtype=bool)
    inside[int(height - y1) + 1:int(height - y0) - 1, int(x0) + 1:int(x1) - 1] = True
    ys, xs = np.nonzero((np.abs(rgba - target).sum(axis=-1) <= 6) & inside)
    return xs.min(), ys.min(), xs.max() + 1, ys.max() + 1


def _expected_pixels(fig, ax, size, grid, row, col) -> np.ndarray:
    """Where the patch's rectangle lands in the rendered figure: its pixel edges through the axes' transform."""
    (h, w), (rows, cols) = size, grid
    ph, pw = h // rows, w // cols
    corners = ax.transData.transform([(col * pw - 0.5, row * ph - 0.5), ((col + 1) * pw - 0.5, (row + 1) * ph - 0.5)])
    height = fig.canvas.get_width_height()[1]
    return np.array([corners[0, 0], height - corners[0, 1], corners[1, 0], height - corners[1, 1]])


@pytest.mark.parametrize(("size", "grid"), GRIDS)
def test_heatmaps_and_explain_draw_the_hot_patch_where_it_is(tmp_path, monkeypatch, size, grid):
    """The rendered pixels of the hottest colour, in heatmaps.png's map panel and in harness.explain's, cover the
    patch's rectangle and nothing else (to within a rendered pixel); the panel's array is the hand drawing."""
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    row, col = grid[0] - 2, grid[1] - 3
    hot = _hot(grid, row, col)
    images = torch.zeros(1, 3, *size, dtype=torch.uint8)
    figures.plot_heatmaps(images, {"map": hot[None]}, ["a"], ["a"], tmp_path / "h.png", "t", grid=grid)
    ex = E.Explanation(maps={"rollout": hot[None]}, buildup=hot.view(1, 1, -1), logits=torch.zeros(1, 2),
                       target=torch.zeros(1, dtype=torch.int64), grid=grid, readout="cls")
    figures.plot_explanation(ex, np.zeros((*size, 3)), "t", "input", tmp_path / "e.png")
    top = figures.relative_to_uniform(hot).max()
    for fig in drawn:
        ax = next(a for a in fig.axes if a.get_images() and a.get_images()[0].get_array().ndim == 2)
        (im,) = ax.get_images()
        assert np.array_equal(np.asarray(im.get_array()) > 0, _by_hand(size, grid, row, col) > 0)
        colour = im.get_cmap()(im.norm(float(top)))
        found = np.array(_hot_pixels(fig, ax, colour))
        assert np.abs(found - _expected_pixels(fig, ax, size, grid, row, col)).max() <= 1.5, found


def test_pooling_diagnostics_figure_draws_the_recorded_grid(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    weights = torch.rand(48, generator=torch.Generator().manual_seed(0))
    weights /= weights.sum()
    record = {"grid": [6, 8], "num_patches": 48, "mean_weights": weights.tolist(),
              "effective_patches_histogram": {"edges": [1.0, 24.0, 48.0], "counts": [1, 2]}}
    figures.plot_pooling_diagnostics({"rollout": [record]}, tmp_path / "p.png", "t")
    (im,) = [im for ax in drawn[0].axes for im in ax.get_images()]
    assert np.allclose(np.asarray(im.get_array()), (weights * 48).view(6, 8).numpy(), atol=1e-6)
    assert figures.recorded_grid({"num_patches": 64}) == (8, 8)  # records written before the grid was
    with pytest.raises(ValueError, match="without its grid"):
        figures.recorded_grid({"num_patches": 96})


def test_eval_draws_a_4x16_grid_and_writes_its_results(tmp_path, monkeypatch):
    """harness.eval on 16x64 images read by a rollout ViT with 4x4 patches: every heatmaps.png map panel is the
    model's map, recomputed here, with each patch value repeated over its 4x4 pixels (numpy's kron)."""
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(12):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (16, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
        pngs.append({"bytes": buf.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"image": pngs, "label": [i % 2 for i in range(12)]},
                                                             features=features)}).save_to_disk(str(tmp_path / "ds"))
    torch.manual_seed(0)
    mean, std = (0.5,) * 3, (0.25,) * 3
    save_for_hf(timm.create_model("vit_tiny_cifar_rollout", num_classes=2, img_size=(16, 64), patch_size=4, depth=2),
                tmp_path / "run", safe_serialization=True, data_config={"mean": mean, "std": std})
    drawn = []
    draw = figures.draw_map
    monkeypatch.setattr(figures, "draw_map", lambda ax, values, *a, **k: drawn.append(values) or draw(ax, values, *a,
                                                                                                        **k))
    results = harness_eval.main(["--model", f"local-dir:{tmp_path / 'run'}", "--dataset", str(tmp_path / "ds"),
                                 "--heatmaps", "2", "--k", "3", "--device", "cpu", "--amp", "none", "--output",
                                 str(tmp_path / "eval")])
    assert (tmp_path / "eval" / "results.json").is_file() and (tmp_path / "eval" / "heatmaps.png").is_file()
    assert results["pooling_diagnostics"]["grid"] == [4, 16]
    data = load_image_set(str(tmp_path / "ds"), "test")
    pick = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:2].sort().values
    model = timm.create_model(f"local-dir:{tmp_path / 'run'}", pretrained=True)
    found = saliency_maps(model, normalize(data.images[pick], mean, std), device=torch.device("cpu"))
    assert found.grid == (4, 16)
    want = [np.kron(figures.relative_to_uniform(found.maps[k][i]).view(4, 16).numpy(), np.ones((4, 4)))
            for i in range(2) for k in found.maps]
    assert len(drawn) == len(want)
    for got, ref in zip(drawn, want, strict=True):
        assert got.shape == (16, 64) and np.allclose(got, ref, atol=1e-5)


def test_heatmap_columns_each_have_their_own_colour_range_and_bar(tmp_path, monkeypatch):
    """One peaked column must not flatten the others: each column's range is 0 to its own largest share x P (at
    least 2, so a near-uniform map stays near one colour), computed here by hand, with one colour bar per column."""
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    peaked = torch.tensor([[9.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # largest share 0.9 of 4 patches: 3.6
    mild = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 2.0]])  # largest share 0.4: 1.6 -> the floor 2
    images = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    figures.plot_heatmaps(images, {"peaked": peaked, "mild": mild}, ["a", "b"], ["a", "b"], tmp_path / "h.png", "t",
                          grid=(2, 2))
    (fig,) = drawn
    limits = {ax.get_title().split("\n")[0]: ax.get_images()[0].get_clim() for ax in fig.axes
              if ax.get_images() and ax.get_title().split("\n")[0] in ("peaked", "mild")}
    assert limits["peaked"] == pytest.approx((0.0, 9 / 10 * 4)) and limits["mild"] == pytest.approx((0.0, 2.0))
    bars = [ax for ax in fig.axes if ax.get_xlabel() == figures.UNIFORM_SCALE_LABEL]
    assert len(bars) == 2


@pytest.mark.parametrize("size", [(16, 64), (32, 32), (64, 48)])
def test_heatmap_panels_take_the_images_aspect_without_empty_bands(tmp_path, monkeypatch, size):
    """Every panel of heatmaps.png fills the height the layout gives it: the image's own aspect (drawn with equal
    axes) leaves at most a sliver of that slot empty (it used to leave a 16x64 image three quarters of a square)."""
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    grid = (size[0] // 8, size[1] // 8)
    maps = {"a": _hot(grid, 0, 0).expand(2, -1), "b": _hot(grid, 1, 1).expand(2, -1)}
    figures.plot_heatmaps(torch.zeros(2, 3, *size, dtype=torch.uint8), maps, ["x", "y"], ["x", "y"],
                          tmp_path / "h.png", "t", grid=grid)
    (fig,) = drawn
    FigureCanvasAgg(fig).draw()  # applies each axes' equal aspect
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 6
    for ax in panels:
        slot, used = ax.get_position(original=True).height, ax.get_position().height  # fractions of the figure
        assert (slot - used) * fig.get_figheight() < 0.05 * slot * fig.get_figheight() + 0.02, (size, slot, used)
