"""Importing the original study's checkpoints: a reference model built from its description, both key
layouts, both poolings, the CLI and its errors."""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file
from torch import nn

import timm_rollout
import timm_rollout.cli
from timm_rollout.checkpoint import save_model
from timm_rollout.convert import convert_checkpoint, guess_pooling, load_original, map_keys
from timm_rollout.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# attribute names of the original code's two versions
LAYOUT_NAMES = {
    "new": dict(patch="patch", cls="cls", pos="pos", n1="n1", n2="n2"),
    "old": dict(patch="patch_embed", cls="cls_token", pos="pos_embed", n1="norm1", n2="norm2"),
}


class RefBlock(nn.Module):
    """Pre-norm block on torch.nn.MultiheadAttention, as in the original study."""

    def __init__(self, dim: int, heads: int, names: dict) -> None:
        super().__init__()
        self.n1_name, self.n2_name = names["n1"], names["n2"]
        self.add_module(self.n1_name, nn.LayerNorm(dim, eps=1e-5))
        self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.add_module(self.n2_name, nn.LayerNorm(dim, eps=1e-5))
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = getattr(self, self.n1_name)(x)
        out, weights = self.attn(h, h, h, need_weights=True, average_attn_weights=True)
        x = x + out
        return x + self.mlp(getattr(self, self.n2_name)(x)), weights


class RefViT(nn.Module):
    """The original study's plain PyTorch ViT, pooling by [CLS] or by attention rollout."""

    def __init__(self, layout: str, pooling: str, dim: int = 32, depth: int = 2, heads: int = 4,
                 patch: int = 4, img: int = 32, classes: int = 10) -> None:
        super().__init__()
        names = LAYOUT_NAMES[layout]
        self.names, self.pooling = names, pooling
        self.add_module(names["patch"], nn.Conv2d(3, dim, patch, patch))
        self.register_parameter(names["cls"], nn.Parameter(torch.randn(1, 1, dim) * 0.5))
        self.register_parameter(names["pos"], nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.5))
        self.blocks = nn.ModuleList(RefBlock(dim, heads, names) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = getattr(self, self.names["patch"])(img).flatten(2).transpose(1, 2)
        cls = getattr(self, self.names["cls"]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + getattr(self, self.names["pos"])
        weights = []
        for block in self.blocks:
            x, w = block(x)
            weights.append(w)
        x = self.norm(x)
        if self.pooling == "cls":
            return self.head(x[:, 0])
        n = x.shape[1]
        eye = torch.eye(n)
        rollout = eye.expand(x.shape[0], n, n)
        for w in weights:  # first layer to last: R = A_L ... A_1
            a = (w + eye) / 2
            rollout = (a / a.sum(-1, keepdim=True)) @ rollout
        row = rollout[:, 0, 1:]
        row = row / row.sum(-1, keepdim=True)
        return self.head((row.unsqueeze(-1) * x[:, 1:]).sum(1))


def reference(layout: str, pooling: str, **kwargs) -> RefViT:
    torch.manual_seed(0)
    model = RefViT(layout, pooling, **kwargs).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mis-mapped parameter shows
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.Linear, nn.Conv2d, nn.MultiheadAttention)):
                for name, p in m.named_parameters(recurse=False):
                    p.add_(torch.randn_like(p) * (0.3 if "weight" in name and p.dim() == 1 else 0.05))
    return model


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("layout", ["new", "old"])
@pytest.mark.parametrize("pooling", ["cls", "rollout"])
def test_converted_logits_match_reference(tmp_path, images, layout, pooling):
    ref = reference(layout, pooling)
    src = tmp_path / f"study_{pooling}.pth"
    torch.save(ref.state_dict(), src)
    model = convert_checkpoint(src, tmp_path / "out", pooling, label_names=[f"c{i}" for i in range(10)])
    with torch.no_grad():
        want, got = ref(images), model(images)
    assert got.shape == (4, 10)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # the other pooling gives different logits: the comparison has power
    assert not torch.allclose(reference(layout, "cls" if pooling == "rollout" else "rollout")(images), want, atol=1e-3)
    # and the folder loads back through timm with the same outputs
    loaded = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(images), got)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architecture"] == f"vit_tiny_cifar_{pooling}" and cfg["num_classes"] == 10
    assert cfg["model_args"]["depth"] == 2 and cfg["model_args"]["embed_dim"] == 32
    assert cfg["label_names"] == [f"c{i}" for i in range(10)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    # the export is training's: byte for byte what save_model writes for the same model
    save_model(tmp_path / "train_export", model, cfg["label_names"], model.pretrained_cfg["mean"],
               model.pretrained_cfg["std"])
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "train_export" / name).read_bytes()


def test_qkv_is_the_packed_in_projection(tmp_path):
    ref = reference("new", "cls")
    state = map_keys(ref.state_dict())
    assert torch.equal(state["blocks.1.attn.qkv.weight"], ref.blocks[1].attn.in_proj_weight)
    assert torch.equal(state["blocks.1.attn.proj.bias"], ref.blocks[1].attn.out_proj.bias)
    assert torch.equal(state["blocks.0.mlp.fc2.weight"], ref.blocks[0].mlp[3].weight)


def test_study_architecture_and_wrapped_state_dict(tmp_path, images):
    """The study's own size (dim 128, depth 6, 4 heads, 100 classes), saved inside {'model': ...}."""
    ref = reference("old", "rollout", dim=128, depth=6, classes=100)
    src = tmp_path / "vit_rollout.pth"
    torch.save({"model": ref.state_dict(), "epoch": 199}, src)
    model = convert_checkpoint(src, tmp_path / "out", guess_pooling(src))
    assert model.default_cfg["architecture"] == "vit_tiny_cifar_rollout"
    n_ref = sum(p.numel() for p in ref.parameters())
    assert sum(p.numel() for p in model.parameters()) == n_ref
    assert len(load_file(tmp_path / "out" / "model.safetensors")) == len(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(model(images), ref(images), atol=1e-4)


@pytest.mark.parametrize(
    ("name", "pooling"),
    [("rollout.pth", "rollout"), ("vit_CLS_seed0.pt", "cls"), ("baseline.pth", "cls"), ("token_pool.pth", "cls")],
)
def test_guess_pooling(name, pooling):
    assert guess_pooling(Path("/x") / name) == pooling


@pytest.mark.parametrize("name", ["model.pth", "rollout_vs_cls.pth"])
def test_guess_pooling_refuses(name):
    with pytest.raises(UserError, match="pass --pooling"):
        guess_pooling(name)


def test_unknown_keys_are_listed(tmp_path):
    state = reference("new", "cls").state_dict()
    state["blocks.0.attn.extra"] = torch.zeros(1)
    state["norm1.weight"] = torch.zeros(1)  # an old-layout key inside a new-layout file
    with pytest.raises(UserError, match=r"unknown keys.*blocks\.0\.attn\.extra, norm1\.weight"):
        map_keys(state)


def test_not_a_study_checkpoint(tmp_path):
    src = tmp_path / "cls.pth"
    torch.save(timm.create_model("vit_tiny_cifar_cls", depth=1).state_dict(), src)  # already timm keys
    with pytest.raises(UserError, match="not an original-study state dict"):
        convert_checkpoint(src, tmp_path / "out", "cls")


def test_missing_weights_are_listed(tmp_path):
    state = reference("new", "cls").state_dict()
    del state["blocks.1.n2.bias"]
    src = tmp_path / "cls.pth"
    torch.save(state, src)
    with pytest.raises(UserError, match=r"lacks weights for: blocks\.1\.norm2\.bias"):
        convert_checkpoint(src, tmp_path / "out", "cls")


def test_pickled_objects_are_refused(tmp_path):
    src = tmp_path / "rollout.pth"
    torch.save({"model": reference("new", "cls").state_dict(), "args": argparse.Namespace(lr=1e-3)}, src)
    with pytest.raises(UserError, match=r"\(Unsupported global: GLOBAL argparse.Namespace\) and is refused"):
        load_original(src)


def test_a_truncated_or_foreign_file_is_one_line_error(tmp_path):
    whole = tmp_path / "whole.pth"
    torch.save(reference("new", "cls").state_dict(), whole)
    cut = tmp_path / "cut_cls.pth"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    zipped = tmp_path / "zip_cls.pth"
    zipped.write_bytes(b"PK\x03\x04" + bytes(200))  # a zip header, then nothing a torch.save file holds
    for src in (cut, zipped):
        with pytest.raises(UserError, match=rf"{src.name} is not a readable torch.save checkpoint \(\w+Error: "):
            load_original(src)


def test_heads_must_divide_dim(tmp_path):
    src = tmp_path / "cls.pth"
    torch.save(reference("new", "cls").state_dict(), src)
    with pytest.raises(UserError, match="not divisible by --num-heads 5"):
        convert_checkpoint(src, tmp_path / "out", "cls", num_heads=5)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_guesses_and_prints(tmp_path, capsys, images):
    ref = reference("new", "rollout")
    src = tmp_path / "rollout_seed1.pth"
    torch.save(ref.state_dict(), src)
    out = tmp_path / "out"
    load_script("convert_checkpoint").main([str(src), str(out), "--mean", "0.5", "0.5", "0.5", "--std", "1", "1", "1"])
    captured = capsys.readouterr()
    assert "pooling guessed from the file name: rollout" in captured.err
    assert "vit_tiny_cifar_rollout" in captured.out and "4 heads" in captured.out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pretrained_cfg"]["mean"] == [0.5] * 3 and cfg["pretrained_cfg"]["std"] == [1.0] * 3
    assert math.isclose(cfg["model_args"]["mlp_ratio"], 4.0)


def test_cli_cannot_guess_exits_2(tmp_path, capsys):
    src = tmp_path / "weights.pth"
    torch.save(reference("new", "cls").state_dict(), src)
    with pytest.raises(SystemExit) as e:
        timm_rollout.cli.run_cli(load_script("convert_checkpoint").main, [str(src), str(tmp_path / "o")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: file name 'weights.pth' names no pooling; pass --pooling cls or --pooling rollout"
    )
