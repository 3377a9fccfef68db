"""``qvl encode --model OWNER/NAME``: a Hugging Face Hub model id, against a local stand-in for the Hub (no network).

The stand-in is a repository folder served through a fake ``huggingface_hub.hf_hub_download`` that copies into a
cache laid out as huggingface_hub lays it out, and records what was fetched; the offline test uses the real
``hf_hub_download`` on a prepared cache with ``HF_HUB_OFFLINE=1``.
"""

import dataclasses
import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError
from PIL import Image
from safetensors.torch import save_file

from encoding import TINY_CONFIG, encode, read_output
from qvl.vit import VisionTransformer
from qvl.vit.hub import resolve_model

REPO_ID = "acme/tiny-vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXT_SHARD = "model-00001-of-00002.safetensors"
VISION_SHARD = "model-00002-of-00002.safetensors"


@pytest.fixture(scope="module")
def remote(tmp_path_factory) -> Path:
    """A full Qwen3-VL checkpoint as the Hub serves it: config, processor configs, an index, a text-only shard and
    the shard holding the vision tower."""
    folder = tmp_path_factory.mktemp("remote")
    tower = VisionTransformer(TINY_CONFIG).init_random_weights(4)
    vision = {f"model.visual.{name}": t.contiguous() for name, t in tower.state_dict().items()}
    text = {"model.language_model.embed_tokens.weight": torch.zeros(32, 8), "lm_head.weight": torch.zeros(32, 8)}
    save_file(text, str(folder / TEXT_SHARD))
    save_file(vision, str(folder / VISION_SHARD))
    weight_map = {name: TEXT_SHARD for name in text} | {name: VISION_SHARD for name in vision}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    vision_config = {**dataclasses.asdict(TINY_CONFIG), "model_type": "qwen3_vl_vision"}
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": vision_config}))
    preprocessor = {"size": {"longest_edge": 16777216, "shortest_edge": 4096}, "image_mean": [0.5] * 3}
    (folder / "preprocessor_config.json").write_text(json.dumps({**preprocessor, "image_std": [0.5] * 3}))
    return folder


def snapshot(cache: Path) -> Path:
    return cache / "models--acme--tiny-vl" / "snapshots" / COMMIT


class StandInHub:
    """``hf_hub_download`` over the folder ``remote``, into ``cache`` (huggingface_hub's layout)."""

    def __init__(self, remote: Path, cache: Path):
        self.remote, self.cache, self.fetched = remote, cache, []

    def __call__(self, repo_id, filename, *, local_files_only=False, dry_run=False, **kwargs):
        assert not kwargs, kwargs
        target = snapshot(self.cache) / filename
        if repo_id != REPO_ID:
            raise EntryNotFoundError(f"{repo_id}: no such repository in the stand-in")
        if not (self.remote / filename).is_file():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        if dry_run:
            size = (self.remote / filename).stat().st_size
            cached = target.is_file()
            return types.SimpleNamespace(filename=filename, file_size=size, is_cached=cached, will_download=not cached)
        if not target.is_file():
            if local_files_only:
                raise LocalEntryNotFoundError(f"{filename} not cached")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.remote / filename, target)
            self.fetched.append(filename)
        return str(target)


@pytest.fixture
def hub(remote, tmp_path, monkeypatch) -> StandInHub:
    stand_in = StandInHub(remote, tmp_path / "cache")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", stand_in)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return stand_in


def photo(tmp_path: Path) -> Path:
    path = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (70, 90, 3), dtype=np.uint8)).save(path)
    return path


def test_hub_id_fetches_only_the_tower_and_encodes_as_the_directory(hub, remote, tmp_path, capsys):
    image = photo(tmp_path)
    assert encode(image, "--model", REPO_ID, "-o", tmp_path / "hub.safetensors") == 0
    log = capsys.readouterr().err
    size = (remote / VISION_SHARD).stat().st_size
    assert f"downloading {REPO_ID} from the Hugging Face Hub, the vision tower only (1 of 2 weight files)" in log
    assert f"{VISION_SHARD} ({size / 1e6:.1f} MB)" in log
    assert sorted(hub.fetched) == sorted(
        ["config.json", "preprocessor_config.json", "model.safetensors.index.json", VISION_SHARD]
    )

    assert encode(image, "--model", remote, "-o", tmp_path / "dir.safetensors") == 0
    from_hub, metadata = read_output(tmp_path / "hub.safetensors")
    from_directory, _ = read_output(tmp_path / "dir.safetensors")
    assert metadata["model"] == REPO_ID
    assert from_hub.keys() == from_directory.keys()
    assert all(torch.equal(from_hub[name], from_directory[name]) for name in from_hub)

    # Cached now: nothing more is fetched, and nothing said about downloading.
    capsys.readouterr()
    fetched = list(hub.fetched)
    assert encode(image, "--model", REPO_ID, "-o", tmp_path / "again.safetensors") == 0
    assert hub.fetched == fetched and "downloading" not in capsys.readouterr().err


def test_offline_reads_the_cache_alone(remote, tmp_path, monkeypatch):
    """The real hf_hub_download with HF_HUB_OFFLINE=1 on a cache laid out as huggingface_hub lays it out (refs/main
    naming the snapshot); a shard missing from it is an error naming HF_HUB_OFFLINE."""
    cache = tmp_path / "cache"
    for name in ("config.json", "preprocessor_config.json", "model.safetensors.index.json", VISION_SHARD):
        (snapshot(cache)).mkdir(parents=True, exist_ok=True)
        shutil.copy(remote / name, snapshot(cache) / name)
    (cache / "models--acme--tiny-vl" / "refs").mkdir()
    (cache / "models--acme--tiny-vl" / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    said = []
    assert resolve_model(REPO_ID, said.append) == snapshot(cache)
    assert said == []
    assert encode(photo(tmp_path), "--model", REPO_ID, "-o", tmp_path / "out.safetensors") == 0

    (snapshot(cache) / VISION_SHARD).unlink()
    with pytest.raises(ValueError, match=f"{REPO_ID}: {VISION_SHARD} is not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model(REPO_ID, said.append)


def test_names_that_are_neither_a_directory_nor_a_hub_model(hub, tmp_path, capsys):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    for name, reason in [
        (file, f"{file}: not a directory"),
        ("./no-such-dir", "./no-such-dir: no such directory (nor a Hugging Face Hub model id)"),
        ("no such/model", "no such/model: no such directory (nor a Hugging Face Hub model id)"),
        # A mistyped local directory is said at once, without asking the Hub.
        ("q3vl_typo", "q3vl_typo: no such directory (nor a Hugging Face Hub model id, which is owner/name)"),
        ("acme/other", "acme/other: the Hub repository has no config.json"),
    ]:
        assert encode(photo(tmp_path), "--model", name, "-o", tmp_path / "out.safetensors") == 2
        assert capsys.readouterr().err.strip().endswith(reason), name
    assert hub.fetched == [] and not (tmp_path / "out.safetensors").exists()
