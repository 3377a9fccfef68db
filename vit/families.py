"""Every model family qvl serves, declared once: the one place that names model types.

A :class:`Family` says how to recognise a model (its ``config.model_type`` values), where its vision config
sits in a config.json and how to read it (into a :class:`~qvl.vit.config.VisionConfig` or
:class:`~qvl.vit.config.Qwen2VisionConfig`, which decides the qvl tower class, the metadata builder and the
block layout), where transformers' modules keep the parts qvl calls (:class:`ModuleNames`), how its processors
prepare images and videos (:class:`~qvl.vit.processing.Processing`), and which engine architectures carry its
tower (vLLM's and SGLang's model class names, with the names of their modules where they differ from
transformers').

Every entry point looks the family up here: ``patch_model`` (:mod:`qvl.vit.hf_patch`), ``load_tower`` /
``tower_from_hf`` (:mod:`qvl.vit.towers`), the towers' ``from_hf`` / ``from_pretrained``, ``qvl encode``
(:mod:`qvl.vit.cli`) and the vLLM and SGLang plugins (:mod:`qvl.vit.engines.vllm.tower`,
:mod:`qvl.vit.engines.sglang.tower`). A family of the same tower kinds (a fine-tune under a model type of its own) is
served by :func:`register` alone.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from .config import Qwen2VisionConfig, TowerConfig, VisionConfig
from .processing import QWEN2_VL_PROCESSING, QWEN3_VL_PROCESSING, Processing

__all__ = [
    "FAMILIES",
    "Family",
    "ModuleNames",
    "config_from_dict",
    "config_from_hf",
    "family_of",
    "family_of_config",
    "register",
    "sglang_architectures",
    "supported_model_types",
    "vllm_architectures",
]


@dataclasses.dataclass(frozen=True)
class ModuleNames:
    """Where a tower's module tree keeps the parts whose names differ between families and engines, as dotted
    paths (a digit indexes a sequence): the MLP's input linears (one for a GELU MLP; gate and up, or one stacked
    gate_up, for SwiGLU) and output linear under each block's ``mlp``, each merger's norm and two linears, the
    list of deepstack mergers, and each block's stacked q/k/v linear; under the tower, its main merger (None: the
    runner stops after the blocks) and its learned position table, a parameter whose owner the runner calls as a
    module (transformers' ``pos_embed.weight``) or, named without a dot, one of the tree's own (timm's ``pos_embed``,
    ``(1, side**2, C)``), read in the tree's own call."""

    mlp_in: tuple[str, ...]
    mlp_out: str
    merger_norm: str
    merger_fc1: str
    merger_fc2: str
    deepstack_mergers: str = "deepstack_merger_list"
    attn_qkv: str = "attn.qkv"
    merger: str | None = "merger"
    position_table: str = "pos_embed.weight"


QWEN3_VL_NAMES = ModuleNames(("linear_fc1",), "linear_fc2", "norm", "linear_fc1", "linear_fc2")
# Qwen3-Omni's mergers: (ln_q, mlp[0], GELU, mlp[2]), the deepstack ones in merger_list.
QWEN3_OMNI_NAMES = ModuleNames(("linear_fc1",), "linear_fc2", "ln_q", "mlp.0", "mlp.2", "merger_list")
QWEN2_5_VL_NAMES = ModuleNames(("gate_proj", "up_proj"), "down_proj", "ln_q", "mlp.0", "mlp.2")
QWEN2_VL_NAMES = ModuleNames(("fc1",), "fc2", "ln_q", "mlp.0", "mlp.2")
# vLLM and SGLang stack Qwen2.5-VL's gate and up into one linear.
STACKED_QWEN2_5_VL_NAMES = dataclasses.replace(QWEN2_5_VL_NAMES, mlp_in=("gate_up_proj",))
# SGLang's towers call the stacked q/k/v linear of their VisionAttention layers qkv_proj.
SGLANG_QWEN3_VL_NAMES = dataclasses.replace(QWEN3_VL_NAMES, attn_qkv="attn.qkv_proj")
# timm's qwen3_vit encoders (qvl.vit.timm_patch): Mlp fc1/fc2 in the blocks, the projector's norm/fc1/fc2, the
# position table a parameter of the encoder itself.
TIMM_QWEN3_VIT_NAMES = ModuleNames(("fc1",), "fc2", "norm", "fc1", "fc2", position_table="pos_embed")


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
        name: for messages (``"Qwen3-VL"``).
        model_types: ``config.model_type`` of the models holding the tower (full models; Qwen3-Omni's thinker).
        vision_model_types: ``model_type`` of their vision configs (and so of transformers' vision modules).
        config_class: the config the tower is read into; the qvl tower class is the one built from it.
        config_options: keyword arguments of ``config_class.from_dict`` for this family (``deepstack=False``,
            ``windowed=True``, ...).
        config_path: the keys leading from a full model's config.json to its vision config.
        names: where transformers' modules of this family keep their MLP and merger parts.
        processing: how the family's processors prepare images and videos by default (transformers' defaults; a
            checkpoint's processor configs override them, :meth:`~qvl.vit.processing.Processing.for_checkpoint`).
        vllm_architectures: vLLM's model class names carrying this tower -> the vLLM module defining each.
        vllm_names: where vLLM's modules keep those parts (default: ``names``).
        sglang_architectures: SGLang's model class names carrying this tower.
        sglang_names: where SGLang's modules keep those parts (default: ``names``).
    """

    name: str
    model_types: tuple[str, ...]
    vision_model_types: tuple[str, ...]
    config_class: type
    names: ModuleNames
    processing: Processing
    config_options: Mapping[str, object] = dataclasses.field(default_factory=dict)
    config_path: tuple[str, ...] = ("vision_config",)
    vllm_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    vllm_names: ModuleNames | None = None
    sglang_architectures: tuple[str, ...] = ()
    sglang_names: ModuleNames | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "config_options", types.MappingProxyType(dict(self.config_options)))
        object.__setattr__(self, "vllm_architectures", types.MappingProxyType(dict(self.vllm_architectures)))

    @property
    def all_model_types(self) -> tuple[str, ...]:
        return self.model_types + self.vision_model_types

    def vision_section(self, values: dict) -> dict:
        """The vision config inside a config.json dict of this family (a full model's, a part's such as
        Qwen3-Omni's thinker, which holds ``vision_config`` itself, or the vision config itself): each key of
        ``config_path`` the dict holds is followed, the others skipped."""
        for key in self.config_path:
            if isinstance(values.get(key), dict):
                values = values[key]
        return values

    def read_config(self, values: dict) -> TowerConfig:
        """The tower config of a config.json dict (full or vision) of this family."""
        return self.config_class.from_dict(self.vision_section(values), **self.config_options)


_QWEN3_VL_MODULE = "vllm.model_executor.models.qwen3_vl"
_QWEN3_5_MODULE = "vllm.model_executor.models.qwen3_5"

FAMILIES: list[Family] = [
    Family(
        "Qwen3-VL",
        ("qwen3_vl",),
        ("qwen3_vl_vision",),
        VisionConfig,
        QWEN3_VL_NAMES,
        QWEN3_VL_PROCESSING,
        vllm_architectures={"Qwen3VLForConditionalGeneration": _QWEN3_VL_MODULE},
        sglang_architectures=("Qwen3VLForConditionalGeneration",),
        sglang_names=SGLANG_QWEN3_VL_NAMES,
    ),
    Family(
        "Qwen3-VL-MoE",
        ("qwen3_vl_moe",),
        ("qwen3_vl_moe_vision",),
        VisionConfig,
        QWEN3_VL_NAMES,
        QWEN3_VL_PROCESSING,
        vllm_architectures={"Qwen3VLMoeForConditionalGeneration": "vllm.model_executor.models.qwen3_vl_moe"},
        sglang_architectures=("Qwen3VLMoeForConditionalGeneration",),
        sglang_names=SGLANG_QWEN3_VL_NAMES,
    ),
    Family(
        "Qwen3.5",
        ("qwen3_5",),
        ("qwen3_5_vision",),
        VisionConfig,
        QWEN3_VL_NAMES,
        QWEN3_VL_PROCESSING,
        config_options={"deepstack": False},
        vllm_architectures={"Qwen3_5ForConditionalGeneration": _QWEN3_5_MODULE},
        sglang_architectures=("Qwen3_5ForConditionalGeneration",),
        sglang_names=SGLANG_QWEN3_VL_NAMES,
    ),
    Family(
        "Qwen3.5-MoE",
        ("qwen3_5_moe",),
        ("qwen3_5_moe_vision",),
        VisionConfig,
        QWEN3_VL_NAMES,
        QWEN3_VL_PROCESSING,
        config_options={"deepstack": False},
        vllm_architectures={"Qwen3_5MoeForConditionalGeneration": _QWEN3_5_MODULE},
        sglang_architectures=("Qwen3_5MoeForConditionalGeneration",),
        sglang_names=SGLANG_QWEN3_VL_NAMES,
    ),
    Family(
        "Qwen3-Omni-MoE",
        ("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
        ("qwen3_omni_moe_vision_encoder",),
        VisionConfig,
        QWEN3_OMNI_NAMES,
        QWEN3_VL_PROCESSING,
        config_path=("thinker_config", "vision_config"),
    ),
    Family(
        "Qwen2.5-VL",
        ("qwen2_5_vl",),
        ("qwen2_5_vl_vision",),
        Qwen2VisionConfig,
        QWEN2_5_VL_NAMES,
        QWEN2_VL_PROCESSING,
        config_options={"windowed": True},
        vllm_architectures={"Qwen2_5_VLForConditionalGeneration": "vllm.model_executor.models.qwen2_5_vl"},
        vllm_names=STACKED_QWEN2_5_VL_NAMES,
        sglang_architectures=("Qwen2_5_VLForConditionalGeneration",),
        sglang_names=dataclasses.replace(STACKED_QWEN2_5_VL_NAMES, attn_qkv="attn.qkv_proj"),
    ),
    Family(
        "Qwen2-VL",
        ("qwen2_vl",),
        ("qwen2_vl_vision",),
        Qwen2VisionConfig,
        QWEN2_VL_NAMES,
        QWEN2_VL_PROCESSING,
        config_options={"windowed": False},
        vllm_architectures={"Qwen2VLForConditionalGeneration": "vllm.model_executor.models.qwen2_vl"},
        sglang_architectures=("Qwen2VLForConditionalGeneration",),
        sglang_names=dataclasses.replace(QWEN2_VL_NAMES, attn_qkv="attn.qkv_proj"),
    ),
]
# A config.json without any model_type is read as a bare Qwen3-VL vision config.
DEFAULT_FAMILY = FAMILIES[0]


def register(family: Family) -> Family:
    """Add a family (a fine-tune of one of these towers under model types of its own); returns it. Raises
    ValueError when one of its model types or vLLM architectures is already taken."""
    taken = {model_type for known in FAMILIES for model_type in known.all_model_types}
    clash = sorted(taken.intersection(family.all_model_types))
    taken_archs = {arch for known in FAMILIES for arch in (*known.vllm_architectures, *known.sglang_architectures)}
    clash += sorted(taken_archs.intersection((*family.vllm_architectures, *family.sglang_architectures)))
    if clash:
        raise ValueError(f"register: {family.name} names what another family holds: {clash}")
    FAMILIES.append(family)
    return family


def family_of(model_type: str | None) -> Family | None:
    """The family a model's or vision config's ``model_type`` belongs to, or None."""
    return next((family for family in FAMILIES if model_type in family.all_model_types), None)


def supported_model_types() -> tuple[str, ...]:
    """Every ``model_type`` qvl serves: the models', then their vision configs'."""
    models = (model_type for family in FAMILIES for model_type in family.model_types)
    return (*models, *(model_type for family in FAMILIES for model_type in family.vision_model_types))


def _unsupported(model_type: object) -> ValueError:
    return ValueError(
        f"unsupported model_type {model_type!r}: qvl runs the vision towers of {', '.join(supported_model_types())}"
    )


def family_of_config(values: dict) -> Family:
    """The family of a config.json dict, by its ``model_type`` (a full model's, else its vision config's); one
    without any is a bare Qwen3-VL vision config. Raises ValueError naming an unsupported model type."""
    vision = values.get("vision_config") or {}
    model_type = values.get("model_type") or vision.get("model_type")
    if model_type is None:
        return DEFAULT_FAMILY
    family = family_of(model_type)
    if family is None:
        raise _unsupported(model_type)
    return family


def config_from_dict(values: dict) -> tuple[Family, TowerConfig]:
    """``(family, tower config)`` of a config.json dict (a full model's or a vision config)."""
    family = family_of_config(values)
    return family, family.read_config(values)


def config_from_hf(hf_config: object) -> tuple[Family, TowerConfig]:
    """``(family, tower config)`` of a transformers config: a vision config, or a full model's (its
    ``vision_config``; Qwen3-Omni's through ``thinker_config``). Raises ValueError for an unsupported one."""
    vision = getattr(getattr(hf_config, "thinker_config", hf_config), "vision_config", hf_config)
    model_type = getattr(vision, "model_type", None)
    family = family_of(model_type)
    if family is None or model_type not in family.vision_model_types:
        raise _unsupported(model_type)
    return family, family.config_class.from_dict(vision.to_dict(), **family.config_options)


def vllm_architectures() -> dict[str, tuple[Family, str]]:
    """vLLM's model class name -> (family, the vLLM module defining it), over every family."""
    return {arch: (family, module) for family in FAMILIES for arch, module in family.vllm_architectures.items()}


def sglang_architectures() -> dict[str, Family]:
    """SGLang's model class name -> family, over every family."""
    return {arch: family for family in FAMILIES for arch in family.sglang_architectures}
