"""Figure axes that do not magnify noise: the training curves' effective-patches panel starts at 0 patches."""

from __future__ import annotations

from harness import figures


def test_effective_patches_of_near_uniform_weights_do_not_look_like_a_fall(tmp_path, monkeypatch):
    """The quickstart's rollout weights go from 64.0 to 63.75 effective patches of 64: drawn from 0, that quarter
    patch is under 1% of the panel's height (auto-scaled, it spanned the whole panel)."""
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path: drawn.append(fig))
    rows = [{"epoch": e, "train_loss": 2.0, "eval_top1": 20.0, "rollout_effective_patches": p}
            for e, p in ((1, 64.0), (2, 63.9), (3, 63.75))]
    figures.plot_training_curves({"rollout": {0: rows}}, tmp_path / "curves.png", "Training")
    (ax,) = [a for a in drawn[0].axes if a.get_title() == figures.CURVE_PANELS["rollout_effective_patches"][1]]
    low, high = ax.get_ylim()
    assert low == 0 and high >= 64.0
    assert (64.0 - 63.75) / (high - low) < 0.01
