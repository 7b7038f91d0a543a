"""The Qwen3.6 family's static configuration (text and vision), from an HF `config.json`.

Owns: every dimension and static choice of the family (dense or MoE, layer pattern, rotary
dims). It is frozen and hashable so it can be a static argument of `jax.jit`. It knows nothing of
weights, files or devices.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Literal

from ninfer_jax.errors import ConfigError

LINEAR = "linear_attention"
FULL = "full_attention"

_DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
_VISION_ACTS = ("gelu_pytorch_tanh", "gelu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Static configuration of the vision tower (hashable; a jit static arg)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision_config.{name} must be positive, "
                                  f"got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ConfigError(
                f"vision_config.hidden_size ({self.hidden_size}) / num_heads ({self.num_heads})"
                f" must be a whole head dim divisible by 4 (2-D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ConfigError(f"vision_config.num_position_embeddings "
                              f"({self.num_position_embeddings}) must be a square")
        if self.hidden_act not in _VISION_ACTS:
            raise ConfigError(f"unsupported vision_config.hidden_act {self.hidden_act!r}; "
                              f"supported: {', '.join(_VISION_ACTS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row: C x temporal_patch x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (spatial_merge_size squared)."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        def need(key: str) -> Any:
            if key not in d:
                raise ConfigError(f"config.json vision_config is missing {key!r}")
            return d[key]

        rope = dict(d.get("rope_parameters") or {})
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(d.get(key), (list, tuple)):
                raise ConfigError(f"vision_config.{key} as a list is not supported, got {d[key]}")
        return cls(
            depth=int(need("depth")), hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")), num_heads=int(need("num_heads")),
            out_hidden_size=int(need("out_hidden_size")),
            in_channels=int(d.get("in_channels", 3)), patch_size=int(d.get("patch_size", 16)),
            temporal_patch_size=int(d.get("temporal_patch_size", 2)),
            spatial_merge_size=int(d.get("spatial_merge_size", 2)),
            num_position_embeddings=int(d.get("num_position_embeddings", 2304)),
            hidden_act=str(d.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static configuration of one Qwen3.6-family text model (hashable; a jit static arg)."""

    variant: Literal["dense", "moe"]
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    # Gated full attention.
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # GatedDeltaNet.
    conv_kernel: int
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    # MLP (dense) or MoE.
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Everything else.
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    mtp_num_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    gdn_chunk_size: int = 64
    # MRoPE: rotary frequency i (of rotary_dim / 2) turns with the height row if i % 3 == 1 and
    # i < 3 * section[1], the width row if i % 3 == 2 and i < 3 * section[2], else the temporal
    # row (transformers' interleaved layout). Text positions are equal in all three rows.
    mrope_section: tuple[int, ...] = (11, 11, 10)
    # Vision (a ...ForConditionalGeneration checkpoint): the tower and its special tokens.
    vision: VisionConfig | None = None
    image_token_id: int = -1
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "linear_num_k_heads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_q_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.linear_num_v_heads % self.linear_num_k_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_k_heads})"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"rotary dims int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be "
                f"even and in (0, head_dim={self.head_dim}]"
            )
        bad = sorted(set(self.layer_types) - {LINEAR, FULL})
        if bad:
            raise ConfigError(f"layer_types has unsupported entries {bad}; known: {LINEAR}, {FULL}")
        if self.conv_kernel < 2:
            raise ConfigError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")
        if len(self.mrope_section) != 3 or min(self.mrope_section) < 0:
            raise ConfigError(f"rope_parameters.mrope_section must be 3 non-negative ints, got "
                              f"{list(self.mrope_section)}")
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ConfigError(
                f"vision_config.out_hidden_size ({self.vision.out_hidden_size}) must equal the "
                f"text hidden_size ({self.hidden_size})")
        if self.variant == "moe" and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"1..num_experts ({self.num_experts})"
            )

    @property
    def vision_token_ids(self) -> tuple[int, int, int, int]:
        """(image, video, vision start, vision end) token ids."""
        return (self.image_token_id, self.video_token_id, self.vision_start_token_id,
                self.vision_end_token_id)

    @property
    def takes_media(self) -> bool:
        """Whether images and videos can be used with this model: a vision tower, and its
        special tokens inside the vocabulary (a text checkpoint repackaged with a tiny
        vocabulary may carry the tower but not the tokens)."""
        return self.vision is not None and all(
            0 <= t < self.vocab_size for t in self.vision_token_ids)

    # Derived sizes -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_k_heads * self.linear_k_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_v_heads * self.linear_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v]."""
        return 2 * self.linear_key_size + self.linear_value_size

    @property
    def layer_period(self) -> int:
        """Smallest p such that the layer pattern repeats every p layers (the scan group size)."""
        n = self.num_layers
        for p in range(1, n + 1):
            if n % p == 0 and self.layer_types == self.layer_types[:p] * (n // p):
                return p
        return n

    # Construction --------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """Builds the config from an HF `config.json` dict (flat, or nested `text_config`)."""
        model_type = config.get("model_type")
        if model_type not in _DENSE_TYPES + _MOE_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}; supported: {', '.join(_DENSE_TYPES + _MOE_TYPES)}"
            )
        text = config.get("text_config") or config
        if not isinstance(text, dict):
            raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
        variant = "moe" if model_type in _MOE_TYPES else "dense"

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json is missing {key!r}")
            return text[key]

        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {text['hidden_act']!r}; supported: 'silu'")
        if text.get("attention_bias", False):
            raise ConfigError("unsupported attention_bias=true; the Qwen3.6 family has none")
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"unsupported rope_type {rope_type!r}; supported: 'default'")
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        mrope_section = tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10)))

        num_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
            )
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        moe_kwargs = {}
        if variant == "moe":
            moe_kwargs = dict(
                num_experts=int(need("num_experts")),
                num_experts_per_tok=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
            )
        else:
            moe_kwargs = dict(intermediate_size=int(need("intermediate_size")))
        vision_kwargs = {}
        if config.get("vision_config") is not None:
            if not isinstance(config["vision_config"], dict):
                raise ConfigError("vision_config must be an object")
            vision_kwargs = dict(vision=VisionConfig.from_hf_dict(config["vision_config"]), **{
                name: int(config.get(name, default)) for name, default in (
                    ("image_token_id", 248056), ("video_token_id", 248057),
                    ("vision_start_token_id", 248053), ("vision_end_token_id", 248054))})
        return cls(
            variant=variant,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            layer_types=tuple(layer_types),
            num_q_heads=int(need("num_attention_heads")),
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=rope_theta,
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            linear_num_k_heads=int(need("linear_num_key_heads")),
            linear_num_v_heads=int(need("linear_num_value_heads")),
            linear_k_dim=int(need("linear_key_head_dim")),
            linear_v_dim=int(need("linear_value_head_dim")),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(tie),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            mtp_num_layers=int(text.get("mtp_num_hidden_layers", 0)),
            eos_token_ids=eos_ids,
            mrope_section=mrope_section,
            **moe_kwargs,
            **vision_kwargs,
        )

    @classmethod
    def from_hf_dir(cls, path: str | pathlib.Path) -> ModelConfig:
        file = pathlib.Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            return cls.from_hf_dict(json.loads(file.read_text()))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if "mrope_section" in d:
            d["mrope_section"] = tuple(d["mrope_section"])
        if d.get("vision") is not None:
            d["vision"] = VisionConfig(**d["vision"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
