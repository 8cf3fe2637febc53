"""Checkpoint files: what is hashed when, and what the background writer gets to see."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aura_hpc.train.checkpoint import files as checkpoint


def _model() -> torch.nn.Module:
    from aura_hpc.train.model.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2))


def test_unchanged_files_are_hashed_once_and_new_ones_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"x": 1}')
    hashed: list[str] = []
    real = checkpoint._sha256

    def counting(path: Path) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(checkpoint, "_sha256", counting)
    model = _model()
    for step in (1, 2):
        checkpoint.save(tmp_path / "ckpts", step, model, {"s": torch.ones(3)}, {"step": step}, tok, "a: 1\n", keep_last=5)
    assert hashed.count("tokenizer.json") == 1, hashed
    assert hashed.count("model.safetensors") == 2 and "trainer_state.pt" not in hashed and "meta.json" not in hashed, hashed
    for c in checkpoint.list_complete(tmp_path / "ckpts"):
        assert checkpoint.verify(c.path) is None  # the hashes computed while writing are the files' hashes


def test_a_snapshot_does_not_follow_later_training(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    snap = checkpoint.snapshot_model(model)
    state = checkpoint.host_copy({"optimizer": opt.state_dict()})
    before = {k: v.clone() for k, v in snap.weights.items()}
    moment = next(iter(state["optimizer"]["state"].values()))["exp_avg"].clone()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.step()
    assert all(torch.equal(before[k], snap.weights[k]) for k in before)
    assert torch.equal(moment, next(iter(state["optimizer"]["state"].values()))["exp_avg"])
    assert "lm_head.weight" not in snap.weights, "the tied output matrix is stored once, as transformers does"
    path = checkpoint.save(tmp_path, 7, snap, state, {"step": 7}, None, "", keep_last=1)
    from aura_hpc.train.model.language_model import load_pretrained

    loaded = load_pretrained(str(path / "model"))
    assert torch.equal(loaded.transformer.wte.weight, before["transformer.wte.weight"])
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
