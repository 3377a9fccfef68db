"""Helpers of the ``qvl encode`` tests (tests/vit/test_cli.py, tests/vit/encode/): the command run in this process,
tiny inputs and checkpoints made here, and its outputs read back."""

import dataclasses
import json
import os
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image
from safetensors import safe_open

from qvl.kernels import force_backend
from qvl.vit import VisionConfig, VisionTransformer, cli
from qvl.vit.checkpoint import save_vision_checkpoint

# A tower that encodes a small image in milliseconds, even under Triton's interpreter.
TINY_CONFIG = VisionConfig(
    depth=2,
    hidden_size=64,
    num_heads=2,
    intermediate_size=128,
    out_hidden_size=96,
    deepstack_visual_indexes=(0,),
    num_position_embeddings=64,
)
# Video files of each container the CLI names, with an encoder PyAV's wheels carry (av 18: libx264,
# libvpx, mpeg4).
VIDEO_CODECS = {".mp4": "libx264", ".webm": "libvpx", ".mkv": "libx264", ".mov": "mpeg4"}


def encode(*argv, backend: str = "torch") -> int:
    """``qvl encode ARGV`` in this process on qvl's ``backend`` path, decoding in this process too unless ARGV says
    ``--workers`` (its last value counts)."""
    with force_backend(backend):
        return cli.main(["encode", "--workers", "0", *map(str, argv)])


def save_checkpoint(directory: Path, config: VisionConfig = TINY_CONFIG, seed: int = 3) -> VisionTransformer:
    """A random-weight tower of ``config`` saved as a checkpoint directory (created); returns the tower."""
    tower = VisionTransformer(config).init_random_weights(seed)
    directory.mkdir(parents=True, exist_ok=True)
    save_vision_checkpoint(directory, dataclasses.asdict(config), tower.state_dict())
    return tower


def random_picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def make_video(path: Path, frames: int, fps: int, seed: int = 0, size: int = 64) -> Path:
    """A video file of ``frames`` frames of noise (every frame differs from its neighbours), ``size`` pixels square,
    in the container ``path``'s suffix names (:data:`VIDEO_CODECS`)."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(VIDEO_CODECS[path.suffix], rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def read_output(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A single-file output's tensors and metadata."""
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata()


def read_folder(folder: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """A shard folder's tensors (every shard's; a key written into two shards fails) and its index.jsonl entries,
    each of whose shards exists."""
    tensors = {}
    for shard in sorted(folder.glob("shard-*.safetensors")):
        shard_tensors, _ = read_output(shard)
        assert not shard_tensors.keys() & tensors.keys(), f"{shard.name} repeats {shard_tensors.keys() & tensors}"
        tensors.update(shard_tensors)
    lines = (folder / "index.jsonl").read_text(encoding="utf-8").splitlines()
    entries = [json.loads(line) for line in lines]
    assert all(os.path.exists(folder / entry["shard"]) for entry in entries)
    return tensors, entries
