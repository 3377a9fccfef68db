"""Hugging Face Hub model ids where a checkpoint directory is expected (``--model Qwen/Qwen3-VL-8B-Instruct``).

:func:`resolve_model` turns a Hub id into a directory of the Hugging Face cache holding only what the vision tower
needs: ``config.json``, the processor configs (:data:`~qvl.vit.checkpoint.PROCESSOR_CONFIG_FILES`) and the
safetensors shards that hold the tower's tensors, found through ``model.safetensors.index.json`` (a checkpoint
without an index has one ``model.safetensors``, fetched whole). The text model's shards are never fetched;
:func:`qvl.vit.checkpoint.load_vision_checkpoint` reads only the vision shards, so the partial snapshot loads.

Downloads go through ``huggingface_hub.hf_hub_download``, so the cache location (``HF_HOME``, ``HF_HUB_CACHE``),
tokens and endpoints are huggingface_hub's; with ``HF_HUB_OFFLINE=1`` only the cache is read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .checkpoint import PROCESSOR_CONFIG_FILES, SAFETENSORS_INDEX, CheckpointError, read_weight_map, vision_shards

__all__ = ["hub_offline", "resolve_model"]

_SINGLE_FILE = "model.safetensors"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` asks for the cache alone (read now, not when huggingface_hub was imported)."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "size unknown"
    if num_bytes < 1e6:
        return f"{num_bytes / 1e3:.1f} kB"
    if num_bytes < 1e9:
        return f"{num_bytes / 1e6:.1f} MB"
    return f"{num_bytes / 1e9:.2f} GB"


class _Repo:
    """One Hub model repository, fetched file by file into the cache."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.offline = hub_offline()

    def _fetch(self, filename: str, dry_run: bool = False):
        from huggingface_hub import hf_hub_download

        return hf_hub_download(self.repo_id, filename, local_files_only=self.offline, dry_run=dry_run)

    def fetch(self, filename: str, required: bool = True) -> Path | None:
        """``filename``'s path in the cache; None where it is optional and the repository (or, offline, the cache)
        lacks it. Raises :class:`CheckpointError` naming the repository and file."""
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        try:
            return Path(self._fetch(filename))
        # Not in the cache (offline, or the Hub unreachable); a subclass of EntryNotFoundError, so caught first.
        except LocalEntryNotFoundError:
            if required:
                raise self._not_cached(filename) from None
        except EntryNotFoundError:
            if required:
                raise CheckpointError(f"{self.repo_id}: the Hub repository has no {filename}") from None
        except Exception as error:  # noqa: BLE001 - huggingface_hub's HTTP, auth and OS errors alike
            raise self._failure(filename, error) from None
        return None

    def plan(self, filename: str):
        """huggingface_hub's dry run of fetching ``filename`` (its size and whether it is cached)."""
        try:
            return self._fetch(filename, dry_run=True)
        except Exception as error:  # noqa: BLE001
            raise self._failure(filename, error) from None

    def _not_cached(self, filename: str) -> CheckpointError:
        if self.offline:
            return CheckpointError(
                f"{self.repo_id}: {filename} is not in the Hugging Face cache and HF_HUB_OFFLINE is set"
                " (run once online, or unset HF_HUB_OFFLINE)"
            )
        return CheckpointError(f"{self.repo_id}: cannot download {filename} from the Hugging Face Hub (no connection?)")

    def _failure(self, filename: str, error: Exception) -> CheckpointError:
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

        if isinstance(error, LocalEntryNotFoundError):
            return self._not_cached(filename)
        if isinstance(error, GatedRepoError):
            return CheckpointError(f"{self.repo_id}: gated on the Hugging Face Hub (log in with hf auth login)")
        if isinstance(error, RepositoryNotFoundError):
            return CheckpointError(
                f"{self.repo_id}: no such directory, and no such model on the Hugging Face Hub (or it is private)"
            )
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        return CheckpointError(f"{self.repo_id}: cannot fetch {filename} from the Hugging Face Hub ({reason})")


def _fetch_tower(repo_id: str, log: Callable[[str], None]) -> Path:
    repo = _Repo(repo_id)
    directory = repo.fetch("config.json").parent
    for name in PROCESSOR_CONFIG_FILES:
        repo.fetch(name, required=False)
    if repo.fetch(SAFETENSORS_INDEX, required=False) is None:
        shards, of = [_SINGLE_FILE], 1
    else:
        weight_map = read_weight_map(directory)
        shards, of = vision_shards(weight_map), len(set(weight_map.values()))
        if not shards:
            raise CheckpointError(f"{repo_id}: {SAFETENSORS_INDEX} lists no vision tower tensors")
    plans = [repo.plan(shard) for shard in shards]
    missing = [plan for plan in plans if plan.will_download]
    if missing:
        total = sum(plan.file_size or 0 for plan in missing)
        files = ", ".join(f"{plan.filename} ({_size(plan.file_size)})" for plan in missing)
        log(
            f"downloading {repo_id} from the Hugging Face Hub, the vision tower only ({len(shards)} of {of} weight"
            f" files): {files}; {_size(total)} in all, into {directory.parent.parent}"
        )
    for shard in shards:
        repo.fetch(shard)
    return directory


def resolve_model(name: str, log: Callable[[str], None]) -> Path:
    """The checkpoint directory ``name`` means: an existing directory as it is; otherwise a Hugging Face Hub model id
    (``owner/name``), whose config, processor configs and vision shards are fetched into the Hugging Face cache
    (what is downloaded, and how large, is said through ``log``), and whose cached snapshot is returned. Raises
    :class:`CheckpointError` naming ``name`` for a path that is not a directory, a name that is neither (a name without
    an owner is taken for a directory), or a failed download."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{name}: not a directory")
        return path
    # The Hub takes bare names too (gpt2), but every Qwen vision checkpoint is owner/name: a bare word that is no
    # directory is a mistyped path, which would otherwise wait on the Hub's retries.
    if "/" not in name:
        raise CheckpointError(f"{name}: no such directory (nor a Hugging Face Hub model id, which is owner/name)")
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise CheckpointError(f"{name}: no such directory (nor a Hugging Face Hub model id)") from None
    return _fetch_tower(name, log)
