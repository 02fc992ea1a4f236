"""The front README's Python snippets run as pasted, offline, each in a fresh namespace.

A snippet preceded by ``<!-- snippet: skip (reason) -->`` is skipped with that reason. One whose first line says
``# needs the network`` runs as on a machine without network: it must stop within seconds (or run from the cache).
The snippets run in a folder holding ``runs/smoke``, as after the README's quickstart (here an untrained tiny model
saved the way training saves it).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import timm
import torch
from huggingface_hub.errors import LocalEntryNotFoundError

import timm_rollout  # noqa: F401  (registers the models)
from timm_rollout import online
from timm_rollout.checkpoint import save_model

README = Path(__file__).resolve().parents[1] / "README.md"
NETWORK = "# needs the network"
BLOCK = re.compile(r"(?:<!-- snippet: skip \((?P<skip>[^)]*)\) -->\n)?```python\n(?P<code>.*?)```", re.S)


def _snippets() -> list:
    found = [pytest.param(m["code"], marks=[pytest.mark.skip(reason=m["skip"])] if m["skip"] else [],
                          id=f"snippet{i}") for i, m in enumerate(BLOCK.finditer(README.read_text(encoding="utf-8")))]
    assert len(found) >= 3, "the README's Python snippets were not found"
    return found


@pytest.mark.parametrize("code", _snippets())
def test_readme_snippet_runs_as_pasted(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_cifar_rollout", num_classes=10)
    save_model(tmp_path / "runs" / "smoke", model, [f"c{i}" for i in range(10)], (0.5,) * 3, (0.25,) * 3)
    namespace: dict = {"__name__": "__readme__"}
    if code.startswith(NETWORK):
        monkeypatch.setattr(online, "hub_reachable", lambda: False)  # no network, as here and on many a cluster node
        start = time.perf_counter()
        try:
            exec(compile(code, str(README), "exec"), namespace)
        except LocalEntryNotFoundError:  # not in the cache
            pass
        assert time.perf_counter() - start < 20  # no retries against an unreachable Hub
        return
    exec(compile(code, str(README), "exec"), namespace)  # the README's own code
    if "feats" in namespace:  # the tiny-model snippet: rollout-pooled (B, 128) features, then the stock [CLS] model
        assert namespace["feats"].shape == (8, 128) and namespace["model"].global_pool == "token"
    if "maps" in namespace:  # the capture snippet: one (B, N, N) rollout over 196 patches + [CLS]
        assert namespace["maps"].shape == (2, 197, 197)


def test_the_front_readme_is_a_newcomers_page_of_at_most_300_lines() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    answer = text.split("## Install")[0].split("**The answer")[1]
    assert len(re.findall(r"\[[\u2212+-]?\d", answer)) <= 3  # a few numbers before Install: few intervals
